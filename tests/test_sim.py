"""Simulator: all-to-all formulas, engine invariants, policy sanity (balanced -> no speedup,
skewed -> speedup), trace loading, 1024-GPU run, CLI."""

import json
import os

import numpy as np
import pytest

from megatron_moe.sim.alltoall import alltoall_time
from megatron_moe.sim.cluster import load_cluster
from megatron_moe.sim.engine import Assignment, simulate_iterations
from megatron_moe.sim.runner import compare, ep_layout, simulate
from megatron_moe.sim.traces import balanced_trace, load_trace_dir, synthetic_trace, tile_sources


def test_alltoall_uniform_and_directional():
    cl = load_cluster(16, ranks_per_node=8, intra_lat=0.0, inter_lat=0.0)
    t = np.full((1, 16, 16), 1e6)
    flat = alltoall_time(t, cl, "flat")[0]
    # each rank sends 7 MB intra and 8 MB inter: one stream adds them (Eq. 17), pipe's two
    # channels overlap them (Eq. 16)
    t_intra, t_inter = 7e6 / cl.intra_bw, 8e6 / cl.inter_bw
    assert flat == pytest.approx(t_intra + t_inter)
    assert alltoall_time(t, cl, "pipe")[0] == pytest.approx(max(t_intra, t_inter))
    # 2DH: intra phase carries N*S/P per local peer, then the same inter bytes node-aggregated
    assert alltoall_time(t, cl, "hierarchical")[0] == pytest.approx(
        7 * 2e6 / cl.intra_bw + 8e6 / cl.inter_bw)
    assert alltoall_time(t, cl, "pipe")[0] <= alltoall_time(t, cl, "hierarchical")[0]
    # a one-directional flow does not load the reverse direction
    one = np.zeros((1, 16, 16)); one[0, 0, 8] = 1e9
    both = one.copy(); both[0, 8, 0] = 1e9
    assert alltoall_time(one, cl, "flat")[0] == pytest.approx(alltoall_time(both, cl, "flat")[0])
    # inside one node every algorithm is the same intra-node exchange
    small = load_cluster(8, ranks_per_node=8)
    u = np.random.default_rng(0).uniform(0, 1e6, size=(2, 8, 8))
    ref = alltoall_time(u, small, "flat")
    for algo in ("hierarchical", "pipe"):
        assert alltoall_time(u, small, algo) == pytest.approx(ref, rel=0.5)
    with pytest.raises(ValueError, match="unknown all-to-all"):
        alltoall_time(t, cl, "ring")


@pytest.mark.parametrize("algo", ["flat", "pipe"])
def test_alltoall_bytes_match_the_runtime_byte_count(algo):
    """With latency 0 and intra = inter bandwidth, the modelled time of one rank's busiest link
    class is bytes / bandwidth for exactly the bytes megatron_moe.comm.wire_stats counts."""
    from megatron_moe.comm import wire_stats

    P, M, row = 4, 2, 1.0
    rng = np.random.default_rng(3)
    S = rng.integers(0, 6, size=(P, P)).astype(float)
    cl = load_cluster(P, ranks_per_node=M, intra_lat=0.0, inter_lat=0.0)
    bw = 1e9
    cl.intra_bw = cl.inter_bw = bw
    cl.a2a_bw_table = None
    got = alltoall_time(S[None] * row, cl, algo)[0]
    # only outgoing traffic of a single sender: zero every other row
    per_rank = []
    for i in range(P):
        only = np.zeros_like(S)
        only[i] = S[i]
        w = wire_stats(algo, only.astype(int), 1, M)
        t1 = alltoall_time(only[None] * row, cl, algo)[0]
        if algo == "flat":
            assert t1 == pytest.approx((w["intra_bytes"] + w["inter_bytes"]) / bw)
        else:
            assert t1 == pytest.approx(max(w["intra_bytes"], w["inter_bytes"]) / bw)
        per_rank.append(t1)
    assert got >= max(per_rank) - 1e-15


def _assignment(groups, p, e, load, trans=0.0, agg=0.0):
    local = np.zeros((groups, p, e)); local[:, :, 0] = load
    return Assignment(local, np.zeros((groups, p, p)), np.full((groups, p), trans), np.full((groups, p), agg),
                      np.zeros(groups), np.zeros(groups), np.zeros((groups, p)))


