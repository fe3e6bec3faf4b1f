#!/usr/bin/env python
"""Simulator speed: seconds per policy for GPUs x experts x layers x iterations, and the linear fit.

Runs every policy on a synthetic trace for several (layers, iterations) sizes, fits
``seconds = a + b * layers * iterations`` per policy (least squares), prints the fit, its worst
relative residual and the prediction for ``--target-layers`` x ``--target-iterations``; ``--full``
also runs that size and prints measured vs predicted.  Times are CPU seconds of this process
(``time.process_time``, single-threaded numpy): on the shared 2-core machine wall time mostly
measures the other jobs (the load average is printed with every result, and the wall time too).

    python bench/sim_speed.py --gpus 8192 --experts 256 [--full] [--before REV]

``--before REV`` then runs this same bench (same arguments) on git revision REV, checked out in a
temporary ``git worktree``, in a fresh process, and prints per policy the before / now ms per
layer-iteration of the fit, the measured target size when ``--full``, and the ratios.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
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
    p.add_argument("--before", metavar="REV", help="also run this bench on git revision REV and print "
                   "the before / now ratios")
    args = p.parse_args(argv)
    argv = sys.argv[1:] if argv is None else list(argv)
    sizes = [tuple(int(v) for v in s.split("x")) for s in args.sizes]
    big_l = max([l for l, _ in sizes] + [args.target_layers if args.full else 0])
    big_i = max(i for _, i in sizes + [(0, args.target_iterations if args.full else 0)])
    t0 = time.process_time()
    trace = synthetic_trace(args.gpus, args.experts, big_i, big_l, 8192, 1.0, 0.05)
    print(f"trace {args.gpus} x {args.experts} x {big_l} layers x {big_i} iterations: "
          f"{time.process_time() - t0:.1f}s CPU (load {os.getloadavg()[0]:.1f})")
    cl = load_cluster(args.gpus)
    target = args.target_layers * args.target_iterations
    now = {}
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
        now[pol] = _parse(line)
    if args.before:
        _compare_before(args.before, argv, now, args)


_LINE = re.compile(r"^(\S+)\s.*\| fit (-?[\d.]+) \+ (-?[\d.]+) ms x layers x iterations"
                   r"(?:.*measured ([\d.]+)s CPU)?")


def _parse(line):
    """(ms per layer-iteration of the fit, measured target seconds or None) of one result line."""
    m = _LINE.match(line)
    return float(m.group(3)), (float(m.group(4)) if m.group(4) else None)


def _compare_before(rev, argv, now, args):
    """Run this bench at ``rev`` (a temporary detached git worktree, its own process and trace) and
    print before / now per policy."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    rest = [a for i, a in enumerate(argv) if a != "--before" and (i == 0 or argv[i - 1] != "--before")
            and not a.startswith("--before=")]
    with tempfile.TemporaryDirectory(prefix="sim_speed_before_") as tmp:
        wt = os.path.join(tmp, "tree")
        subprocess.run(["git", "-C", repo, "worktree", "add", "--detach", "-q", wt, rev], check=True, timeout=300)
        try:
            env = dict(os.environ, PYTHONPATH=wt)
            print(f"--- the same bench at {rev} ---", flush=True)
            out = subprocess.run([sys.executable, os.path.join(wt, "bench", "sim_speed.py")] + rest, env=env,
                                 cwd=wt, capture_output=True, text=True, timeout=6 * 3600)
            print(out.stdout, end="", flush=True)
            if out.returncode:
                raise SystemExit(f"bench at {rev} failed:\n{out.stderr[-2000:]}")
        finally:
            subprocess.run(["git", "-C", repo, "worktree", "remove", "--force", wt], timeout=300)
    before = {}
    for line in out.stdout.splitlines():
        if _LINE.match(line):
            before[line.split()[0]] = _parse(line)
    tgt = f"{args.target_layers}x{args.target_iterations}"
    print("\n| policy | before: ms per layer-iteration | now | ratio |"
          + (f" before: {tgt} measured, s CPU | now | ratio |" if args.full else ""))
    print("|---|---|---|---|" + ("---|---|---|" if args.full else ""))
    for pol, (ms, full) in now.items():
        b = before.get(pol)
        row = f"| {pol} | " + (f"{b[0]:.1f} | {ms:.1f} | {b[0] / ms:.2f}x |" if b else f"- | {ms:.1f} | - |")
        if args.full:
            row += (f" {b[1]:.1f} | {full:.1f} | {b[1] / full:.2f}x |" if b and b[1] else f" - | {full:.1f} | - |")
        print(row, flush=True)


if __name__ == "__main__":
    main()
