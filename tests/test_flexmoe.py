"""FlexMoE vExperts: the design note's testable claims (flexmoe.md section 5)."""

import json

import numpy as np
import pytest

from megatron_moe.balance.policies.flexmoe import (FREE, FlexMoEPolicy, SlotTable, balance_ratio, flex_cost,
                                                   initial_slots, route_real, route_tokens)
from megatron_moe.sim.cluster import load_cluster
from megatron_moe.balance.cost_model import PlannerCost, sync_s_vec

COMPUTE_ONLY = PlannerCost(fwd_s_per_input=1.0 / 3, a2a_s_per_input=0.0, param_collective_s=0.0)


def test_balance_ratio_properties():
    rng = np.random.default_rng(0)
    for _ in range(50):
        x = rng.uniform(0.1, 10, size=6)
        r = balance_ratio(x)
        assert r >= 1.0
        assert balance_ratio(3.7 * x) == pytest.approx(r)
    assert balance_ratio(np.full(5, 2.0)) == 1.0
    assert balance_ratio(np.zeros(3)) == 1.0


def _random_case(seed, g=4, e=6, s=3):
    rng = np.random.default_rng(seed)
    slots = rng.integers(0, e, size=(g, s))
    slots.flat[:e] = np.arange(e)                      # every expert has a vExpert
    rng.shuffle(slots.flat)
    origin = rng.integers(0, 50, size=(g, e))
    return SlotTable(slots, e), origin


@pytest.mark.parametrize("seed", range(8))
def test_router_claims(seed):
    table, origin = _random_case(seed)
    n = table.counts()
    send = route_tokens(origin, n)
    g_n, e_n = origin.shape
    # 3. conservation
    np.testing.assert_array_equal(send.sum(axis=2).T, origin)
    # 4. validity: only to ranks holding a replica
    for e in range(e_n):
        assert (send[e][:, n[e] == 0] == 0).all()
    # 5. locality first (integer capacities from the largest-remainder split)
    keep, spill, frac = route_real(origin, n)
    cap = origin.sum(axis=0) / n.sum(axis=1)
    for e in range(e_n):
        for g in range(g_n):
            if n[e, g] and origin[g, e] <= np.floor(cap[e] * n[e, g]):
                assert send[e, g, g] == origin[g, e]
    # 6. exact balancing in reals; integer deviation <= number of sources
    processed = keep + spill.sum(axis=1, keepdims=True) * frac
    np.testing.assert_allclose(processed, cap[:, None] * n, atol=1e-9)
    recv = send.sum(axis=1)                            # [E, dst]
    assert np.abs(recv - cap[:, None] * n).max() <= g_n + 1
    # 7. determinism
    np.testing.assert_array_equal(route_tokens(origin.copy(), n.copy()), send)


def test_router_reduces_to_plain_ep():
    table = SlotTable(np.arange(4).reshape(4, 1), 4)
    origin = np.array([[3, 1, 0, 5], [2, 2, 2, 2], [9, 0, 1, 0], [0, 0, 0, 7]])
    send = route_tokens(origin, table.counts())
    for e in range(4):
        np.testing.assert_array_equal(send[e][:, e], origin[:, e])
        assert send[e].sum() == send[e][:, e].sum()


def test_sign_fix_spare_is_nonnegative():
    n = np.array([[1, 1]])
    keep, spill, frac = route_real(np.array([[10], [0]]), n)
    np.testing.assert_allclose(keep, [[5, 0]])
    np.testing.assert_allclose(spill, [[5, 0]])
    np.testing.assert_allclose(frac, [[0, 1]])         # the paper's sign would make this negative


def test_worked_example_three_steps():
    pol = FlexMoEPolicy(COMPUTE_ONLY, 4, 4, 2, threshold=1.0, migrate=False)
    origin = np.array([[10, 2, 2, 2]] * 4)
    assert pol.table.slots.tolist() == [[0, 0], [1, 1], [2, 2], [3, 3]]
    assert balance_ratio(pol.loads(origin)) == pytest.approx(2.5)
    expect = [([26.667, 21.333, 8, 8], 1.667), ([20, 18, 18, 8], 1.25), ([16, 16, 16, 16], 1.0)]
    for step, (ld, ratio) in enumerate(expect):
        plan = pol.make_plan(origin)
        assert [op[0] for op in plan] == ["shrink", "expand"]
        assert plan[1][1] == 0 and plan[0][1] == step + 1       # Expand e0, Shrink e1, e2, e3
        pol._apply(plan)
        np.testing.assert_allclose(pol.loads(origin), ld, atol=1e-3)
        assert balance_ratio(pol.loads(origin)) == pytest.approx(ratio, abs=1e-3)
    assert pol.table.counts()[0].sum() == 5
    assert pol.make_plan(origin) == []
    # the scheduler loop reaches the same state in one call
    pol2 = FlexMoEPolicy(COMPUTE_ONLY, 4, 4, 2, threshold=1.0, migrate=False)
    ops = pol2.step(origin)
    assert len(ops) == 6 and pol2.table.slots.tolist() == pol.table.slots.tolist()