def test_engine_invariants_and_overlap():
    cl = load_cluster(8, ranks_per_node=8)
    a = _assignment(1, 8, 2, np.arange(8) * 100.0, trans=1e-3, agg=1e-3)
    sync = simulate_iterations(cl, lambda it, l: a, 2, 3, overlap=False).mean()
    ov = simulate_iterations(cl, lambda it, l: a, 2, 3, overlap=True).mean()
    fwd = 1.0 / cl.expert_tokens_per_s
    comp = 3 * (3 * fwd * 700 + cl.t_fnec_s + cl.t_bnec_s)   # 3 layers, busiest rank
    assert sync["iter_s"] >= sync["expert_s"] and sync["expert_s"] == pytest.approx(3 * 3 * fwd * 700)
    assert sync["iter_s"] >= comp - 1e-12
    assert ov["iter_s"] <= sync["iter_s"] + 1e-12
    assert ov["hidden_comm_s"] > 0 and sync["hidden_comm_s"] == pytest.approx(0.0, abs=1e-12)
    assert sync["iter_s"] <= comp + sync["comm_s"] + 1e-12          # makespan <= sum of all work


def test_ep_layout():
    assert ep_layout(1024, 64) == (16, 64)
    assert ep_layout(8, 64) == (1, 8)
    with pytest.raises(ValueError, match="--ep-size"):
        ep_layout(12, 64, 5)


def test_balanced_trace_gives_no_speedup():
    tr = balanced_trace(16, 32, 4, 2, 4096)
    rows = compare(tr, load_cluster(16), ["fastermoe", "flexmoe"], ["flat", "pipe"])
    for (algo, pol), r in rows.items():
        assert r["speedup"] == pytest.approx(1.0, abs=1e-9), (algo, pol)
        assert r["trans_agg_s"] == 0.0 and r["adjust_s"] == 0.0


def test_skewed_trace_gives_speedup_and_is_deterministic():
    tr = synthetic_trace(32, 32, 6, 1, 8192, zipf_s=1.2, seed=3)
    np.testing.assert_array_equal(tr, synthetic_trace(32, 32, 6, 1, 8192, zipf_s=1.2, seed=3))
    assert (tr.sum(axis=3) == 8192).all()
    cl = load_cluster(32)
    rows = compare(tr, cl, ["fastermoe", "flexmoe"], ["flat", "hierarchical"])
    for (algo, pol), r in rows.items():
        if pol != "none":
            assert r["speedup"] > 1.05, (algo, pol, r["speedup"])
            assert r["max_load"] < rows[(algo, "none")]["max_load"]
    again = compare(tr, cl, ["flexmoe"], ["flat"])
    assert again[("flat", "flexmoe")]["iter_s"] == rows[("flat", "flexmoe")]["iter_s"]


def test_1024_gpus_64_experts_100_iterations_runs():
    tr = synthetic_trace(1024, 64, 100, 1, 4096, seed=0)
    cl = load_cluster(1024)
    res = simulate(tr, cl, "fastermoe", "flat")
    assert res.values["iter_s"].shape == (100,)
    assert np.isfinite(res.values["iter_s"]).all() and (res.values["iter_s"] > 0).all()
    flex = simulate(tr[:5], cl, "flexmoe", "pipe")
    assert (flex.values["iter_s"] > 0).all()


def _write_trace(d, counts):
    os.makedirs(d, exist_ok=True)
    for it in range(counts.shape[0]):
        with open(os.path.join(d, f"iter_{it:07d}.json"), "w") as f:
            json.dump({"iteration": it, "layers": {str(l): counts[it, l].tolist()
                                                   for l in range(counts.shape[1])}}, f)


