"""Pro-Prophet cost model and planner (design note 5.1 golden example, 5.2 properties)."""

import itertools

import numpy as np
import pytest

from megatron_moe.balance.cost_model import CostModel
from megatron_moe.balance.policies.base import Placement, balance_degree, default_owner, loads, make_policy
from megatron_moe.balance.policies.proprophet import ProProphetPolicy, search

C_GOLD = np.array([[2500, 800, 500, 296], [2200, 1200, 400, 296],
                   [1800, 900, 900, 496], [1500, 700, 700, 1196]], dtype=float)
I_GOLD = 16384


def gold_cost(**kw):
    return CostModel(input_bytes=4096, expert_bytes=2 * 1024 * 2048 * 4,
                     throughput=35.7e12 / (4 * 1024 * 2048), a2a_bandwidth=12.5e9, **kw)


def test_golden_noop():
    cm = gold_cost()
    H, R = loads(C_GOLD, Placement.plain(4, 4))
    assert H.tolist() == [8000, 3600, 2500, 2284] and R.tolist() == [5500, 2400, 1600, 1088]
    assert cm.t_a2a(R) * 1e3 == pytest.approx(1.80224)
    assert cm.t_fec(H) * 1e3 == pytest.approx(1.87980, abs=1e-5)
    assert cm.layer_time(R, H, 0, 0, 4) * 1e3 == pytest.approx(12.8484, abs=1e-4)
    assert balance_degree(H) == pytest.approx(2308.56, abs=1e-2)


@pytest.mark.parametrize("alpha,n,eq8,plan,times", [
    (1.0, 0, False, [(0, [])], [9.9186]),
    (1.0, 1, False, [(0, [3])], [9.2476]),
    (0.25, 0, False, [(0, [])], [9.9186, 11.1315, 13.1335, 13.6248]),
    (0.25, 1, False, [(0, [3])], [9.2476, 9.7893, 11.7420]),
    (0.25, 0, True, [(0, []), (1, [])], [7.2343, 6.7252, 7.9791, 9.2374]),
    (0.25, 1, True, [(0, [3]), (1, [3])], [7.2343, 6.0542, 6.9767]),
])
def test_golden_plans(alpha, n, eq8, plan, times):
    cm = gold_cost(t_fnec=0.5e-3, t_bnec=1.0e-3) if eq8 else gold_cost()
    r = search(C_GOLD, cm, alpha, n, I_GOLD, eq8)
    assert r.plan == plan
    assert [round(t * 1e3, 4) for t in r.step_times] == pytest.approx(times, abs=1e-4)


def test_golden_rb_and_final_state():
    r = search(C_GOLD, gold_cost(), 1.0, 0, I_GOLD)
    assert r.H_after.tolist() == [2500, 5800, 4300, 3784]
    assert r.balance_before / r.balance_after == pytest.approx(1.953, abs=1e-3)
    r = search(C_GOLD, gold_cost(t_fnec=0.5e-3, t_bnec=1.0e-3), 0.25, 0, I_GOLD, True)
    assert r.H_after.tolist() == [3300, 3400, 5200, 4484] and r.R_after.tolist() == [0, 0, 1600, 1088]
    assert r.balance_before / r.balance_after == pytest.approx(2.928, abs=1e-3)
    full = search(C_GOLD, gold_cost(), 0.25, 0, I_GOLD)
    assert full.stop == "balanced" and loads(C_GOLD, Placement([[0, 1, 2, 3]] * 4, 4))[0].tolist() == [4096] * 4


def test_cost_model_identities():
    cm = gold_cost(t_fnec=1e-4, t_bnec=2e-4)
    rng = np.random.default_rng(0)
    for _ in range(50):
        H, R = rng.integers(0, 9000, 4), rng.integers(0, 9000, 4)
        assert cm.t_bec(H) == pytest.approx(2 * cm.t_fec(H))
        assert cm.layer_time(R, H, 0, 0, 4) == pytest.approx(4 * cm.t_a2a(R) + 3 * cm.t_fec(H))
        assert cm.layer_time(R, H, 0, 0, 4, eq8=True) == pytest.approx(cm.layer_time(R, H, 0, 0, 4))
        s, n = int(rng.integers(0, 5)), int(rng.integers(0, 4))
        assert cm.t_trans(s, n, 4) == pytest.approx(s * (4 - n) / 4 * cm.expert_bytes / 12.5e9)
        assert 0 <= cm.t_ptrans(H, s, n, 4) <= cm.t_trans(s, n, 4)
        assert 0 <= cm.t_pagg(H, s, n, 4) <= cm.t_agg(s, n, 4)
        assert cm.layer_time(R, H, s, n, 4, True) <= cm.layer_time(R, H, s, n, 4) + 1e-15
    assert cm.t_trans(0, 1, 4) == 0 and cm.t_trans(3, 4, 4) == 0


