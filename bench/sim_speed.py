#!/usr/bin/env python
"""Simulator speed: seconds per policy for GPUs x experts x layers x iterations, and the linear fit.

Runs every policy on a synthetic trace for several (layers, iterations) sizes, fits
``seconds = a + b * layers * iterations`` per policy (least squares), prints the fit, its worst
relative residual and the prediction for ``--target-layers`` x ``--target-iterations``; ``--full``
also runs that size and prints measured vs predicted.  Times are CPU seconds of this process
(``time.process_time``, single-threaded numpy): on the shared 2-core machine wall time mostly
measures the other jobs (the load average is printed with every result, and the wall time too).

    python bench/sim_speed.py --gpus 8192 --experts 256 [--full]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from megatron_moe.sim.cluster import load_cluster  # noqa: E402
from megatron_moe.sim.runner import simulate  # noqa: E402
from megatron_moe.sim.traces import synthetic_trace  # noqa: E402


def linear_fit(sizes, seconds):
    """Least-squares ``seconds = a + b * size``; returns (a, b, worst relative residual)."""
    x = np.asarray(sizes, dtype=np.float64)
    y = np.asarray(seconds, dtype=np.float64)
    A = np.stack([np.ones_like(x), x], axis=1)
    (a, b), *_ = np.linalg.lstsq(A, y, rcond=None)
    resid = np.abs(A @ np.array([a, b]) - y) / y
    return float(a), float(b), float(resid.max())


def main(argv=None):
    p = argparse.ArgumentParser(prog="bench/sim_speed.py", description=__doc__.split("\n")[0])
    p.add_argument("--gpus", type=int, default=8192)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--policies", nargs="+", default=["none", "deepspeed", "fastermoe", "flexmoe",
                                                      "proprophet", "proprophet+overlap"])
    p.add_argument("--sizes", nargs="+", default=["1x10", "1x20", "2x10", "2x20"],
                   help="LAYERSxITERATIONS points of the fit")
    p.add_argument("--target-layers", type=int, default=4)
    p.add_argument("--target-iterations", type=int, default=100)
    p.add_argument("--full", action="store_true", help="also run the target size")
    args = p.parse_args(argv)
    sizes = [tuple(int(v) for v in s.split("x")) for s in args.sizes]
    big_l = max([l for l, _ in sizes] + [args.target_layers if args.full else 0])
    big_i = max(i for _, i in sizes + [(0, args.target_iterations if args.full else 0)])
    t0 = time.process_time()
    trace = synthetic_trace(args.gpus, args.experts, big_i, big_l, 8192, 1.0, 0.05)
    print(f"trace {args.gpus} x {args.experts} x {big_l} layers x {big_i} iterations: "
          f"{time.process_time() - t0:.1f}s CPU (load {os.getloadavg()[0]:.1f})")
    cl = load_cluster(args.gpus)
    target = args.target_layers * args.target_iterations
    for pol in args.policies:
        secs, wall = [], 0.0
        for l, i in sizes:
            t, w = time.process_time(), time.perf_counter()
            simulate(trace[:i, :l], cl, pol)
            secs.append(time.process_time() - t)
            wall += time.perf_counter() - w
        a, b, worst = linear_fit([l * i for l, i in sizes], secs)
        line = (f"{pol:19} " + " ".join(f"{l}x{i}:{s:.2f}s" for (l, i), s in zip(sizes, secs))
                + f" | fit {a:.2f} + {b * 1e3:.1f} ms x layers x iterations (worst residual "
                  f"{100 * worst:.0f}%) -> {args.target_layers}x{args.target_iterations}: {a + b * target:.1f}s")
        if args.full:
            t, w = time.process_time(), time.perf_counter()
            simulate(trace[:args.target_iterations, :args.target_layers], cl, pol)
            line += f", measured {time.process_time() - t:.1f}s CPU ({time.perf_counter() - w:.1f}s wall)"
        print(line + f" (fit points {wall:.1f}s wall; load {os.getloadavg()[0]:.1f})", flush=True)


if __name__ == "__main__":
    main()
