#!/usr/bin/env python
"""What-if planner: one count matrix in, the Pro-Prophet plan and its modelled times out (one JSON).

    python tools/plan_placement.py --counts COUNTS.json --policy proprophet --alpha A --n N \
        --num-inputs I --input-bytes B --expert-bytes P --bandwidth BYTES_PER_S \
        --throughput INPUTS_PER_S [--overlap --t-fnec SECONDS --t-bnec SECONDS]

COUNTS.json: a list of rows (source rank) of per-expert counts; expert e is owned by rank e*D//E.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from megatron_moe.balance.cost_model import CostModel  # noqa: E402
from megatron_moe.balance.policies.base import Placement, balance_degree, loads  # noqa: E402
from megatron_moe.balance.policies.proprophet import search  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="plan_placement.py", description=__doc__.splitlines()[0])
    p.add_argument("--counts", required=True, help="JSON list of rows (source rank) of per-expert counts")
    p.add_argument("--policy", choices=["proprophet", "none"], default="proprophet")
    p.add_argument("--alpha", type=float, default=3.0)
    p.add_argument("--n", type=int, default=0)
    p.add_argument("--num-inputs", type=float, default=None, help="I (default: sum of the counts)")
    p.add_argument("--input-bytes", type=float, required=True)
    p.add_argument("--expert-bytes", type=float, required=True)
    p.add_argument("--bandwidth", type=float, required=True, help="bytes/s (A2A, Trans and Agg)")
    p.add_argument("--throughput", type=float, required=True, help="expert inputs/s per rank")
    p.add_argument("--overlap", action="store_true", help="Eq. 8 (scheduler-aware) instead of Eq. 6")
    p.add_argument("--t-fnec", type=float, default=0.0)
    p.add_argument("--t-bnec", type=float, default=0.0)
    return p.parse_args(argv)


def load_counts(path):
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise SystemExit(f"--counts {path}: {exc}")
    if not isinstance(data, list) or not data or not all(isinstance(r, list) for r in data):
        raise SystemExit(f"--counts {path}: expected a non-empty list of rows (one per source rank)")
    widths = {len(r) for r in data}
    if len(widths) != 1:
        raise SystemExit(f"--counts {path}: rows have different lengths {sorted(widths)}")
    C = np.asarray(data, dtype=np.float64)
    if (C < 0).any() or not np.isfinite(C).all():
        raise SystemExit(f"--counts {path}: counts must be finite and >= 0")
    D, E = C.shape
    if E % D:
        raise SystemExit(f"--counts {path}: {E} experts do not divide over {D} ranks")
    return C


def main(argv=None):
    a = parse_args(argv)
    C = load_counts(a.counts)
    D, E = C.shape
    if not 0 <= a.n < D:
        raise SystemExit(f"--n {a.n}: must be in [0, {D - 1}] for {D} ranks")
    try:
        cost = CostModel(input_bytes=a.input_bytes, expert_bytes=a.expert_bytes, throughput=a.throughput,
                         a2a_bandwidth=a.bandwidth, trans_bandwidth=a.bandwidth,
                         t_fnec=a.t_fnec, t_bnec=a.t_bnec)
    except ValueError as exc:
        raise SystemExit(str(exc))
    r = search(C, cost, a.alpha, a.n, a.num_inputs, a.overlap)
    plan = r.plan if a.policy == "proprophet" else []
    H, R = loads(C, Placement.from_plan(plan, E, D))
    time_s = r.time_s if a.policy == "proprophet" else r.noop_time_s
    out = {"plan": [[int(e), [int(x) for x in nb]] for e, nb in plan], "time_s": time_s,
           "noop_time_s": r.noop_time_s, "balance_before": r.balance_before, "balance_after": balance_degree(H),
           "speedup_modelled": r.noop_time_s / time_s if time_s > 0 else 1.0,
           "computed_inputs_before": r.H_before.tolist(), "computed_inputs_after": H.tolist(),
           "received_inputs_after": R.tolist(), "greedy_steps": [[int(e), list(map(int, nb))] for e, nb in r.steps],
           "step_times_s": r.step_times, "stop": r.stop, "equation": 8 if a.overlap else 6}
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