def _random_C(rng, D, E, skew=1.2):
    pop = rng.zipf(2.0, E).astype(float) if skew else np.ones(E)
    return np.stack([rng.multinomial(2000, pop / pop.sum()) for _ in range(D)]).astype(float)


def _prefix_times(C, cm, r, n, eq8):
    D, E = C.shape
    out = []
    for k in range(len(r.steps) + 1):
        p = Placement.from_plan(r.steps[:k], E, D)
        H, R = loads(C, p)
        out.append(cm.layer_time(R, H, k, n if k else 0, D, eq8))
    return out


@pytest.mark.parametrize("D,E", [(4, 4), (8, 8), (4, 8), (2, 8)])
def test_properties_random(D, E):
    rng = np.random.default_rng(D * 100 + E)
    cm = CostModel(input_bytes=4096, expert_bytes=1 << 20, throughput=2e6, a2a_bandwidth=5e9,
                   t_fnec=1e-4, t_bnec=2e-4)
    owner = default_owner(E, D)
    for trial in range(40):
        C = _random_C(rng, D, E)
        for n, eq8, alpha in itertools.product(range(min(D, 3)), (False, True), (0.0, 0.5, 2.0)):
            r = search(C, cm, alpha, n, eq8=eq8)
            times = _prefix_times(C, cm, r, n, eq8)
            assert r.time_s <= r.noop_time_s                                  # no regression
            assert r.time_s == pytest.approx(min(times))                      # optimal prefix
            assert len(r.plan) == int(np.argmin(times))                      # ties keep the shorter
            assert len(r.steps) <= E                                          # termination
            if E == D:
                assert len(r.steps) <= min(E, D)
                assert len({owner[e] for e, _ in r.steps}) == len(r.steps)    # distinct owners
            experts = [e for e, _ in r.steps]
            assert len(set(experts)) == len(experts)                          # each expert once
            for e, nb in r.steps:
                assert len(nb) == n and owner[e] not in nb
                others = sorted(C[d, e] for d in range(D) if d != owner[e])
                assert sorted(C[nb, e].tolist()) == others[:n]                # BottomK
            p = Placement.from_plan(r.plan, E, D)
            assert all(len(s) == (D - n if e in dict(r.plan) else 1) for e, s in enumerate(p.replica_sets))
            H, R = loads(C, p)
            assert H.sum() == pytest.approx(C.sum()) and np.all(R <= H)       # conservation
            # monotonic in alpha: larger alpha never evaluates more steps, same sequence
            r2 = search(C, cm, alpha + 1.0, n, eq8=eq8)
            assert len(r2.steps) <= len(r.steps) and r2.steps == r.steps[:len(r2.steps)]


def test_balanced_input_gives_empty_plan():
    C = np.full((4, 4), 500.0)
    r = search(C, gold_cost(), 0.1, 0)
    assert r.plan == [] and r.steps == [] and r.stop == "balanced"


def test_all_replicated_n0_makes_R_zero():
    C = _random_C(np.random.default_rng(3), 4, 4)
    H, R = loads(C, Placement([[0, 1, 2, 3]] * 4, 4))
    assert R.tolist() == [0, 0, 0, 0] and H.tolist() == C.sum(axis=1).tolist()


def test_ties_are_deterministic_under_permuted_equal_values():
    # two equal heaviest ranks and equal bottom candidates: lowest index wins, every time
    C = np.array([[500, 100, 100, 100], [100, 500, 100, 100], [0, 0, 100, 100], [0, 0, 100, 100]], float)
    cm = CostModel(input_bytes=4096, expert_bytes=1 << 10, throughput=1e5, a2a_bandwidth=1e9)
    r = search(C, cm, 0.0, 1)
    assert r.steps[0] == (0, [2]) and r.steps[1] == (1, [2])
    assert all(search(C.copy(), cm, 0.0, 1).steps == r.steps for _ in range(5))


def test_generalised_rule_more_experts_than_ranks():
    # rank 0 owns experts 0,1; expert 1 has the larger remote load so it is picked first,
    # and rank 0 is "used" only after both of its experts are selected
    C = np.array([[400, 10, 10, 10], [300, 900, 10, 10]], float)
    cm = CostModel(input_bytes=4096, expert_bytes=1 << 10, throughput=1e5, a2a_bandwidth=1e9)
    r = search(C, cm, 0.0, 0)
    assert r.steps[0][0] == 1
    # then rank 1 (940 inputs) is the heaviest: equal remote loads of experts 2, 3 -> lowest id
    assert r.steps[1][0] == 2
    # a rank with unselected experts left is not "used": rank 0 can be picked again (expert 0)
    C2 = np.array([[900, 10, 10, 10], [800, 700, 10, 10]], float)
    steps = [e for e, _ in search(C2, cm, 0.0, 0).steps]
    assert steps[:2] == [0, 1]
    # E == D reduces to the paper's rule (golden example above is already E == D)


