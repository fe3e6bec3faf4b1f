#!/usr/bin/env python
"""Balancing policies: (a) real 2-rank training throughput, (b) the cluster simulator at scale.

(b) replays synthetic routing (Zipf popularity drifting by a random walk) and, if given, a recorded
trace (``--trace-dir``, written by training with ``--moe-routing-trace-dir``) through plain EP,
FasterMoE shadowing, FlexMoE vExperts and Pro-Prophet (with and without its scheduler) at 8, 32,
256 and 1024 GPUs, and prints each policy's speedup over plain EP measured in the same run next to
the papers' headline numbers.  The simulator's absolute times are modelled, not measured: compare
ratios, and calibrate with ``--profile`` (the balance calibration JSON) for a real machine.

(a) trains a small GPT-MoE (2 layers, hidden 128, 4 experts, top-2) on 2 gloo ranks with the balance
engineer's balanced MoE layer for every policy, skewed (frozen zero router: every input to rank 0's
experts) and learned routing, and prints tokens/s and the ratio to policy none from the same run.

    python bench/policies.py                       # (a) if available + (b) with defaults
    python bench/policies.py --gpus 8 32 --iterations 30 --trace-dir runs/trace
    python bench/policies.py --link-gbps 0.3 --skip-b   # (a) and (c) behind an emulated link

``--link-gbps G``: parts (a) and (c) run behind an emulated link of G GB/s per rank
(``--moe-ep-link-gbps``, comm/link.py), with Pro-Prophet's scheduler as a fifth policy
(``proprophet+overlap``): the calibrated bandwidths fold the link in (each b -> 1 / (1/b + 1/G)),
so the simulator of part (c) prices the link the training ran on, and its scheduler model is
checked against a run where communication can really hide.
"""

from __future__ import annotations

import argparse
import dataclasses
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

# "none" is plain dropless EP (FastMoE / megatron-core), "deepspeed" DeepSpeed-MoE's padded capacity;
# the papers' own testbeds and cells are bench/paper_tables.py, these are the placeholder cluster's
PAPERS = [
    ("flexmoe", "none", "FlexMoE vs plain dropless EP", "1.70x avg (max 2.10x) vs DeepSpeed-style EP, 32-64 A100, TTQ"),
    ("flexmoe", "fastermoe", "FlexMoE vs FasterMoE", "1.30x avg (max 1.45x)"),
    ("proprophet", "deepspeed", "Pro-Prophet vs DeepSpeed-MoE (padded)", "1.18-2.66x, 8-32 RTX 3090/2080Ti"),
    ("proprophet", "none", "Pro-Prophet vs plain dropless EP", "(Fig. 14 planner step: 1.26x k=1)"),
    ("proprophet", "fastermoe", "Pro-Prophet vs FasterMoE", "1.01-1.50x"),
    ("proprophet+overlap", "deepspeed", "Pro-Prophet (+scheduler) vs DeepSpeed-MoE", "1.18-2.66x"),
    ("fastermoe", "none", "FasterMoE shadowing vs FastMoE EP", "up to 1.95x (16 GPUs), 4.74x (64 GPUs)"),
]


POLICIES_A = ["none", "fastermoe", "flexmoe", "proprophet"]


