"""Seeded simulator cells of ``--moe-balance-policy auto`` and what they decided, for
tests/test_auto_speed.py: auto's speed work must not change a decision.

``record(cell)`` runs one cell through ``simulate(..., "auto")`` and returns, per layer and
iteration, every EP group's choice and a digest of the placement it committed (replica sets and
vExpert counts: integers, exact on any numpy), auto's unscaled per-candidate prices, and the
simulator's per-iteration results. ``python -m tests._auto_speed_cases`` (re)writes the recorded
outputs in tests/data/auto_speed_reference.json from the code as it is."""

from __future__ import annotations

import hashlib
import json
import os
import sys

import numpy as np

PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "auto_speed_reference.json")

# (gpus, experts, zipf, drift, layers, iterations, auto kwargs): 1, 2 and 4 EP groups; FlexMoE all
# along, switched into, mixed per group; Eq. 8 pricing, a re-plan interval, no memory left
CELLS = [
    (32, 64, 1.6, 0.5, 2, 12, {}),
    (32, 64, 0.6, 0.0, 1, 12, {"eq8": True}),
    (32, 64, 1.0, 0.0, 1, 10, {"memory_left_bytes": 0}),
    (32, 32, 0.6, 0.5, 1, 12, {}),
    (64, 32, 1.0, 0.25, 2, 10, {}),
    (256, 64, 1.6, 0.0, 1, 10, {"interval": 2}),
    (256, 64, 1.0, 0.5, 1, 12, {}),
]


def _digest(p) -> str:
    h = hashlib.sha256(json.dumps([list(map(int, s)) for s in p.replica_sets]).encode())
    if p.vexperts is not None:
        h.update(np.asarray(p.vexperts, dtype=np.int64).tobytes())
    return h.hexdigest()[:16]


def record(cell, counter=None):
    """Run one cell; ``counter`` (a dict) gets the number of plan_groups calls and proposals, and
    of FlexMoE steps that started from the simulator's pricing of the running table (shared)."""
    from megatron_moe.balance.policies import auto as auto_mod
    from megatron_moe.balance.policies.flexmoe import FlexMoEPolicy
    from megatron_moe.sim.cluster import load_cluster
    from megatron_moe.sim.runner import simulate
    from megatron_moe.sim.traces import synthetic_trace

    gpus, experts, z, d, layers, iters, kw = cell
    trace = synthetic_trace(gpus, experts, iters, layers, zipf_s=z, drift_sigma=d, seed=0)
    steps = []
    orig, orig_layers = auto_mod.plan_groups, auto_mod.plan_layers

    def note(policies, out):
        steps.append({"choice": [pol.choice for pol in policies], "placement": [_digest(p) for p in out],
                      "price": [{c: pol.last_price.get(c) for c in sorted(pol.last_price)} for pol in policies]})
        if counter is not None:
            counter["plan_groups"] = counter.get("plan_groups", 0) + 1
            counter["groups"] = counter.get("groups", 0) + len(policies)

    def plan_groups(policies, counts, regime):
        out = orig(policies, counts, regime)
        note(policies, out)
        return out

    def plan_layers(layers, counts, regime):     # several layers and EP groups: one step per layer, in order
        out = orig_layers(layers, counts, regime)
        for policies, o in zip(layers, out):
            note(policies, o)
        return out

    step = FlexMoEPolicy.step

    def counted_step(self, origin, priced=None):     # FlexMoE steps from the simulator's pricing
        if counter is not None and priced is not None:
            counter["shared"] = counter.get("shared", 0) + 1
        return step(self, origin, priced)

    auto_mod.plan_groups, auto_mod.plan_layers, FlexMoEPolicy.step = plan_groups, plan_layers, counted_step
    try:
        res = simulate(trace, load_cluster(gpus), "auto", policy_kwargs=dict(kw))
    finally:
        auto_mod.plan_groups, auto_mod.plan_layers, FlexMoEPolicy.step = orig, orig_layers, step
    values = {k: np.asarray(v, dtype=np.float64).ravel().tolist() for k, v in sorted(res.values.items())}
    return {"cell": [gpus, experts, z, d, layers, iters, kw], "steps": steps, "values": values}


def main():
    out = [record(c) for c in CELLS]
    os.makedirs(os.path.dirname(PATH), exist_ok=True)
    with open(PATH, "w") as f:
        json.dump(out, f, indent=0, sort_keys=True)
    print(f"wrote {PATH}: {len(out)} cells, {sum(len(r['steps']) for r in out)} layer re-plans", file=sys.stderr)


if __name__ == "__main__":
    main()
