#!/usr/bin/env python
"""``--moe-balance-policy auto`` against the best single policy, over a grid in the simulator.

For every (GPUs, Zipf s, drift sigma) cell: one synthetic trace (``sim.traces.synthetic_trace``),
simulated mean iteration time of ``none``, ``proprophet`` (transient replicas), ``flexmoe``
(persistent replicas) and ``auto`` (the cost model picks one of the three per EP group, layer and
re-plan) on the same trace and cluster; prints auto / best single policy per cell, the choices auto
made, and the worst ratio. ``--bound`` (default 1.03: auto should cost at most 3% over the best single
policy it chooses among) makes the exit status 1 if a cell exceeds it.

Every cell runs ``--layers`` x ``--iterations`` (2 x 30); the 8192-GPU row costs 17-56 s CPU per
cell (all four policies). For less CPU, cells with more than ``--big-gpus`` GPUs can run
``--big-layers`` x ``--big-iterations`` (e.g. ``--big-gpus 1024`` runs 8192 at 1 x 12); the printed
table says which size each cell ran.

    python bench/auto_policy.py                                   # 32..8192 GPUs, s 0.6..1.6, drift 0..0.5
    python bench/auto_policy.py --gpus 32 256 --zipf 1.0 --drift 0.1
    python bench/auto_policy.py --gpus 32 256 1024 --seed 0 1 2                # three traces
    python bench/auto_policy.py --auto-kwargs '{"factor_on_base": false}'   # a rule switched off (an ablation)

``--auto-kwargs`` takes AutoRules fields (the rules auto follows, each of which can be switched off)
and AutoPolicy's own arguments.
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

SINGLE = ("none", "proprophet", "flexmoe")


def auto_arguments(spec: dict) -> dict:
    """``--auto-kwargs``' object as AutoPolicy's keyword arguments: AutoRules fields go into its
    ``rules`` (the production rules with those fields replaced), the rest are passed as given."""
    import dataclasses

    from megatron_moe.balance.policies.auto import DEFAULT_RULES

    fields = {f.name for f in dataclasses.fields(DEFAULT_RULES)}
    out = {k: v for k, v in spec.items() if k not in fields}
    rules = {k: v for k, v in spec.items() if k in fields}
    if rules:
        out["rules"] = dataclasses.replace(DEFAULT_RULES, **rules)
    return out


def run_cell(gpus: int, experts: int, zipf: float, drift: float, layers: int, iterations: int,
             seed: int = 0, auto_kwargs=None):
    """Mean iteration seconds of every single policy and of auto on one trace; auto's choices."""
    from megatron_moe.balance.policies import auto as auto_mod

    cl = load_cluster(gpus)
    trace = synthetic_trace(gpus, experts, iterations, layers, zipf_s=zipf, drift_sigma=drift, seed=seed)
    times = {p: simulate(trace, cl, p).mean()["iter_s"] for p in SINGLE}
    made = []
    orig = auto_mod.AutoPolicy.__init__

    def init(self, *a, **kw):     # collect the instances the runner builds, to count their choices
        orig(self, *a, **kw)
        made.append(self)
    auto_mod.AutoPolicy.__init__ = init
    try:
        times["auto"] = simulate(trace, cl, "auto", policy_kwargs=auto_kwargs).mean()["iter_s"]
    finally:
        auto_mod.AutoPolicy.__init__ = orig
    choices = {c: sum(m.state.choices[c] for m in made) for c in SINGLE}
    return times, choices


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpus", type=int, nargs="+", default=[32, 256, 1024, 8192])
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--zipf", type=float, nargs="+", default=[0.6, 1.0, 1.6])
    ap.add_argument("--drift", type=float, nargs="+", default=[0.0, 0.25, 0.5])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--iterations", type=int, default=30)
    ap.add_argument("--big-gpus", type=int, default=8192, help="cells above this many GPUs use --big-*")
    ap.add_argument("--big-layers", type=int, default=1)
    ap.add_argument("--big-iterations", type=int, default=12)
    ap.add_argument("--seed", type=int, nargs="+", default=[0],
                    help="trace seeds (several: every cell on each trace, worst over all)")
    ap.add_argument("--bound", type=float, default=1.03)
    ap.add_argument("--auto-kwargs", default=None, metavar="JSON",
                    help="AutoRules fields and AutoPolicy arguments, e.g. '{\"factor_on_base\": false}'")
    args = ap.parse_args(argv)
    auto_kwargs = None
    if args.auto_kwargs:
        import dataclasses
        import inspect
        import json

        from megatron_moe.balance.policies.auto import DEFAULT_RULES, AutoPolicy
        try:
            spec = json.loads(args.auto_kwargs)
        except json.JSONDecodeError as e:
            ap.error(f"--auto-kwargs: not JSON ({e})")
        known = (set(inspect.signature(AutoPolicy.__init__).parameters) - {"self", "num_experts", "num_ranks", "rules"}
                 | {f.name for f in dataclasses.fields(DEFAULT_RULES)})
        if not isinstance(spec, dict) or set(spec) - known:
            ap.error(f"--auto-kwargs: a JSON object of AutoPolicy's arguments or AutoRules fields "
                     f"({', '.join(sorted(known))})")
        auto_kwargs = auto_arguments(spec)
    print(f"{'seed':>4} {'GPUs':>5} {'zipf':>4} {'drift':>5} {'LxI':>6} | "
          + " ".join(f"{p:>10}" for p in SINGLE + ("auto",)) + " | auto/best | choices none/pp/flex | cpu s", flush=True)
    worst, worst_cell, over = 0.0, None, 0
    for seed, gpus in ((s, g) for s in args.seed for g in args.gpus):
        big = gpus > args.big_gpus
        layers, iters = (args.big_layers, args.big_iterations) if big else (args.layers, args.iterations)
        for z in args.zipf:
            for d in args.drift:
                t0 = time.process_time()
                times, ch = run_cell(gpus, args.experts, z, d, layers, iters, seed, auto_kwargs)
                best = min(times[p] for p in SINGLE)
                ratio = times["auto"] / best
                over += ratio > args.bound
                if ratio > worst:
                    worst, worst_cell = ratio, (seed, gpus, z, d)
                print(f"{seed:>4} {gpus:>5} {z:>4.1f} {d:>5.2f} {layers}x{iters:<4} | "
                      + " ".join(f"{times[p] * 1e3:>8.2f}ms" for p in SINGLE + ("auto",))
                      + f" | {ratio:>9.3f} | {ch['none']}/{ch['proprophet']}/{ch['flexmoe']}"
                      + f" | {time.process_time() - t0:.0f}", flush=True)
    print(f"worst auto / best single policy: {worst:.3f} at seed={worst_cell[0]} GPUs={worst_cell[1]} "
          f"zipf={worst_cell[2]} drift={worst_cell[3]} (bound {args.bound}); cells above it: {over}; "
          f"load average {os.getloadavg()[0]:.1f}")
    return 0 if worst <= args.bound else 1


if __name__ == "__main__":
    sys.exit(main())
