"""auto's speed work changes no decision: on seeded simulator cells (tests/_auto_speed_cases.py,
32/64/256 GPUs, 1-4 EP groups) every EP group's choice and committed placement per layer and
iteration are equal to the outputs recorded from the code before it (tests/data/
auto_speed_reference.json), auto's unscaled prices and the simulator's per-iteration results equal
at rtol 1e-12 (the recording's numpy may differ from this venv's in the last bit of a sum)."""

import json

import numpy as np
import pytest

from tests import _auto_speed_cases as cases

with open(cases.PATH) as f:
    RECORDED = json.load(f)


def _diff(got, want):
    """First difference between a live record and a recorded one (None when equal)."""
    if len(got["steps"]) != len(want["steps"]):
        return f"{len(got['steps'])} re-plans vs {len(want['steps'])}"
    for i, (g, w) in enumerate(zip(got["steps"], want["steps"])):
        if g["choice"] != w["choice"]:
            return f"re-plan {i}: choices {g['choice']} vs {w['choice']}"
        if g["placement"] != w["placement"]:
            return f"re-plan {i}: placements differ"
        for gp, wp in zip(g["price"], w["price"]):
            if sorted(gp) != sorted(wp) or not all(
                    (gp[c] is None) == (wp[c] is None) and (gp[c] is None or np.isclose(gp[c], wp[c], rtol=1e-12,
                                                                                        atol=0))
                    for c in wp):
                return f"re-plan {i}: prices {gp} vs {wp}"
    for k, w in want["values"].items():
        if not np.allclose(got["values"][k], w, rtol=1e-12, atol=0):
            return f"result {k} differs"
    return None


@pytest.mark.parametrize("i", range(len(cases.CELLS)))
def test_auto_decisions_equal_recorded(i):
    cell = cases.CELLS[i]
    want = RECORDED[i]
    assert want["cell"] == json.loads(json.dumps(list(cell))), "recorded cells out of date"
    n = {}
    got = cases.record(cell, n)
    gpus, experts, *_, layers, iters, _ = cell
    groups = gpus // min(gpus, experts)
    # it ran: one joint plan per layer and iteration, one proposal per EP group
    assert n["plan_groups"] == layers * iters and n["groups"] == layers * iters * groups
    # FlexMoE run on consecutive re-plans: its steps start from the simulator's pricing of its table
    runs = sum(a == b == "flexmoe" for x, y in zip(want["steps"], want["steps"][layers:])
               for a, b in zip(x["choice"], y["choice"]))
    assert (n.get("shared", 0) > 0) == (runs > 0), (n, runs)
    assert _diff(got, want) is None, _diff(got, want)


def test_recorded_cells_exercise_every_regime():
    """The recorded cells have FlexMoE, Pro-Prophet, a switch into FlexMoE and groups that differ."""
    seqs = [[tuple(s["choice"]) for s in r["steps"]] for r in RECORDED]
    flat = {c for seq in seqs for ch in seq for c in ch}
    assert {"flexmoe", "proprophet"} <= flat
    assert any(a != b for seq in seqs for a, b in zip(seq, seq[1:]))


@pytest.mark.parametrize("i,mutation,where", [(6, {"max_stay": 2.0}, "prices"),
                                              (4, {"coordinate": False}, "choices")])
def test_a_changed_decision_is_caught(i, mutation, where):
    """Mutations: a shorter expected stay changes FlexMoE's price in the switching cell; groups
    choosing alone change the choices in the mixed one. The check sees each."""
    import dataclasses

    from megatron_moe.balance.policies.auto import DEFAULT_RULES

    gpus, experts, z, d, layers, iters, kw = cases.CELLS[i]
    rules = dataclasses.replace(DEFAULT_RULES, **mutation)
    diff = _diff(cases.record((gpus, experts, z, d, layers, iters, dict(kw, rules=rules))), RECORDED[i])
    assert diff is not None and where in diff, diff


def test_placement_fast_paths_equal_the_loops():
    """base.Placement: the vectorised mask and validate agree with the per-expert rules on valid
    and broken placements (a broken one still gets the per-expert one-line error)."""
    from megatron_moe.balance.policies.base import Placement

    rng = np.random.default_rng(0)
    E, D = 8, 4
    owner = Placement.plain(E, D).owner
    checked = {True: 0, False: 0}
    for _ in range(300):
        sets = [sorted({int(owner[e])} | set(rng.choice(D, rng.integers(0, 3)).tolist())) for e in range(E)]
        vx = None
        if rng.random() < 0.5:
            vx = [[int(rng.integers(1, 3)) if g in s else 0 for g in range(D)] for s in sets]
        kind = rng.integers(0, 7)          # break it in one of six ways (0: leave it valid)
        e = int(rng.integers(E))
        if kind == 1:
            sets[e] = sets[e][::-1] if len(sets[e]) > 1 else []
        elif kind == 2:
            sets[e] = sets[e] + [D]
        elif kind == 3:
            sets[e] = [g for g in range(D) if g != owner[e]][:1]
        elif kind == 4:
            sets[e] = [np.int64(g) for g in sets[e]]      # valid, but not Python ints: the loop decides
        elif kind == 5 and vx is not None:
            vx[e] = [1] * D
        elif kind == 6 and vx is not None:
            vx[e] = [0] * D
        p = Placement(sets, D, vx)
        if kind != 2:                                      # (a rank out of range: no mask)
            want = np.zeros((D, E), dtype=bool)
            for k, s in enumerate(sets):
                want[s, k] = True
            assert (p.mask() == want).all()
        try:
            slow_ok = True
            q = Placement(sets, D, vx)
            q._valid_fast = lambda *a: False               # the per-expert loop alone
            q.validate()
        except ValueError:
            slow_ok = False
        assert p._valid_fast() <= slow_ok                   # fast says valid only if it is
        assert (p._valid_fast() == slow_ok) or kind == 4
        try:
            p.validate()
            assert slow_ok
        except ValueError:
            assert not slow_ok
        checked[slow_ok] += 1
    assert min(checked.values()) > 50, checked