def test_guards_invariants_and_termination():
    rng = np.random.default_rng(3)
    cl = load_cluster(16, ranks_per_node=4)
    cost = cl.planner_cost(np.arange(16))
    for seed in range(4):
        p = 1.0 / np.arange(1, 17) ** 1.3
        origin = rng.multinomial(4096, p[rng.permutation(16)] / p.sum(), size=16)
        pol = FlexMoEPolicy(cost, 16, 16, 2, threshold=1.05, max_steps=40)
        total = pol.table.counts().sum()
        t0 = pol.cost_of(origin)
        static = flex_cost(origin, SlotTable(initial_slots(16, 16, 2), 16).counts(), cost)
        prev = t0
        for _ in range(3):
            ops = pol.step(origin)
            n = pol.table.counts()
            assert n.sum() == total                          # 10. sum n_e invariant
            assert (n.sum(axis=1) >= 1).all()                # never the last copy
            assert ((pol.table.slots != FREE).sum(axis=1) <= 2).all()
            t = pol.cost_of(origin)
            assert t <= prev + 1e-12                         # 9. modelled cost never rises
            prev = t
        assert prev <= static                                # 14. no worse than static EP
        # 11. e_hot / e_cold rule on the current state
        n = pol.table.counts()
        cap = origin.sum(axis=0) / n.sum(axis=1)
        plan = pol.make_plan(origin)
        if plan:
            assert plan[-1][1] == int(np.argmax(cap))


def test_no_valid_cold_expert_gives_empty_plan():
    pol = FlexMoEPolicy(COMPUTE_ONLY, 4, 4, 1, threshold=1.0)     # one slot each: nothing to shrink
    assert pol.make_plan(np.array([[10, 1, 1, 1]] * 4)) == []
    assert pol.step(np.array([[10, 1, 1, 1]] * 4)) == []


def test_balanced_loads_and_trigger_gate():
    pol = FlexMoEPolicy(COMPUTE_ONLY, 4, 4, 2, threshold=1.1)
    assert pol.step(np.full((4, 4), 8)) == [] and pol.calls == 0   # 13. / 2. never called
    skew = np.array([[10, 2, 2, 2]] * 4)
    hi = FlexMoEPolicy(COMPUTE_ONLY, 4, 4, 2, threshold=3.0)
    assert hi.step(skew) == [] and hi.calls == 0                    # ratio 2.5 <= 3
    lo = FlexMoEPolicy(COMPUTE_ONLY, 4, 4, 2, threshold=1.1)
    assert lo.step(skew) and lo.calls == 1


def test_sync_cost_claims():
    cl = load_cluster(8, ranks_per_node=4)
    cost = cl.planner_cost(np.arange(8))
    hosts = np.zeros((3, 8), dtype=bool)
    hosts[0, 0] = True                        # single rank (even with 2 vExperts there): no sync
    hosts[1, [0, 1]] = True                   # same node
    hosts[2, [0, 4]] = True                   # across nodes: slower
    s = sync_s_vec(cost, hosts)
    assert s[0] == 0 and 0 < s[1] < s[2]
    # with sync, the planner stops expanding earlier than compute-only
    origin = np.array([[40, 2, 2, 2, 2, 2, 2, 2]] * 8)
    a = FlexMoEPolicy(cost, 8, 8, 2, threshold=1.0, migrate=False)
    b = FlexMoEPolicy(PlannerCost(fwd_s_per_input=cost.fwd_s_per_input, a2a_s_per_input=0,
                                  param_collective_s=0), 8, 8, 2, threshold=1.0, migrate=False)
    a.step(origin); b.step(origin)
    assert a.table.counts()[0].sum() <= b.table.counts()[0].sum()