def test_trace_dir_round_trip_and_errors(tmp_path):
    c = synthetic_trace(2, 4, 3, 2, 64, seed=1)
    _write_trace(str(tmp_path / "t"), c)
    np.testing.assert_array_equal(load_trace_dir(str(tmp_path / "t")), c)
    # jsonl, one layer per line
    p = tmp_path / "j"; p.mkdir()
    with open(p / "trace.jsonl", "w") as f:
        for it in range(3):
            for l in range(2):
                f.write(json.dumps({"iteration": it, "layer": l, "counts": c[it, l].tolist()}) + "\n")
    np.testing.assert_array_equal(load_trace_dir(str(p)), c)
    bad = tmp_path / "bad"; bad.mkdir()
    (bad / "x.json").write_text("{\"iteration\": 0, \"counts\": [1, 2")
    with pytest.raises(ValueError, match="x.json:1: invalid JSON"):
        load_trace_dir(str(bad))
    with pytest.raises(FileNotFoundError, match="--trace-dir"):
        load_trace_dir(str(tmp_path / "missing"))
    assert tile_sources(c, 5).shape == (3, 2, 5, 4)
    # one counts_rank<R>.jsonl per EP group: source rows of the groups are concatenated
    m = tmp_path / "groups"; m.mkdir()
    for g in (0, 2):
        with open(m / f"counts_rank{g:05d}.jsonl", "w") as f:
            for it in range(2):
                f.write(json.dumps({"iteration": it, "layer": 1, "counts": c[it, 0].tolist(),
                                    "placement": []}) + "\n")
    t = load_trace_dir(str(m))
    assert t.shape == (2, 1, 4, 4)
    np.testing.assert_array_equal(t[1, 0], np.concatenate([c[1, 0], c[1, 0]]))


def test_profile_feeds_cost_model(tmp_path):
    prof = tmp_path / "p.json"
    prof.write_text(json.dumps({"throughput": 2e6, "input_bytes": 2048, "expert_bytes": 1e6,
                                "t_fnec": 1e-3, "t_bnec": 2e-3}))
    cl = load_cluster(8, str(prof))
    assert cl.expert_tokens_per_s == 2e6 and cl.bytes_per_input == 2048 and cl.t_bnec_s == 2e-3
    assert cl.a2a_bw_table is not None
    topo = tmp_path / "topo.json"
    topo.write_text(json.dumps({"ranks_per_node": 4, "intra_bandwidth_gbps": 100, "inter_bandwidth_gbps": 10}))
    c2 = load_cluster(8, str(topo), profile=str(prof))
    assert c2.ranks_per_node == 4 and c2.inter_bw == 10e9 and c2.expert_tokens_per_s == 2e6
    (tmp_path / "bad.json").write_text("[1]")
    with pytest.raises(ValueError, match="expected a JSON object"):
        load_cluster(8, str(tmp_path / "bad.json"))


def test_cli_smoke(tmp_path, capsys):
    from tools.simulate import main
    res = main(["--gpus", "8", "16", "--experts", "16", "--iterations", "3", "--layers", "1",
                "--inputs-per-rank", "1024", "--algorithms", "flat", "pipe", "--plot-dir",
                str(tmp_path), "--json", str(tmp_path / "r.json")])
    out = capsys.readouterr().out
    assert "speedup" in out and "fastermoe" in out and "flexmoe" in out
    assert (16, "pipe", "flexmoe") in res
    for name in ("sim_speedup.png", "sim_breakdown.png", "sim_iterations.png"):
        assert (tmp_path / name).stat().st_size > 1000
    from megatron_moe.sim.runner import available_policies
    assert len(json.loads((tmp_path / "r.json").read_text())) == 2 * 2 * len(available_policies())


def test_proprophet_plans_with_the_training_defaults(tmp_path):
    """The simulator's Pro-Prophet uses --moe-balance-alpha/--moe-balance-n defaults, so a replayed
    2-rank skewed trace gets the placement training used: both hot experts replicated, the same
    expert time as FasterMoE (which replicates both) after the first, unplanned iteration."""
    prof = tmp_path / "p.json"
    prof.write_text(json.dumps({"a2a_bandwidth": [[65536, 1.8e8], [None, 8.8e8]], "trans_bandwidth": 1.4e9,
                                "throughput": 1.54e5, "input_bytes": 512, "expert_bytes": 2 * 128 * 512 * 4}))
    cl = load_cluster(2, profile=str(prof), ranks_per_node=2)
    skew = np.zeros((4, 2, 2, 4))
    skew[:, :, :, 2:] = 512                   # every input to rank 1's experts 2 and 3
    pp = simulate(skew, cl, "proprophet").values["expert_s"]
    fm = simulate(skew, cl, "fastermoe").values["expert_s"]
    assert pp[0] > fm[0] and np.allclose(pp[1:], fm[1:])
    # the paper artifact's alpha = 3 stops after one expert here: a different computation
    pp3 = simulate(skew, cl, "proprophet", policy_kwargs={"alpha": 3.0}).values["expert_s"]
    assert pp3[1] > fm[1] * 1.2