def test_flexmoe_table_placement_equals_the_lists():
    """FlexMoE's plan() gives its slot table as a lazily listed Placement: before its lists are
    read it answers replicated/mask/is_plain/its table key from the count array exactly as a
    Placement built from the lists does (sets = hosts + owner, sorted); it equals that Placement;
    once read, an edit of the lists is what its methods see. A step that leaves the counts
    unchanged returns the same object."""
    from megatron_moe.balance.policies.base import Placement, default_owner
    from megatron_moe.balance.policies.flexmoe import FlexMoEPolicy

    rng = np.random.default_rng(1)
    E, G = 16, 8
    owner = default_owner(E, G)
    f = FlexMoEPolicy(None, E, G, threshold=1.0)
    seen_rep = 0
    for it in range(12):
        C = rng.poisson(rng.zipf(1.4, E)[None, :] * 4.0, size=(G, E)).astype(float)
        p = f.plan(C)
        n = f.table.counts()
        sets = [sorted({int(owner[e])} | set(np.nonzero(n[e])[0].tolist())) for e in range(E)]
        eager = Placement(sets, G, n.tolist()).validate()
        assert p._lazy()
        assert p.replicated() == eager.replicated() and p.is_plain() == eager.is_plain()
        assert (p.mask() == eager.mask()).all() and p.num_experts == E and p.has_vexperts
        assert FlexMoEPolicy._key(p) == FlexMoEPolicy._key(eager)     # array key == list key
        assert np.array_equal(p.vexperts_array(), n)
        assert p._lazy()                                               # none of that built the lists
        assert p == eager and eager == p and p.replica_sets == sets and p.vexperts == n.tolist()
        assert not p._lazy() and FlexMoEPolicy._key(p) == FlexMoEPolicy._key(eager)
        seen_rep += len(eager.replicated())
    assert seen_rep > 0
    # integral float vExperts key as the ints (as tuples compared); an edit after reading is seen
    q = Placement(eager.replica_sets, G, [[float(v) for v in r] for r in eager.vexperts])
    assert FlexMoEPolicy._key(q) == FlexMoEPolicy._key(p)
    # a count off the replica sets (not a valid placement) does not share the key of the sets alone
    e0 = next(e for e, s in enumerate(eager.replica_sets) if len(s) < G)
    off = [list(r) for r in eager.vexperts]
    off[e0][next(g for g in range(G) if g not in eager.replica_sets[e0])] = 1
    assert FlexMoEPolicy._key(Placement(eager.replica_sets, G, off)) != FlexMoEPolicy._key(p)
    e = int(np.argmin([len(s) for s in p.replica_sets]))
    p.replica_sets[e] = list(range(G))
    assert e in p.replicated() and p.mask()[:, e].all()
    # an unchanged table: the same Placement object
    f2 = FlexMoEPolicy(None, E, G, threshold=1e9)
    C = np.ones((G, E))
    assert f2.plan(C) is f2.plan(C)


def test_flexmoe_router_delta_equals_whole():
    """auto prices FlexMoE's next table on the same counts from the last one's router result
    (its changed experts' entries out, their new ones in): the traffic and kept inputs equal
    pricing the table whole (up to rounding), over successive FlexMoE steps."""
    from megatron_moe.balance.policies.auto import AutoPolicy

    rng = np.random.default_rng(3)
    E, G = 32, 16
    pol = AutoPolicy(E, G)
    fx = pol.cands["flexmoe"]
    checked = 0
    for it in range(10):
        C = rng.poisson(rng.zipf(1.3, E)[None, :] * 3.0, size=(G, E)).astype(float)
        n0 = fx.table.counts().astype(float)
        pol._flex_last = None
        t0, k0 = pol._flex_router(C, n0)
        fx.step(C)
        n1 = fx.table.counts().astype(float)
        rows = int((n1 != n0).any(axis=1).sum())
        got_t, got_k = pol._flex_router(C, n1)               # from the last result (n0's)
        pol._flex_last = None
        want_t, want_k = pol._flex_router(C, n1)             # whole
        assert np.allclose(got_t, want_t, rtol=1e-12, atol=1e-9) and np.allclose(got_k, want_k, rtol=1e-12, atol=1e-9)
        checked += 0 < rows <= E // 4
    assert checked >= 3, checked


def test_from_plan_checks_the_owner_only_where_it_can_fail():
    """Placement.from_plan skips validate() when every replaced set keeps its owner (the sets it
    builds are sorted unique ranks in range); a plan that excludes an owner still gets the error."""
    from megatron_moe.balance.policies.base import Placement

    p = Placement.from_plan([(1, []), (5, [0, 3]), (-1, [0])], 8, 4)
    assert p.replica_sets[1] == [0, 1, 2, 3] and p.replica_sets[5] == [1, 2] and p.replica_sets[7] == [1, 2, 3]
    assert p.validate() is p
    with pytest.raises(ValueError, match="owner"):
        Placement.from_plan([(4, [2])], 8, 4)               # expert 4's owner is rank 2
    with pytest.raises(ValueError, match="owner"):
        Placement.from_plan([(-1, [3])], 8, 4)             # expert 7's owner is rank 3