def test_migrate_tightens_groups_and_keeps_counts():
    cl = load_cluster(8, ranks_per_node=4)
    cost = cl.planner_cost(np.arange(8))
    # expert 0 split over two nodes (ranks 0 and 4); expert 4 on rank 0's node pair
    slots = initial_slots(8, 8, 2)
    slots[4, 1] = 0; slots[1, 1] = 4        # e0 on {0, 4}; e4 on {1, 4}; e1 on {1}
    table = SlotTable(slots, 8)
    pol = FlexMoEPolicy(cost, 8, 8, 2, table=table)
    origin = np.full((8, 8), 16)
    n0 = pol.table.counts().sum(axis=1)
    before = sync_s_vec(cost, pol.table.counts() > 0).sum()
    t0 = pol.cost_of(origin)
    ops = pol.migrate(origin)
    assert ops and all(op[0] == "migrate" for op in ops)
    assert sync_s_vec(cost, pol.table.counts() > 0).sum() < before
    np.testing.assert_array_equal(pol.table.counts().sum(axis=1), n0)
    assert pol.cost_of(origin) <= t0
    assert all(nb > 0 for _, _, nb in pol.adjustment_bytes(ops))


def test_slot_table_serialisation_and_fallback():
    t = SlotTable(initial_slots(6, 4, 3), 6, version=7)
    s = t.to_json()
    json.loads(s)
    r = SlotTable.from_json(s, num_ranks=4, num_experts=6)
    np.testing.assert_array_equal(r.slots, t.slots)
    assert r.version == 7
    assert SlotTable.from_json(s, num_ranks=2) is None           # different EP size -> fall back
    with pytest.raises(ValueError, match="no vExpert"):
        SlotTable(np.zeros((2, 2), dtype=int), 3)
    with pytest.raises(ValueError, match="out of range"):
        SlotTable(np.array([[0, 9]]), 2)
    with pytest.raises(ValueError, match="unknown format"):
        SlotTable.from_dict({"format": "x"})
    with pytest.raises(ValueError, match="slots"):
        initial_slots(9, 2, 4)


def test_expand_adjustment_bytes():
    cl = load_cluster(4, ranks_per_node=4)
    pol = FlexMoEPolicy(cl.planner_cost(np.arange(4)), 4, 4, 2, threshold=1.0)
    ops = pol.step(np.array([[10, 2, 2, 2]] * 4) * 4000)
    moves = pol.adjustment_bytes(ops)
    n_expand_remote = sum(1 for op in ops if op[0] == "expand" and op[2] != op[3])
    assert len(moves) >= n_expand_remote > 0
    assert all(m[2] == cl.expert_state_bytes for m in moves[:n_expand_remote])
    # Shrink issues no transfer
    assert pol.adjustment_bytes([op for op in ops if op[0] == "shrink"]) == []


def test_balance_interface_and_checkpoint_fallback():
    from megatron_moe.balance.cost_model import CostModel
    from megatron_moe.balance.policies.base import loads as bal_loads, make_policy
    pol = make_policy("flexmoe", 4, 4, cost=CostModel.from_profile(None), threshold=1.0)
    assert isinstance(pol, FlexMoEPolicy)
    counts = np.array([[10, 2, 2, 2]] * 4) * 4000
    placement = pol.plan(counts)
    n = pol.table.counts()
    for e, s in enumerate(placement.replica_sets):
        assert set(np.nonzero(n[e])[0]) <= set(s) and e in s        # owner always present
    assert placement.replicated() == [0]
    H, _ = bal_loads(counts, placement)
    assert H.max() < counts.sum(axis=0).max()                         # locality-only still helps
    sd = pol.state_dict()
    other = make_policy("flexmoe", 4, 4, threshold=1.0)
    assert other.load_state_dict(json.loads(json.dumps(sd)))
    np.testing.assert_array_equal(other.table.slots, pol.table.slots)
    smaller = make_policy("flexmoe", 4, 2)
    assert smaller.load_state_dict(sd) is False                       # EP 4 -> 2: clean fallback
    np.testing.assert_array_equal(smaller.table.slots, initial_slots(4, 2, smaller.slots_per_rank))


def test_one_policy_shared_by_layers_keeps_each_layers_table():
    pol = FlexMoEPolicy(COMPUTE_ONLY, 4, 4, 2, threshold=1.0)
    from megatron_moe.balance.policies.base import Placement
    a = np.array([[10, 2, 2, 2]] * 4)          # layer A: expert 0 hot
    b = np.array([[2, 2, 2, 10]] * 4)          # layer B: expert 3 hot
    pa = pol.plan(a, Placement.plain(4, 4))
    pb = pol.plan(b, Placement.plain(4, 4))
    assert pa.replicated() == [0] and pb.replicated() == [3]
    solo_a = FlexMoEPolicy(COMPUTE_ONLY, 4, 4, 2, threshold=1.0)
    solo_b = FlexMoEPolicy(COMPUTE_ONLY, 4, 4, 2, threshold=1.0)
    qa = solo_a.plan(a, Placement.plain(4, 4)); qb = solo_b.plan(b, Placement.plain(4, 4))
    # the next iteration of each layer continues from its own table, as with one policy per layer
    assert pol.plan(a, pa).replica_sets == solo_a.plan(a, qa).replica_sets
    assert pol.plan(b, pb).replica_sets == solo_b.plan(b, qb).replica_sets
    sd = json.loads(json.dumps(pol.state_dict()))
    again = FlexMoEPolicy(COMPUTE_ONLY, 4, 4, 2, threshold=1.0)
    assert again.load_state_dict(sd)
    assert again.plan(b, pb).replica_sets == pol.plan(b, pb).replica_sets


