#!/usr/bin/env python
"""Balancing policies: (a) real 2-rank training throughput, (b) the cluster simulator at scale.

(b) replays synthetic routing (Zipf popularity drifting by a random walk) and, if given, a recorded
trace (``--trace-dir``, written by training with ``--moe-routing-trace-dir``) through plain EP,
FasterMoE shadowing, FlexMoE vExperts and Pro-Prophet (with and without its scheduler) at 8, 32,
256 and 1024 GPUs, and prints each policy's speedup over plain EP measured in the same run next to
the papers' headline numbers.  The simulator's absolute times are modelled, not measured: compare
ratios, and calibrate with ``--profile`` (the balance calibration JSON) for a real machine.

(a) trains a small GPT-MoE (2 layers, hidden 128, 4 experts, top-2) on 2 gloo ranks with the balance
engineer's BalancedMoELayer for every policy, skewed (frozen zero router: every input to rank 0's
experts) and learned routing, and prints tokens/s and the ratio to policy none from the same run.

    python bench/policies.py                       # (a) if available + (b) with defaults
    python bench/policies.py --gpus 8 32 --iterations 30 --trace-dir runs/trace
"""

from __future__ import annotations

import argparse
import os
import tempfile
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402

from megatron_moe.sim.cluster import load_cluster  # noqa: E402
from megatron_moe.sim.report import format_table  # noqa: E402
from megatron_moe.sim.runner import available_policies, compare  # noqa: E402
from megatron_moe.sim.traces import load_trace_dir, synthetic_trace  # noqa: E402

PAPERS = [
    ("flexmoe", "none", "FlexMoE vs DeepSpeed-style EP", "1.70x avg (max 2.10x), 32-64 A100, time to quality"),
    ("flexmoe", "fastermoe", "FlexMoE vs FasterMoE", "1.30x avg (max 1.45x)"),
    ("proprophet", "none", "Pro-Prophet vs DeepSpeed-MoE", "1.18-2.66x, 8-32 RTX 3090/2080Ti"),
    ("proprophet", "fastermoe", "Pro-Prophet vs FasterMoE", "1.01-1.50x"),
    ("proprophet+overlap", "none", "Pro-Prophet (+scheduler) vs DeepSpeed-MoE", "1.18-2.66x"),
    ("fastermoe", "none", "FasterMoE shadowing vs FastMoE EP", "up to 1.95x (16 GPUs), 4.74x (64 GPUs)"),
]


def part_a(args):
    print("== (a) real 2-rank training throughput per policy (gloo, CPU, BalancedMoELayer, skewed router)")
    try:
        from megatron_moe.balance.layer import BalancedMoELayer  # noqa: F401
        from megatron_moe.testing import run_distributed
        from tests import _policy_bench
    except Exception as exc:   # the balance layer is the balance engineer's
        print(f"   not available: {exc}")
        return
    pols = ["none", "fastermoe", "flexmoe", "proprophet"]
    measured = {}
    for skew in (True, False):
        t0 = time.perf_counter()
        tdir = tempfile.mkdtemp(prefix=f"policies_trace_{'skew' if skew else 'learned'}_")
        out = run_distributed(_policy_bench.throughput_rank, 2, pols, iters=args.a_iters, warmup=2,
                              skew=skew, trace_dir=tdir, timeout_s=args.a_timeout)[0]
        out["trace_dir"] = tdir
        measured[skew] = out
        base = out["none"]["tokens_per_s"]
        base_med = out["none"]["iter_s"]
        print(f"   routing {'skewed (all inputs to rank 0 experts)' if skew else 'learned (near uniform)'}"
              f" [{time.perf_counter() - t0:.0f}s]")
        for pol in pols:
            r = out[pol]
            print(f"     {pol:<11} {r['tokens_per_s']:9.0f} tokens/s  median iter {r['iter_s']*1e3:7.1f} ms  "
                  f"replicated/iter {r['replicated']:.1f}  vs none: {r['tokens_per_s'] / base:.2f}x (mean), "
                  f"{base_med / r['iter_s']:.2f}x (median)")
    print("   (the learned-routing block replicates nothing, so its spread around 1.00x is this shared "
          "CPU's timing noise; read the skewed ratios against it)")
    print("   (FlexMoE runs its slot table with locality-only routing here: the balance layer has no "
          "overflow split across replicas; see docs/sim.md)")
    return measured


