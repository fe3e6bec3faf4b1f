"""FlexMoE's faster planner (issue 21 item 7) decides exactly as before.

The reference is tests/_flexmoe_reference.py, a frozen copy of the scheduler, policy maker, Migrate
and pricing before the speed-up.  On seeded inputs (clusters with one and two link rates and with
NVLink pairs, integer and fractional counts, tables with FREE slots, several thresholds) the live
policy must give the same ops and slot tables at every step and the same priced arrays bit for bit;
the simulator's replay must give the same tables and the same iteration times up to rounding (only
its traffic matrix is summed in another order).  A planted bug (Migrate's sync left stale) must be
caught by the same comparison."""

import numpy as np
import pytest

from megatron_moe.balance.cost_model import PlannerCost, sync_s_vec
from megatron_moe.balance.policies import flexmoe
from megatron_moe.balance.policies.flexmoe import FREE, FlexMoEPolicy, SlotTable, Priced, route_real
from megatron_moe.sim.cluster import Cluster, load_cluster
from megatron_moe.sim.runner import simulate
from megatron_moe.sim.traces import synthetic_trace
from tests import _flexmoe_reference as ref


def _costs(g):
    """Planner costs of one g-rank group: two link rates (the per-node path), NVLink pairs (the
    matmul path), compute only (no pair term), and no gradient bytes (no sync term)."""
    two = load_cluster(g, ranks_per_node=8).planner_cost(np.arange(g))
    nvl = Cluster(num_gpus=g, ranks_per_node=4, intra_bw=20e9, inter_bw=5e9,
                  intra_pair_bw=80e9).planner_cost(np.arange(g))
    return {"two-rate": two, "nvlink": nvl,
            "compute": PlannerCost(fwd_s_per_input=1e-6, a2a_s_per_input=0.0, param_collective_s=0.0),
            "no-grad": PlannerCost(fwd_s_per_input=two.fwd_s_per_input, a2a_s_per_input=two.a2a_s_per_input,
                                   param_collective_s=0.0, pair_s_per_input=two.pair_s_per_input,
                                   node=two.node, grad_bytes=0.0)}


def _table(rng, e, g, s, free):
    """A random slot table: every expert at least once, ``free`` FREE slots."""
    slots = rng.integers(0, e, size=g * s)
    slots[:e] = np.arange(e)
    slots[e:e + free] = FREE
    rng.shuffle(slots)
    return SlotTable(slots.reshape(g, s), e)


def _origin(rng, g, e, frac):
    p = 1.0 / np.arange(1, e + 1) ** 1.2
    o = rng.poisson(4096 * (p[rng.permutation(e)] / p.sum())[None, :] * rng.lognormal(0, .3, (g, e)))
    return o + rng.random((g, e)) if frac else o


@pytest.mark.parametrize("name", ["two-rate", "nvlink", "compute", "no-grad"])
def test_priced_arrays_equal_the_dense_pricing(name):
    g, e = 32, 24
    cost = _costs(g)[name]
    rng = np.random.default_rng(7)
    checked = 0
    for case in range(12):
        n = _table(rng, e, g, 3, free=3 * (case % 3)).counts()
        origin = _origin(rng, g, e, frac=case % 2)
        new, old = Priced(origin, n, cost), ref.RefPriced(origin, n, cost)
        n0 = n.copy()
        assert new.route is not None                           # the host-only path ran
        for k in ("proc", "terms", "base"):
            np.testing.assert_array_equal(getattr(new, k), getattr(old, k), err_msg=k)
        np.testing.assert_array_equal(new.sync_e, sync_s_vec(cost, n > 0))
        np.testing.assert_array_equal(new.tot, np.asarray(origin, dtype=np.float64).sum(axis=0))
        # one accepted pair, then the next candidate: the same rows, sums and trial price
        e1 = int(np.flatnonzero(n.sum(axis=1) >= 2)[case % 3])
        g1 = int(np.flatnonzero(n[e1])[0])
        plan = [("shrink", e1, g1, 0), ("expand", (e1 + 1) % e, g1, g1, 0)]
        new.apply(plan), old.apply(plan)
        n1 = new.n[[e1, 0]].copy()
        n1[0, g1] += 1
        assert new.trial([e1, 0], n1) == old.trial([e1, 0], n1)
        for k in ("proc", "terms", "base"):
            np.testing.assert_array_equal(getattr(new, k), getattr(old, k), err_msg=k)
        np.testing.assert_array_equal(new.loads(), old.loads())
        # what the simulator runs: the router's keep and spill.T @ frac, the replica sync per rank
        n = n0
        keep, spill, frac = route_real(origin, n)
        local, traffic, agg = new.dispatch()
        np.testing.assert_array_equal(local, keep.T)
        np.testing.assert_allclose(traffic, spill.T @ frac, rtol=1e-12, atol=1e-9)
        np.testing.assert_array_equal(agg, (sync_s_vec(cost, n > 0)[:, None] * (n > 0)).sum(axis=0))
        checked += 1
    assert checked == 12
    # negative counts are priced densely (the host-only shortcut assumes origin >= 0)
    bad = _origin(rng, g, e, frac=0).astype(np.float64)
    bad[3, 5] = -2.0
    assert Priced(bad, n, cost).route is None
    np.testing.assert_array_equal(Priced(bad, n, cost).terms, ref.RefPriced(bad, n, cost).terms)