def test_alltoall_fast_path_matches_general():
    """The linear flat/pipe path (per-rank sums) gives the general per-message path's times; a
    per-message bandwidth table that caps nothing forces the general path on the same cluster."""
    from megatron_moe.sim.cluster import Cluster

    rng = np.random.default_rng(3)
    for pair in (None, 40e9):
        cl = Cluster(num_gpus=32, ranks_per_node=4, intra_bw=12e9, inter_bw=9e9, intra_pair_bw=pair,
                     node_inter_bw=20e9)
        slow = Cluster(**{**cl.__dict__, "a2a_bw_table": [[None, 1e30]]})     # the per-message path
        traffic = rng.integers(0, 10 ** 6, size=(2, 16, 16)).astype(np.float64)
        for algo in ("flat", "pipe"):
            np.testing.assert_allclose(alltoall_time(traffic, cl, algo), alltoall_time(traffic, slow, algo),
                                       rtol=1e-12)
        half = Cluster(**{**cl.__dict__, "msg_efficiency": [[None, 0.5]]})
        assert (alltoall_time(traffic, half, "flat") > alltoall_time(traffic, slow, "flat")).all()


def test_work_is_linear_in_layers_and_iterations():
    """The engine prices each (iteration, layer) once: the policy hook runs layers x iterations
    times and one more iteration adds the same work (counted, not timed), the reason the
    simulator's cost fits a + b * layers * iterations (bench/sim_speed.py)."""
    cl = load_cluster(8)
    calls = []

    def assign(it, l):
        calls.append((it, l))
        z = np.zeros((1, 8))
        return Assignment(np.ones((1, 8, 8)), np.ones((1, 8, 8)), z, z, np.zeros(1), np.zeros(1), z)

    for layers, iters in ((1, 3), (2, 3), (4, 5)):
        calls.clear()
        simulate_iterations(cl, assign, iters, layers)
        assert calls == [(i, l) for i in range(iters) for l in range(layers)]


def test_alltoall_efficiency_by_rank_volume_not_message():
    """``msg_efficiency`` is an all-to-all benchmark's rate by the bytes one GPU exchanges in the
    whole collective (Tutel's bandwidth_test: buffer bytes per GPU / time), so 7 messages of 200 KB
    (1.4 MB per rank) run at the full rate although each message is below the 1 MB step, and
    7 x 100 KB (0.7 MB) at half of it; latency is not scaled. The planner's Eq. 1 gets the curve."""
    from megatron_moe.sim.cluster import Cluster

    kw = dict(num_gpus=8, ranks_per_node=4, intra_bw=10e9, inter_bw=10e9, intra_lat=2e-6, inter_lat=3e-6)
    plain = Cluster(**kw)
    curve = Cluster(**kw, msg_efficiency=[[1e6, 0.5], [None, 1.0]])
    per_message = Cluster(**kw, a2a_bw_table=[[1e6, 5e9], [None, 10e9]])
    for algo in ("flat", "pipe"):
        big = np.full((1, 8, 8), 200e3)
        np.testing.assert_allclose(alltoall_time(big, curve, algo), alltoall_time(big, plain, algo), rtol=1e-12)
        assert (alltoall_time(big, per_message, algo) > 1.5 * alltoall_time(big, plain, algo)).all()
        small = np.full((1, 8, 8), 100e3)
        lat = 3 * 2e-6 + 4 * 3e-6 if algo == "flat" else 4 * 3e-6
        np.testing.assert_allclose(alltoall_time(small, curve, algo) - lat,
                                   2 * (alltoall_time(small, plain, algo) - lat), rtol=1e-12)
    hot = np.full((1, 8, 8), 10e3)
    hot[0, :, 0] = 1e6                                     # rank 0 receives 7 MB: full rate there
    assert alltoall_time(hot, curve)[0] == pytest.approx(alltoall_time(hot, plain)[0])
    cm = curve.cost_model(np.arange(8))
    assert cm.bandwidth(0.5e6) == pytest.approx(0.5 * 10e9) and cm.bandwidth(2e6) == pytest.approx(10e9)