def test_policy_interface_and_errors(tmp_path):
    pol = make_policy("proprophet", 4, 4, cost=gold_cost(), alpha=1.0, n=1)
    assert isinstance(pol, ProProphetPolicy)
    p = pol.plan(C_GOLD)
    assert p.to_plan() == [[0, [3]]] and p.replica_sets[0] == [0, 1, 2]
    assert make_policy("none", 4, 4).plan(C_GOLD).is_plain()
    with pytest.raises(ValueError, match="--moe-balance-policy"):
        make_policy("bogus", 4, 4)
    with pytest.raises(ValueError, match="--moe-balance-n"):
        make_policy("proprophet", 4, 4, n=4)
    bad = tmp_path / "p.json"
    bad.write_text('{"throughput": 1, "bogus": 2}')
    with pytest.raises(ValueError, match="unknown keys"):
        CostModel.from_profile(str(bad))
    with pytest.raises(ValueError, match="owner"):
        Placement([[1], [1], [2], [3]], 4).validate()


def test_trans_split_rule():
    """Scheduler: part A (under T_FNEC) = longest expert-id prefix of the next layer's replicated
    experts whose Eq. 4 time fits the calibrated t_fnec; part B (under T_FEC) = the rest."""
    import types

    from megatron_moe.balance.scheduler import BalanceScheduler

    cm = gold_cost()
    full = cm.t_trans(1, 0, 4)                     # one expert to all 4 ranks
    pl = Placement([[0, 1, 2, 3], [1], [0, 1, 2], [0, 1, 2, 3]], 4)
    st = types.SimpleNamespace(D=4, _active_placement=pl, trans_experts=lambda: pl.replicated())
    sched = BalanceScheduler(overlap=True, cost=cm)
    assert sched.split_trans(st) == ([], [0, 2, 3])                      # t_fnec = 0: all under FEC
    cm.t_fnec = 1.5 * full
    assert sched.split_trans(st) == ([0], [2, 3])
    cm.t_fnec = 1.8 * full                         # expert 2 goes to 3 of 4 ranks: 0.75 of a full one
    assert sched.split_trans(st) == ([0, 2], [3])
    cm.t_fnec = 10 * full
    assert sched.split_trans(st) == ([0, 2, 3], [])
    assert BalanceScheduler(overlap=True).split_trans(st) == ([], [0, 2, 3])   # no cost model


def test_stats_peek_equals_add_then_predict():
    from megatron_moe.balance.stats import RoutingStats

    rng = np.random.default_rng(1)
    for predictor in ("last", "ema"):
        a, b = RoutingStats(predictor=predictor), RoutingStats(predictor=predictor)
        for it in range(4):
            C = rng.integers(0, 50, size=(2, 4)).astype(float)
            peek = a.peek(3, C)
            a.add(3, it, C)
            b.add(3, it, C)
            assert np.array_equal(peek, a.predict(3)) and np.array_equal(a.predict(3), b.predict(3))


def test_cost_mode_picks_the_fanout():
    """n="cost": at D=256 with one hot expert sent by 7 ranks the plan keeps the owner + those 7
    (n = 248, a proper subset) and is cheaper than n = 0; at D=4 with uniform sources it keeps n = 0."""
    cm = gold_cost(trans_bandwidth=15e9 / 8)
    D = 256
    C = np.full((D, D), 2.0)
    C[1:8, 0] = 20000.0
    full, sub = search(C, cm, 1.0, 0), search(C, cm, 1.0, "cost")
    assert full.plan == [(0, [])]
    assert sub.plan and sub.plan[0][0] == 0
    assert sub.n == 248 and sub.plan[0][1] == list(range(8, D))     # BottomK(248): all but the 7 senders
    assert sub.time_s < full.time_s < sub.noop_time_s
    p = ProProphetPolicy(D, D, cost=cm, alpha=1.0, n="cost").plan(C)
    assert p.replica_sets[0] == list(range(8))
    D = 4
    C = np.full((D, D), 100.0)
    C[:, 0] = 30000.0
    r0, rc = search(C, cm, 1.0, 0), search(C, cm, 1.0, "cost")
    assert rc.n == 0 and rc.plan == r0.plan == [(0, [])] and rc.time_s == r0.time_s
    with pytest.raises(ValueError, match="--moe-balance-n"):
        ProProphetPolicy(4, 4, n="all")