def part_c(args, measured):
    """Calibrate the simulator on this machine (micro-benchmarks + the non-MoE time fitted on plain EP
    with learned routing) and predict the skewed 2-rank runs of part (a)."""
    from megatron_moe.sim.cluster import Cluster
    from megatron_moe.sim.runner import simulate
    from megatron_moe.testing import run_distributed
    from tests import _policy_bench

    print("== (c) simulator vs measured 2-rank CPU training, after calibration")
    cal = run_distributed(_policy_bench.calibrate_rank, 2, timeout_s=args.a_timeout)
    fwd = max(c["fwd_s_per_input"] for c in cal)
    bw = min(c["a2a_bw"] for c in cal)
    bbw = min(c["bcast_bw"] for c in cal)
    h, f, layers = 128, 512, 2
    base = dict(num_gpus=2, ranks_per_node=2, intra_bw=bw, inter_bw=bw, intra_lat=0.0, inter_lat=0.0,
                expert_tokens_per_s=1.0 / fwd, bytes_per_input=h * 4, expert_param_bytes=2 * h * f * 4,
                t_fnec_s=0.0, t_bnec_s=0.0)
    print(f"   calibrated: expert fwd {fwd * 1e6:.2f} us/input, all-to-all {bw / 1e9:.2f} GB/s, "
          f"broadcast {bbw / 1e9:.2f} GB/s")
    # replay the routing the plain-EP runs recorded (--moe-routing-trace-dir), warm-up excluded
    learned = load_trace_dir(measured[False]["trace_dir"])[2:]
    skewed = load_trace_dir(measured[True]["trace_dir"])[2:]
    print(f"   recorded routing, rank max/mean load per layer: learned "
          f"{_maxmean(learned):.2f}, skewed {_maxmean(skewed):.2f}")
    t0 = simulate(learned, Cluster(**base), "none").mean()["iter_s"]
    nec = max(0.0, measured[False]["none"]["iter_s"] - t0) / layers    # fitted non-MoE time per block
    cl = Cluster(**dict(base, t_fnec_s=nec / 3, t_bnec_s=2 * nec / 3))
    print(f"   fitted non-MoE time per block (FNEC+BNEC, incl. optimizer/grad sync share): {nec * 1e3:.1f} ms")
    for pol in ("none", "fastermoe"):
        pred = simulate(skewed, cl, pol).mean()["iter_s"]
        meas = measured[True][pol]["iter_s"]
        print(f"     skewed {pol:<10} measured {meas * 1e3:7.1f} ms  simulated {pred * 1e3:7.1f} ms  "
              f"error {100 * (pred - meas) / meas:+5.1f}%")
    print("   (FlexMoE and Pro-Prophet are left out: the layer runs FlexMoE locality-only and Pro-Prophet "
          "plans from the previous iteration, so the simulator's runs are not the same computation)")


def _maxmean(trace):
    from megatron_moe.balance.policies.fastermoe import default_owner, loads
    owner = default_owner(trace.shape[3], trace.shape[2])
    r = [loads(c, owner) for c in trace.reshape(-1, trace.shape[2], trace.shape[3])]
    return float(np.mean([x.max() / x.mean() for x in r]))


def _speedups(rows, algo):
    return {p: r["iter_s"] for (a, p), r in rows.items() if a == algo}


def part_b(args):
    print("== (b) simulator: speedup over plain EP per policy and scale (same run, same trace)")
    pols = [p for p in available_policies() if p != "none"]
    if "proprophet" not in pols:
        print("   (Pro-Prophet planner not importable: its rows are missing)")
    traces = [("synthetic", None)]
    if args.trace_dir:
        traces.append(("recorded", load_trace_dir(args.trace_dir, args.iterations)))
    pk = {"flexmoe": {"threshold": args.flexmoe_threshold}}
    all_rows = {}
    for tname, recorded in traces:
        for gpus in args.gpus:
            t0 = time.perf_counter()
            if recorded is None:
                trace = synthetic_trace(gpus, args.experts, args.iterations, args.layers, args.inputs_per_rank,
                                        args.zipf, args.drift, seed=args.seed)
            else:
                trace = recorded
                if trace.shape[3] > gpus * 64:
                    continue
            cluster = load_cluster(gpus, args.topology, profile=args.profile)
            rows = compare(trace, cluster, pols, args.algorithms, policy_kwargs=pk)
            dt = time.perf_counter() - t0
            for (a, p), r in rows.items():
                all_rows[(f"{gpus}", a, p if tname == "synthetic" else f"{p}[rec]")] = r
            print(f"   [{tname}, {gpus} GPUs, {trace.shape[3]} experts, {trace.shape[0]} iterations x "
                  f"{trace.shape[1]} layers: {dt:.1f}s wall]", flush=True)
    print(format_table(all_rows))
    print()
    print("   vs the papers' headline numbers (papers: wall-clock on real GPUs; here: modelled iteration time):")
    algo = args.algorithms[0]
    for num, den, what, paper in PAPERS:
        vals = []
        for gpus in args.gpus:
            a = all_rows.get((f"{gpus}", algo, num)); b = all_rows.get((f"{gpus}", algo, den))
            if a and b:
                vals.append(f"{gpus}:{b['iter_s'] / a['iter_s']:.2f}x")
        if vals:
            print(f"   {what:<44} sim[{algo}] {' '.join(vals):<44} paper {paper}")


def main(argv=None):
    p = argparse.ArgumentParser(prog="bench/policies.py", description=__doc__.split("\n")[0])
    p.add_argument("--gpus", type=int, nargs="+", default=[8, 32, 256, 1024])
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--iterations", type=int, default=50)
    p.add_argument("--inputs-per-rank", type=int, default=8192)
    p.add_argument("--zipf", type=float, default=1.0)
    p.add_argument("--drift", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--algorithms", nargs="+", default=["flat", "pipe"])
    p.add_argument("--flexmoe-threshold", type=float, default=1.15)
    p.add_argument("--trace-dir", default=None)
    p.add_argument("--topology", default=None)
    p.add_argument("--profile", default=None)
    p.add_argument("--skip-a", action="store_true", help="skip the real 2-rank training part")
    p.add_argument("--a-timeout", type=int, default=900)
    p.add_argument("--a-iters", type=int, default=6, help="timed iterations per policy in part (a)")
    args = p.parse_args(argv)
    if not args.skip_a:
        measured = part_a(args)
        if measured:
            part_c(args, measured)
    part_b(args)


if __name__ == "__main__":
    main()