def _compare(live_cls, cost, e, g, s, steps, threshold, seed, free=0):
    """Step the live and the reference policy on the same drifting counts; returns (mismatches,
    ops the reference produced)."""
    rng = np.random.default_rng(seed)
    table = _table(rng, e, g, s, free) if free else None
    live = live_cls(cost, e, g, s, threshold=threshold,
                    table=None if table is None else SlotTable(table.slots.copy(), e))
    old = ref.ReferenceFlexMoE(cost, e, g, s, threshold=threshold,
                               table=None if table is None else SlotTable(table.slots.copy(), e))
    trace = synthetic_trace(g, e, steps, 1, 4096, 1.2, 0.3, seed=seed)[:, 0]
    bad, ops_seen = [], []
    for i, origin in enumerate(trace):
        origin = origin + (rng.random(origin.shape) if i % 3 == 2 else 0)     # fractional counts too
        a, b = live.step(origin), old.step(origin)
        ops_seen += b
        if a != b or not np.array_equal(live.table.slots, old.table.slots):
            bad.append(i)
    return bad, ops_seen


@pytest.mark.parametrize("name,threshold,free", [("two-rate", 1.05, 0), ("two-rate", 1.15, 6),
                                                 ("nvlink", 1.1, 0), ("no-grad", 1.05, 4)])
def test_planner_decisions_equal_the_reference(name, threshold, free):
    g, e = 32, 32
    before = ref.CALLS["step"]
    bad, ops = _compare(FlexMoEPolicy, _costs(g)[name], e, g, 2, 12, threshold, seed=3, free=free)
    assert bad == [], f"steps {bad} differ from the reference"
    assert ref.CALLS["step"] - before == 12                        # the reference really ran
    kinds = {op[0] for op in ops}
    assert "expand" in kinds and len(ops) > 20, kinds              # the planner had work to do
    if name != "no-grad":
        assert "migrate" in kinds


def test_comparison_catches_a_stale_sync(monkeypatch):
    """Mutation: Migrate's per-expert sync not refreshed after a swap (a plausible bug of the
    incremental bookkeeping) changes the decisions, and the comparison says so."""
    orig = Priced._reprice

    def stale(self, rows):
        keep = self.sync_e.copy()
        orig(self, rows)
        self.sync_e[:] = keep

    monkeypatch.setattr(Priced, "_reprice", stale)
    bad, _ = _compare(FlexMoEPolicy, _costs(32)["two-rate"], 32, 32, 2, 12, 1.05, seed=3)
    assert bad, "the planted bug went unnoticed"


def test_simulator_replay_equals_the_reference(monkeypatch):
    """simulate(..., "flexmoe") with the live planner and with the reference: same slot tables in
    every group and layer, same iteration breakdown up to rounding."""
    made = {"live": [], "ref": []}

    class Live(FlexMoEPolicy):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            made["live"].append(self)

    class Old(ref.ReferenceFlexMoE):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            made["ref"].append(self)

        def step(self, origin, priced=None):          # the reference prices from scratch
            return super().step(origin)

    trace = synthetic_trace(64, 32, 6, 2, 4096, 1.2, 0.2, seed=1)
    cl = load_cluster(64)
    res = {}
    for key, cls in (("live", Live), ("ref", Old)):
        monkeypatch.setattr(flexmoe, "FlexMoEPolicy", cls)
        res[key] = simulate(trace, cl, "flexmoe").values
    assert len(made["live"]) == len(made["ref"]) == 2 * 2              # 2 EP groups x 2 layers
    for a, b in zip(made["live"], made["ref"]):
        assert a.table.version == b.table.version > 0
        np.testing.assert_array_equal(a.table.slots, b.table.slots)
    for k in res["ref"]:
        np.testing.assert_allclose(res["live"][k], res["ref"][k], rtol=1e-12, atol=1e-15, err_msg=k)