def test_broadcast_efficiency_prices_trans_agg_and_the_planner():
    """``bcast_efficiency``: a broadcast / reduce achieves that fraction of its bottleneck link (the
    Pro-Prophet artifact's 15 Gb/s Trans/Agg against 100 Gb/s all-to-all); latency is not scaled and
    Pro-Prophet's Eq. 4/5 bandwidth is the same rate."""
    from megatron_moe.sim.cluster import Cluster

    kw = dict(num_gpus=8, ranks_per_node=4, intra_bw=10e9, inter_bw=10e9, intra_lat=0.0, inter_lat=0.0)
    full, slow = Cluster(**kw), Cluster(**kw, bcast_efficiency=0.15)
    ranks = np.arange(8)
    assert slow.broadcast_time(15e6, ranks) == pytest.approx(full.broadcast_time(15e6, ranks) / 0.15)
    assert slow.cost_model(ranks).t_trans(1, 0, 8) == pytest.approx(full.cost_model(ranks).t_trans(1, 0, 8) / 0.15)
    lat = Cluster(**dict(kw, inter_lat=1e-5, intra_lat=1e-5), bcast_efficiency=0.15)
    assert lat.cost_model(ranks).t_trans(1, 0, 8) == pytest.approx(slow.cost_model(ranks).t_trans(1, 0, 8) + 7e-5)
    assert slow.allreduce_time(15e6, ranks) == pytest.approx(full.allreduce_time(15e6, ranks))
    with pytest.raises(ValueError, match="bcast_efficiency"):
        Cluster(**kw, bcast_efficiency=0.0)