def part_a(args, profile=None):
    print("== (a) real 2-rank training throughput per policy (gloo, CPU, the balanced MoE layer, skewed router)")
    try:
        from megatron_moe.balance.layer import ReplicaPlacement  # noqa: F401
        from megatron_moe.runtime.local_ranks import run_distributed
        from tests import _policy_bench
    except Exception as exc:   # the balance layer is the balance engineer's
        print(f"   not available: {exc}")
        return
    pols = POLICIES_A + (["proprophet+overlap"] if args.link_gbps else [])
    measured = {}
    for skew in (True, False):
        t0 = time.perf_counter()
        tdir = tempfile.mkdtemp(prefix=f"policies_trace_{'skew' if skew else 'learned'}_")
        out = run_distributed(_policy_bench.throughput_rank, 2, pols, iters=args.a_iters, warmup=2,
                              skew=skew, trace_dir=tdir, profile=profile, link_gbps=args.link_gbps,
                              timeout_s=args.a_timeout)[0]
        out["trace_dir"] = tdir
        measured[skew] = out
        base = out["none"]["tokens_per_s"]
        base_med = out["none"]["iter_s"]
        print(f"   routing {'skewed (all inputs to rank 0 experts)' if skew else 'learned (near uniform)'}"
              f" [{time.perf_counter() - t0:.0f}s]")
        for pol in pols:
            r = out[pol]
            print(f"     {pol:<18} {r['tokens_per_s']:9.0f} tokens/s  median iter {r['iter_s']*1e3:7.1f} ms  "
                  f"replicated/iter {r['replicated']:.1f}  vs none: {r['tokens_per_s'] / base:.2f}x (mean), "
                  f"{base_med / r['iter_s']:.2f}x (median)")
    print("   (the learned-routing block replicates nothing, so its spread around 1.00x is this shared "
          "CPU's timing noise; read the skewed ratios against it)")
    return measured


def calibrate(args, path):
    """Micro-benchmarks on the 2 gloo ranks -> a ``--moe-balance-profile`` JSON, so that the
    planners in part (a) and the simulator in part (c) price operations with the same constants.
    The expert throughput is the slope of the real MoE layer's forward+backward time over the
    inputs it computes (CostModel: backward = 2 x forward, so forward = 1/3 of it)."""
    from megatron_moe.balance.cost_model import save_profile
    from megatron_moe.runtime.local_ranks import run_distributed
    from tests import _policy_bench

    cal = run_distributed(_policy_bench.calibrate_rank, 2, timeout_s=args.a_timeout)
    fwd_bwd = max(c["fwd_bwd_s_per_input"] for c in cal)
    bw, lat = min(c["a2a_bw"] for c in cal), max(c["a2a_lat"] for c in cal)
    bcast = min(c["bcast_bw"] for c in cal)
    h, f = 128, 512
    # per-message latency folded into the bandwidth-by-size table the CostModel reads
    table = [[m, m / (m / bw + lat)] for m in (4096, 65536, 1 << 20)] + [[None, bw]]
    # a2a_latency: the per-peer round time the FlexMoE / FasterMoE / auto pricing adds to the
    # large-message rate (PlannerCost.a2a_lat_s); Eq. 1 reads the table above, which already holds it
    # the dense block's forward / backward (what Pro-Prophet's scheduler hides Trans / Agg under:
    # Eq. 8 and the Trans split read them), timed as tools/calibrate_balance.py does
    from tools.calibrate_balance import measure_compute

    nec = measure_compute(h, f, 4 * 128, 128)
    profile = {"a2a_bandwidth": table, "trans_bandwidth": bcast, "throughput": 3.0 / fwd_bwd,
               "input_bytes": h * 4, "expert_bytes": 2 * h * f * 4, "t_fnec": nec["t_fnec"],
               "t_bnec": nec["t_bnec"],
               "a2a_latency": lat,
               "meta": {"source": "bench/policies.py calibrate, 2 gloo ranks, 1 thread each",
                        "a2a_latency_s": lat}}
    if args.link_gbps:
        from tools.calibrate_balance import with_link

        profile = with_link(profile, args.link_gbps)
        print(f"== emulated link {args.link_gbps:g} GB/s per rank: folded into the calibrated bandwidths")
    save_profile(path, profile)
    print(f"== calibration (micro-benchmarks; written to {path}, used by (a) and (c)): MoE layer "
          f"fwd+bwd {fwd_bwd * 1e6:.2f} us/input, all-to-all {bw / 1e9:.2f} GB/s + {lat * 1e6:.0f} us/msg, "
          f"broadcast {bcast / 1e9:.2f} GB/s")
    return profile


