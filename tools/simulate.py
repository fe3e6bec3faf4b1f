#!/usr/bin/env python
"""Replay routing traces through the balancing policies on a modelled cluster.

Examples::

    python tools/simulate.py --gpus 8 32 256 1024 --experts 64 --iterations 100
    python tools/simulate.py --trace-dir runs/trace --gpus 2 8 --profile balance_profile.json
    python tools/simulate.py --gpus 64 --topology topo.json --algorithms flat hierarchical pipe \
        --policies fastermoe flexmoe --plot-dir sim_plots --json out.json

Prints, per scale / all-to-all algorithm / policy, the mean per-iteration time broken down into
all-to-all, expert compute, Trans/Agg, planning, adjustment, exposed and hidden communication, and
the speedup over plain expert parallelism (policy ``none``) with the same algorithm.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


from megatron_moe.sim.alltoall import ALGORITHMS  # noqa: E402
from megatron_moe.sim.cluster import load_cluster  # noqa: E402
from megatron_moe.sim.report import format_table, plot_results  # noqa: E402
from megatron_moe.sim.runner import POLICIES, available_policies, compare  # noqa: E402
from megatron_moe.sim.traces import balanced_trace, load_trace_dir, synthetic_trace  # noqa: E402


def build_parser():
    p = argparse.ArgumentParser(prog="tools/simulate.py", description=__doc__.split("\n")[0])
    p.add_argument("--gpus", type=int, nargs="+", default=[8, 32, 256, 1024], help="cluster sizes")
    p.add_argument("--experts", type=int, default=64, help="experts per MoE layer (synthetic)")
    p.add_argument("--layers", type=int, default=2, help="MoE layers (synthetic)")
    p.add_argument("--iterations", type=int, default=100)
    p.add_argument("--inputs-per-rank", type=int, default=8192,
                   help="(token, expert) inputs per rank per layer (synthetic)")
    p.add_argument("--zipf", type=float, default=1.0, help="Zipf exponent of expert popularity")
    p.add_argument("--drift", type=float, default=0.05, help="log-normal random-walk sigma per iteration")
    p.add_argument("--balanced", action="store_true", help="uniform routing instead of Zipf")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--trace-dir", default=None,
                   help="recorded trace (written by training with --moe-routing-trace-dir)")
    p.add_argument("--topology", default=None, help="topology JSON (ranks_per_node, *_bandwidth_gbps, ...)")
    p.add_argument("--profile", default=None, help="balance calibration profile (--moe-balance-profile)")
    p.add_argument("--ranks-per-node", type=int, default=None)
    p.add_argument("--ep-size", type=int, default=None, help="EP group size (default min(gpus, experts))")
    p.add_argument("--policies", nargs="+", default=None,
                   help=f"policies to compare with 'none' (from {POLICIES}); default: all available")
    p.add_argument("--algorithms", nargs="+", default=["flat"], choices=ALGORITHMS)
    p.add_argument("--plan-time", default="0",
                   help="'measured' (wall time of the policy code) or fixed seconds per plan")
    p.add_argument("--flexmoe-threshold", type=float, default=1.15)
    p.add_argument("--flexmoe-slots", type=int, default=None, help="vExpert slots per rank")
    p.add_argument("--fastermoe-paper-literal", action="store_true")
    p.add_argument("--plot-dir", default=None, help="write PNG plots here")
    p.add_argument("--json", default=None, help="write the results as JSON here")
    return p


def main(argv=None):
    args = build_parser().parse_args(argv)
    pols = args.policies or [p for p in available_policies() if p != "none"]
    for pol in pols:
        if pol not in POLICIES:
            raise SystemExit(f"--policies: unknown policy {pol!r}; choose from {POLICIES}")
    plan_time = args.plan_time if args.plan_time == "measured" else float(args.plan_time)
    recorded = load_trace_dir(args.trace_dir, args.iterations) if args.trace_dir else None
    results = {}
    t_all = time.perf_counter()
    for gpus in args.gpus:
        t0 = time.perf_counter()
        if recorded is not None:
            trace = recorded
        elif args.balanced:
            trace = balanced_trace(gpus, args.experts, args.iterations, args.layers,
                                   args.inputs_per_rank - args.inputs_per_rank % args.experts)
        else:
            trace = synthetic_trace(gpus, args.experts, args.iterations, args.layers,
                                    args.inputs_per_rank, args.zipf, args.drift, seed=args.seed)
        cluster = load_cluster(gpus, args.topology, profile=args.profile,
                               ranks_per_node=args.ranks_per_node)
        pk = {"flexmoe": {"threshold": args.flexmoe_threshold, "slots_per_rank": args.flexmoe_slots},
              "fastermoe": {"paper_literal": args.fastermoe_paper_literal}}
        rows = compare(trace, cluster, pols, args.algorithms, policy_kwargs=pk, ep_size=args.ep_size,
                       plan_time=plan_time)
        for (a, p), r in rows.items():
            results[(gpus, a, p)] = r
        print(f"[{gpus} GPUs: simulated in {time.perf_counter() - t0:.1f}s]", file=sys.stderr)
    print(format_table(results))
    print(f"(total {time.perf_counter() - t_all:.1f}s)", file=sys.stderr)
    if args.plot_dir:
        for p in plot_results(results, args.plot_dir):
            print(f"wrote {p}", file=sys.stderr)
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{"gpus": k[0], "algorithm": k[1], "policy": k[2],
                        **{kk: (list(map(float, v)) if kk == "per_iter" else float(v)) for kk, v in r.items()}}
                       for k, r in results.items()], f, indent=1)
    return results


if __name__ == "__main__":
    main()