@pytest.mark.parametrize("gpus", [32, 256])
def test_proprophet_planner_prices_trans_agg_as_the_simulator_charges(gpus):
    """Pro-Prophet's Eq. 4/5 (``Cluster.cost_model``) is the simulator's ring broadcast: the
    bottleneck link at the broadcast efficiency plus D - n - 1 hop latencies (3.22 ms per expert
    over 256 default ranks, against the 0.67 ms of P / B alone that the planner priced before), so
    the Trans/Agg the planner priced for its plan is what the simulated iteration is charged.
    Mutations that fail it: ``trans_latency=self.max_lat(ranks)`` dropped from ``Cluster.cost_model``;
    the ``(k - 1) * hop_latency`` term dropped from ``cost_model.broadcast_s`` in t_trans only."""
    from megatron_moe.balance.policies.proprophet import search

    cl = load_cluster(gpus)
    ranks = np.arange(gpus)
    cm = cl.cost_model(ranks)
    P = cl.expert_param_bytes
    assert cl.inter_lat > 0 and cm.trans_latency == cl.inter_lat
    for n in (0, 1, gpus // 2):
        members = ranks[n:]                                    # spans nodes, as the whole group
        assert cm.t_trans(3, n, gpus) == pytest.approx(3 * cl.broadcast_time(P, members), rel=1e-12)
        assert cm.t_trans(3, n, gpus) > 3 * P / (cl.inter_bw * cl.bcast_efficiency) + 3 * (gpus - n - 2) * cl.inter_lat
    # end to end: iteration 1 runs the plan made from iteration 0's counts (1 layer, n = 0)
    trace = synthetic_trace(gpus, gpus, 2, 1, inputs_per_source=2048, zipf_s=1.2, seed=3)
    res = simulate(trace, cl, "proprophet")
    plan = search(trace[0, 0], cm, alpha=1.0, n=0).plan
    assert 0 < len(plan) < gpus
    priced = cm.t_trans(len(plan), 0, gpus) + cm.t_agg(len(plan), 0, gpus)
    assert res.values["trans_agg_s"][1] == pytest.approx(priced, rel=1e-12)


def test_proprophet_planner_prices_a_partial_fanout_as_charged():
    """With n > 0 the replica sets differ (BottomK keeps each expert's heaviest senders), and the
    simulator charges each rank the broadcasts of the sets it is in (the iteration waits for the
    busiest): the ring-form planner prices s = the largest number of sets one rank is in, not the
    plan's length. One node (the planner's group link is the sets' link), fixed n = 4 of 8.
    Mutation that fails it: ``s_priced = len(steps)`` in proprophet.search."""
    from megatron_moe.balance.policies.proprophet import search

    D, n = 8, 4
    cl = load_cluster(D)
    cm = cl.cost_model(np.arange(D))
    C = np.full((D, D), 20.0)
    for j in range(4):                       # hot expert j is sent mostly by ranks 4 + j and 4 + (j+1)%4
        C[4 + j, j] = C[4 + (j + 1) % 4, j] = 3000.0
        C[(j + 2) % 4, j] = 1500.0
    res = search(C, cm, alpha=0.1, n=n)
    cnt = np.zeros(D)
    for e, nb in res.plan:
        cnt[sorted(set(range(D)) - set(nb))] += 1
    s_max = int(cnt.max())
    assert len(res.plan) >= 3 and s_max < len(res.plan)
    assert res.time_s == pytest.approx(cm.layer_time(res.R_after, res.H_after, s_max, n, D), rel=1e-12)
    sim = simulate(np.stack([C, C])[:, None].astype(np.int64), cl, "proprophet",
                   policy_kwargs={"n": n, "alpha": 0.1})
    assert sim.values["trans_agg_s"][1] == pytest.approx(2 * cm.t_trans(s_max, n, D), rel=1e-12)


def test_trans_latency_term_of_the_papers_eq4():
    """Training's CostModel keeps the paper's Eq. 4 bandwidth term ((D - n) / D of one expert per
    rank) and adds ``trans_latency`` per hop; 0 (the default, and every profile without the key)
    prices bit-identically to the paper's formula. Mutation that fails it: the latency term dropped
    from ``CostModel.t_trans``."""
    from megatron_moe.balance.cost_model import CostModel

    base = dict(input_bytes=4096.0, expert_bytes=16e6, throughput=1e6, trans_bandwidth=2e9)
    paper, lat = CostModel(**base), CostModel(**base, trans_latency=1e-4)
    for s, n, D in ((1, 0, 8), (3, 2, 8), (5, 0, 32), (2, 7, 8)):
        assert paper.t_trans(s, n, D) == s * (D - n) * 16e6 / (D * 2e9)          # exactly the paper's
        assert lat.t_trans(s, n, D) == pytest.approx(paper.t_trans(s, n, D) + s * (D - n - 1) * 1e-4)
        assert lat.t_agg(s, n, D) == lat.t_trans(s, n, D)
    assert CostModel.from_dict({}).trans_latency == 0.0 and not CostModel.from_dict({}).trans_ring
    ring = CostModel(**base, trans_latency=1e-4, trans_ring=True)
    assert ring.t_trans(2, 4, 8) == pytest.approx(2 * (16e6 / 2e9 + 3 * 1e-4))   # every link carries P
    assert ring.t_trans(2, 7, 8) == 0.0                                            # owner only


# ---- top-k routing: every token goes to k distinct experts (traces.synthetic_trace top_k)

def _repeats(trace, tokens):
    """(largest count one source sends one expert, row sums): with k distinct experts per token the
    first is <= tokens and the second k x tokens."""
    return int(trace.max()), np.unique(trace.sum(axis=-1))


def test_top2_counts_have_distinct_experts_per_token():
    from megatron_moe.sim.traces import _multinomial_rows, topk_inclusion
    tokens, hot = 512, [0.7, 0.1, 0.05, 0.05, 0.05, 0.05]
    t = synthetic_trace(24, 6, 6, 2, 2 * tokens, popularity=hot, drift_sigma=0.1, seed=3, top_k=2)
    top, sums = _repeats(t, tokens)
    assert top <= tokens and list(sums) == [2 * tokens] and t.min() >= 0
    # the hot expert is in almost every token's pair (Plackett-Luce inclusion ~0.97), not twice in 70%
    assert top > 0.85 * tokens
    # the mutation (a token's 2 inputs drawn independently, repeats allowed: the generator before)
    # gives the hot expert ~1.4 x tokens inputs from one source, which the check rejects
    p = np.tile(np.array(hot) / sum(hot), (24, 1))
    iid = _multinomial_rows(np.random.default_rng(0), 2 * tokens, p)
    assert _repeats(iid, tokens)[0] > tokens
    # each count's mean is tokens x the inclusion probability of sampling 2 without replacement:
    # against per-token Gumbel-top-2 (the exact per-token law), 200k tokens
    rng = np.random.default_rng(7)
    q = rng.dirichlet(np.full(8, 0.4))
    pair = np.argsort(-(np.log(q) + rng.gumbel(size=(200_000, 8))), axis=1)[:, :2]
    mc = np.bincount(pair.ravel(), minlength=8) / 200_000
    pi = topk_inclusion(q[None], 2)[0]
    assert np.abs(pi - mc).max() < 0.006 and pi.sum() == pytest.approx(2.0) and pi.max() <= 1.0
    from megatron_moe.sim.traces import _distinct_topk_rows
    c = _distinct_topk_rows(np.random.default_rng(1), 1000, np.tile(q, (4000, 1)), 2)
    assert np.abs(c.mean(axis=0) / 1000 - pi).max() < 0.003
    # binomial spread (tokens pick independently): var = tokens pi (1 - pi)
    assert np.allclose(c.var(axis=0), 1000 * pi * (1 - pi), rtol=0.15, atol=1.0)
    with pytest.raises(ValueError, match="top_k=3"):
        synthetic_trace(4, 8, 1, 1, 3 * 64, top_k=3)
    with pytest.raises(ValueError, match="divide"):
        synthetic_trace(4, 8, 1, 1, 101, top_k=2)


def test_top1_stream_is_bit_identical_to_the_generator_before_top_k():
    """k = 1 takes the same random stream as before distinct top-k existed (sha256 of the trace
    bytes, computed from main 258513b's traces.py on both venvs), so every k=1 cell is unchanged."""
    import hashlib
    cases = [(dict(num_sources=16, num_experts=16, iterations=4, layers=3, inputs_per_source=1024,
                   zipf_s=1.106, seed=0), "c012eedb6442d4be"),
             (dict(num_sources=8, num_experts=8, iterations=3, layers=2, inputs_per_source=2048,
                   zipf_s=1.2, drift_sigma=0.1, seed=5), "b07438a83bd749ba"),
             (dict(num_sources=4, num_experts=6, iterations=2, layers=2, inputs_per_source=600,
                   popularity=[0.3, 0.3, 0.1, 0.1, 0.1, 0.1], seed=2), "e7a6883bde47d7d8")]
    for kw, digest in cases:
        for extra in ({}, {"top_k": 1}):
            t = synthetic_trace(**kw, **extra)
            assert hashlib.sha256(np.ascontiguousarray(t, dtype="<i8").tobytes()).hexdigest()[:16] == digest


def test_smart_schedule_is_the_two_stream_makespan():
    """engine._pipelined against a step-by-step replay of FasterMoE's two streams (comm: S_0..S_{n-1}
    then R_0..R_{n-1}, R_j after C_j; compute: C_j after S_j), compute- and communication-bound."""
    from megatron_moe.sim.engine import _pipelined

    def replay(a, c, n):
        s_end = [(j + 1) * a / n for j in range(n)]
        c_end, t = [], 0.0
        for j in range(n):
            t = max(t, s_end[j]) + c / n
            c_end.append(t)
        r = s_end[-1]
        for j in range(n):
            r = max(r, c_end[j]) + a / n
        return r

    a = np.array([1.0, 1.0, 1.0, 1.0, 0.2, 3.0])
    c = np.array([0.3, 1.5, 2.0, 5.0, 4.0, 0.1])
    for n in (1, 2, 8, 32):
        want = [replay(x, y, n) for x, y in zip(a, c)]
        assert _pipelined(a, c, n) == pytest.approx(want, rel=1e-12)
    # communication-bound: the segment is the two all-to-alls, no compute share exposed
    assert _pipelined(np.array([1.0]), np.array([1.5]), 8)[0] == pytest.approx(2.0)
    assert _pipelined(np.array([1.0]), np.array([1.5]), 1)[0] == pytest.approx(3.5)


@pytest.mark.parametrize("algo", ["flat", "hierarchical", "pipe"])
def test_alltoall_that_crosses_no_rank_costs_nothing(algo):
    """As the runtime (balance/layer.py skips it) and the cost model (``a2a_crosses``): an EP
    group whose matrix has only diagonal bytes runs no all-to-all, so not even its latency;
    another group in the same call with one crossing byte pays at least the latency."""
    cl = load_cluster(16)
    t = np.zeros((2, 16, 16))
    t[:, np.arange(16), np.arange(16)] = 1e6
    t[1, 0, 9] = 1.0
    got = alltoall_time(t, cl, algo)
    assert got[0] == 0.0 and got[1] >= cl.intra_lat
