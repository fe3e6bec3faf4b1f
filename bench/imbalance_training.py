#!/usr/bin/env python
"""Throughput under skewed routing, 2 ranks (EP=2, gloo), all configurations measured in one run,
round-robin per iteration: the stock megatron-core MoE layer, ours with policy none, ours with
Pro-Prophet, ours with Pro-Prophet + overlap (scheduler + Eq. 8), FlexMoE (transient replicas: this
loop steps torch Adam), auto, and megatron-core with forced load balancing (the upper bound).
Repeated with balanced routing (skew 0). ``--repeats 3`` gives the median of 3 whole runs.

    python bench/imbalance_training.py [--skew 3] [--iters 6] [--profile profile.json]

Skew option: router logits += -skew * expert_id, so expert 0 (and the rank owning it) is hot; the model
trains without an auxiliary loss. Without --profile the cost-model constants are calibrated first
(tools/calibrate_balance.py).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from megatron_moe.testing import run_distributed  # noqa: E402
from tests import _balance_bench  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(prog="imbalance_training.py", description=__doc__.splitlines()[0])
    p.add_argument("--skew", type=float, default=3.0)
    p.add_argument("--iters", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--ffn", type=int, default=1024)
    p.add_argument("--experts", type=int, default=4)
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--mbs", type=int, default=4)
    p.add_argument("--alpha", type=float, default=1.0)
    p.add_argument("--profile", default=None)
    p.add_argument("--configs", default=",".join(_balance_bench.CONFIGS),
                   help="comma-separated subset of " + ",".join(_balance_bench.CONFIGS))
    p.add_argument("--skews", default=None, help="comma-separated skews (default: --skew and 0)")
    p.add_argument("--json", default=None, help="also write the results here")
    p.add_argument("--repeats", type=int, default=1,
                   help="whole runs per skew; tokens/s is the median over them (issue 21: auto vs the "
                        "best single policy, median of 3)")
    a = p.parse_args(argv)
    profile = a.profile
    if profile is None:
        from tools.calibrate_balance import calibrate

        prof = calibrate(a.hidden, a.ffn, a.mbs * a.seq * a.topk // a.experts * 2, a.seq, reps=2)
        fd, profile = tempfile.mkstemp(suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump(prof, f)
        print("calibrated profile:", json.dumps({k: v for k, v in prof.items() if k != "meta"}))
    configs = [c for c in a.configs.split(",") if c]
    bad = sorted(set(configs) - set(_balance_bench.CONFIGS))
    if bad or "stock" not in configs:
        raise SystemExit(f"--configs: unknown {bad} (and 'stock' is required as the reference)")
    opts = dict(vars(a), profile=profile, configs=configs)
    results = {}
    skews = [float(x) for x in a.skews.split(",")] if a.skews else [a.skew, 0.0]
    for skew in skews:
        o = dict(opts, skew=skew)
        tokens = 2 * a.mbs * a.seq
        reps_tps, reps_crit = [], []
        for _ in range(a.repeats):
            out = run_distributed(_balance_bench.bench_rank, 2, o, timeout_s=1200, collective_timeout_s=600)
            reps_tps.append({n: tokens / statistics.median(t) for n, t in out[0]["times"].items()})
            # proxy for dedicated cores: per iteration, the busiest rank's CPU seconds (the critical
            # path when every rank owns a core); the wall clock on an oversubscribed host measures
            # total work
            reps_crit.append({n: tokens / statistics.median(max(c) for c in zip(*(r["cpu"][n] for r in out)))
                              for n in out[0]["cpu"]})
        tps = {n: statistics.median(r[n] for r in reps_tps) for n in reps_tps[0]}
        crit = {n: statistics.median(r[n] for r in reps_crit) for n in reps_crit[0]}
        results[skew] = {"tokens_per_s": tps, "tokens_per_critical_cpu_s": crit, "metrics": out[0]["metrics"]}
        print(f"\n== skew {skew:g} (router logits -= {skew:g} * expert id); host load average "
              f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs ==")
        for n in configs:
            print(f"{n:>20s}: {tps[n]:9.1f} tokens/s   x{tps[n] / tps['stock']:.3f} vs stock   | "
                  f"{crit[n]:9.1f} tokens/critical-CPU-s  x{crit[n] / crit['stock']:.3f}")
        m = out[0]["metrics"].get("proprophet", {})
        if m:
            print("   proprophet placement: rank max/mean %.3f -> %.3f, replicated experts %.0f" % (
                m["balance/rank_max_over_mean_before"], m["balance/rank_max_over_mean_after"],
                m["balance/replicated_experts"]))
        for label, v in (("wall", tps), ("critical-CPU", crit)):
            gap = v.get("forced", float("nan")) - v["stock"]
            for n in [c for c in ("proprophet", "proprophet+overlap") if c in v]:
                share = (v[n] - v["stock"]) / gap if abs(gap) > 1e-9 else float("nan")
                print(f"   [{label}] share of the gap to forced balance recovered by {n}: {share * 100:.1f}%")
        singles = [c for c in ("none", "proprophet", "flexmoe") if c in tps]
        if "auto" in tps and singles:
            for label, v in (("wall", tps), ("critical-CPU", crit)):
                best = max(singles, key=lambda c: v[c])
                print(f"   [{label}] auto / best single policy ({best}): x{v['auto'] / v[best]:.3f} "
                      f"(median of {a.repeats} runs); auto's choice: {out[0]['metrics']['auto'].get('balance/auto')}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({str(k): v for k, v in results.items()}, f, indent=1)
    return results


if __name__ == "__main__":
    main()