def part_c(args, measured, profile_path, profile):
    """Predict the skewed 2-rank runs of part (a) with the simulator.

    Calibration never uses the predicted runs: the constants come from the micro-benchmarks
    (``calibrate``), and the non-MoE time per block is fitted on plain EP with LEARNED routing.
    The policies plan with the same profile in training and in the simulator, and planning time
    is charged as measured (``plan_time="measured"``)."""
    from megatron_moe.sim.cluster import load_cluster
    from megatron_moe.sim.runner import simulate

    print("== (c) simulator vs measured 2-rank CPU training, after calibration")
    lat = profile["meta"]["a2a_latency_s"]
    layers = 2

    def cluster(nec):
        cl = load_cluster(2, profile=profile_path, ranks_per_node=2, intra_lat=lat, inter_lat=lat)
        return dataclasses.replace(cl, t_fnec_s=nec / 3, t_bnec_s=2 * nec / 3)

    # replay the routing the plain-EP runs recorded (--moe-routing-trace-dir), warm-up excluded
    learned = load_trace_dir(measured[False]["trace_dir"])[2:]
    skewed = load_trace_dir(measured[True]["trace_dir"])[2:]
    print(f"   recorded routing, rank max/mean load per layer: learned "
          f"{_maxmean(learned):.2f}, skewed {_maxmean(skewed):.2f}")

    def median_iter(trace, cl, pol):     # part (a) reports median iterations: compare like with like
        return float(np.median(simulate(trace, cl, pol, plan_time="measured").values["iter_s"]))

    t0 = median_iter(learned, cluster(0.0), "none")
    nec = max(0.0, measured[False]["none"]["iter_s"] - t0) / layers    # fitted non-MoE time per block
    cl = cluster(nec)
    print(f"   fitted non-MoE time per block (FNEC+BNEC, incl. optimizer/grad sync share): {nec * 1e3:.1f} ms")
    errors = {}
    for pol in [p for p in measured[True] if p in available_policies()]:
        pred = median_iter(skewed, cl, pol)
        meas = measured[True][pol]["iter_s"]
        errors[pol] = (pred - meas) / meas
        print(f"     skewed {pol:<18} measured {meas * 1e3:7.1f} ms  simulated {pred * 1e3:7.1f} ms  "
              f"error {100 * errors[pol]:+5.1f}%")
    worst = max(abs(e) for e in errors.values())
    print(f"   worst |error| {100 * worst:.1f}% (stated tolerance {100 * args.sim_tolerance:.0f}%: "
          f"{'within' if worst <= args.sim_tolerance else 'OUTSIDE'})")
    return errors


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
    p.add_argument("--skip-b", action="store_true", help="skip the simulator-at-scale part")
    p.add_argument("--link-gbps", type=float, default=None,
                   help="parts (a) and (c) behind an emulated link of this bandwidth (GB/s) per rank")
    p.add_argument("--a-timeout", type=int, default=900)
    p.add_argument("--a-iters", type=int, default=6, help="timed iterations per policy in part (a)")
    p.add_argument("--sim-tolerance", type=float, default=0.25,
                   help="part (c): the simulator-vs-measured relative error we state and check")
    args = p.parse_args(argv)
    if args.link_gbps is not None and not args.link_gbps > 0:
        p.error(f"--link-gbps must be > 0 (got {args.link_gbps})")
    result = {}
    if not args.skip_a:
        path = os.path.join(tempfile.mkdtemp(prefix="policies_profile_"), "profile.json")
        profile = calibrate(args, path)
        measured = part_a(args, profile=path)
        result.update(profile=profile, measured=measured)
        if measured:
            result["errors"] = part_c(args, measured, path, profile)
    if not args.skip_b:
        part_b(args)
    return result


if __name__ == "__main__":
    main()