def test_dispatch_matrix_flexible_router_and_locality_rule():
    """The layer executes ``dispatch_matrix``: FlexMoE placements (vExpert counts) use the integer
    flexible router (locality first, overflow by spare capacity); Pro-Prophet placements keep inputs
    on replica ranks and send the rest to the owner; loads() agrees with both."""
    from megatron_moe.balance.policies.base import Placement, dispatch_matrix, loads as bal_loads

    rng = np.random.default_rng(3)
    for _ in range(20):
        origin = rng.integers(0, 40, size=(4, 4))
        n = rng.integers(0, 3, size=(4, 4))
        n[n.sum(axis=1) == 0, 1] = 1
        owner = np.arange(4)
        sets = [sorted(set(np.nonzero(n[e])[0].tolist()) | {e}) for e in range(4)]
        p = Placement(sets, 4, n.tolist()).validate()
        send = dispatch_matrix(origin, p)
        np.testing.assert_array_equal(send, route_tokens(origin, n))
        np.testing.assert_array_equal(send.sum(axis=2).T, origin)               # nothing dropped
        assert all((send[e][:, n[e] == 0] == 0).all() for e in range(4))         # only to vExperts
        H, R = bal_loads(origin, p)
        np.testing.assert_array_equal(H, send.sum(axis=(0, 1)))
        np.testing.assert_array_equal(R, H - np.einsum("egg->g", send))
        # the same replica sets without vExperts: Pro-Prophet's rule, and loads() unchanged
        q = Placement(sets, 4)
        sq = dispatch_matrix(origin, q)
        for e in range(4):
            for d in range(4):
                tgt = d if d in sets[e] else owner[e]
                assert sq[e, d, tgt] == origin[d, e] and sq[e, d].sum() == origin[d, e]
        Hq, Rq = bal_loads(origin, q)
        np.testing.assert_array_equal(Hq, sq.sum(axis=(0, 1)))
        np.testing.assert_array_equal(Rq, Hq - np.einsum("egg->g", sq))
    # overflow goes to the replica with spare room: e0 hot on rank 0, one vExpert on each rank
    p = Placement([[0, 1], [1]], 2, [[1, 1], [0, 1]])
    send = dispatch_matrix(np.array([[10, 0], [2, 4]]), p)
    assert send[0].tolist() == [[6, 4], [0, 2]]          # capacity 6 each: rank 0 keeps 6, spills 4


def test_vexpert_placement_validation_and_round_trip():
    from megatron_moe.balance.policies.base import Placement

    p = Placement([[0, 1], [1]], 2, [[0, 2], [0, 1]]).validate()   # owner without a vExpert is fine
    assert Placement.from_dict(p.to_dict()) == p
    with pytest.raises(ValueError, match="vExpert"):
        Placement([[0], [1]], 2, [[1, 1], [0, 1]]).validate()        # slot outside the replica set
    with pytest.raises(ValueError, match="vExpert"):
        Placement([[0], [1]], 2, [[0, 0], [0, 1]]).validate()        # expert without a slot
    with pytest.raises(ValueError, match="vexperts"):
        Placement([[0], [1]], 2, [[1, 0]]).validate()


def test_structured_pair_product_matches_matmul():
    """The per-node form of spill @ pair equals the matmul on a two-rate cluster; a third rate
    (NVLink pairs) breaks the structure and the matmul is used."""
    from megatron_moe.balance.policies.flexmoe import _pair_product
    from megatron_moe.sim.cluster import Cluster

    rng = np.random.default_rng(0)
    spill = rng.random((5, 16)) * 100
    for pair_bw in (None, 80e9):
        cost = Cluster(num_gpus=16, ranks_per_node=4, intra_bw=20e9, inter_bw=5e9,
                       intra_pair_bw=pair_bw).planner_cost(np.arange(16))
        np.testing.assert_allclose(_pair_product(spill, cost), spill @ cost.pair_s_per_input, rtol=1e-12)
        assert (cost.cache.pair_structure is False) == (pair_bw is not None)
