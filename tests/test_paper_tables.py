"""Issue 21: the seed papers' testbeds / models / published cells as data, and bench/paper_tables.py
(pure numpy, no megatron-core; single_leg)."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from megatron_moe.sim import papers
from megatron_moe.sim.papers import Efficiency, PaperSim

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_testbeds_load_with_sources():
    names = papers.list_testbeds()
    # Pro-Prophet's three node types, FasterMoE's two clusters, FlexMoE's and ScheMoE's
    assert {"proprophet_hpwnv", "proprophet_hpnv", "proprophet_lpwnv", "fastermoe_johnny",
            "fastermoe_trevor", "flexmoe_ndv4", "schemoe_2080ti"} <= set(names)
    for n in names:
        tb = papers.load_testbed(n)
        for sec in ("gpu", "intra", "inter"):
            assert len(tb[sec]["source"]) > 20, (n, sec)
        assert tb["gpu"]["peak_fp32_flops"] > 1e12 and tb["gpu"]["memory_bandwidth"] > 1e11
    assert "intra_pair" in papers.load_testbed("proprophet_hpnv")        # NVLink pairs
    assert "intra_pair" not in papers.load_testbed("proprophet_hpwnv")


def test_testbed_without_source_is_refused(tmp_path):
    d = papers.load_testbed("proprophet_hpnv")
    del d["inter"]["source"]
    p = tmp_path / "bad.json"
    p.write_text(json.dumps(d))
    with pytest.raises(ValueError, match="inter.source missing"):
        papers.load_testbed(str(p))


def test_models_and_published_cells_are_consistent():
    models = papers.load_models()
    assert all("source" in m for m in models["models"].values())
    for run in models["papers"].values():
        assert "source" in run and "source" in run["imbalance"]
    pub = papers.load_published()
    for c in pub["cells"]:
        ms = c["model"] if isinstance(c["model"], list) else [c["model"]]
        assert all(m in models["models"] for m in ms), c
        assert c["system"] in papers.SYSTEMS, c
        assert c["baseline"] in papers.SYSTEMS if c.get("metric", "speedup") == "speedup" else c["baseline"] is None, c
        papers.load_testbed(c["testbed"])
    assert all(c["reason"] for c in pub["not_modelled"])


def test_imbalance_matched_as_stated():
    s = papers.zipf_for_share(16, 0.05, bottom=3)          # Pro-Prophet: 3 lightest of 16 hold 5%
    p = np.arange(1, 17) ** -s
    p /= p.sum()
    assert abs(p[-3:].sum() - 0.05) < 1e-9 and p[:3].sum() > 0.5   # and the 3 heaviest > 50%
    tr = papers.paper_trace("MoE-GPT-S", 16, 2, iterations=2)
    assert tr.shape == (2, 12, 16, 16) and (tr.sum(axis=3) == 2 * 1024).all()   # k x 16384/16 tokens


def test_cluster_from_testbed_scales_with_efficiency():
    a = papers.paper_cluster("proprophet_hpnv", "MoE-GPT-M", 16, Efficiency(0.2, 0.5), 1)
    b = papers.paper_cluster("proprophet_hpnv", "MoE-GPT-M", 16, Efficiency(0.4, 1.0), 1)
    assert b.expert_tokens_per_s == pytest.approx(2 * a.expert_tokens_per_s)
    assert b.inter_bw == pytest.approx(2 * a.inter_bw) and b.intra_pair_bw == pytest.approx(56.25e9)
    assert a.t_fnec_s > 0 and a.t_step_s > 0
    fm = papers.paper_cluster("fastermoe_johnny", "FasterMoE/MoE-GPT", 16, Efficiency(0.2, 0.5), 2)
    assert fm.t_fnec_s == 0 and fm.t_step_s == 0                     # MoE-layer latency benchmark


def test_json_rows_schema_and_fitted_flags(tmp_path):
    out = tmp_path / "rows.json"
    r = subprocess.run([sys.executable, "bench/paper_tables.py", "--iterations", "2", "--flops", "0.1",
                        "--net", "0.6", "--tables", "Table V", "Table 3", "--json", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr
    rows = json.loads(out.read_text())
    assert len(rows) == 19                             # 16 Table V cells + Table 3's speed-up and 2 absolute times
    for row in rows:
        assert {"paper", "table", "row", "system", "published", "simulated", "fitted"} <= set(row)
        assert row["fitted"] is False and row["simulated"] > 0
    assert "| Table V | k=1 MoE-GPT-DM | FasterMoE | DeepSpeed-MoE | 0.96x |" in r.stdout


def test_fit_uses_table_iv_only_and_picks_the_grid_minimum():
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import paper_tables

    cells = [c for c in papers.load_published()["cells"] if paper_tables._is_fit(c)][:2]   # k=1 S
    assert all(c["table"] == "Table IV" for c in cells)
    grid = [(0.05, 0.3), (0.3, 1.0)]
    losses = {g: paper_tables._loss(PaperSim(Efficiency(*g), 2), cells) for g in grid}
    eff = paper_tables.fit(cells, 2, flops_grid=[0.05, 0.3], net_grid=[0.3, 1.0], log=lambda s: None)
    best = min(losses.values())
    assert paper_tables._loss(PaperSim(eff, 2), cells) <= best + 1e-12


def test_fastermoe_cells_run_as_the_paper_ran_them():
    """FasterMoE's testbeds carry the rates its validated predictor uses (not the Pro-Prophet fit),
    the artifact's per-trace batch, groups of 2 in the smart schedule, and Table 3 as a whole
    training iteration; Pro-Prophet's testbeds keep the fitted fractions and one group per node."""
    lo, hi = Efficiency(0.05, 0.3), Efficiency(0.5, 1.0)
    a = papers.paper_cluster("fastermoe_johnny", "FasterMoE/MoE-GPT-S", 16, lo, 2)
    b = papers.paper_cluster("fastermoe_johnny", "FasterMoE/MoE-GPT-S", 16, hi, 2)
    assert a.device_flops == b.device_flops == pytest.approx(11.5e12)       # artifact predict.py
    assert a.node_inter_bw == b.node_inter_bw == pytest.approx(6.25e9)      # 50 Gb/s IB
    assert a.intra_bw == pytest.approx(11e9)                                  # 88 Gb/s PCIe
    t = papers.paper_cluster("fastermoe_trevor", "FasterMoE/MoE-BERT-Wide", 64, lo, 2)
    assert t.device_flops == pytest.approx(11.5e12) and t.node_inter_bw == pytest.approx(7.75e9)
    assert t.intra_pair_bw == pytest.approx(39.6e9)                          # artifact's trevor topology
    p = papers.paper_cluster("proprophet_hpnv", "MoE-GPT-M", 16, lo, 1)
    assert p.device_flops == pytest.approx(0.05 * papers.load_testbed("proprophet_hpnv")["gpu"]["peak_fp32_flops"])
    assert papers.paper_trace("FasterMoE/MoE-GPT-S", 16, 2, 2).sum(axis=3).max() == 2 * 1024
    assert papers.paper_trace("FasterMoE/MoE-BERT-Deep", 16, 2, 2).sum(axis=3).max() == 2 * 2048
    imb = papers.load_models()["papers"]["fastermoe"]["imbalance"]           # 16-expert law, carried to 64
    assert papers._popularity(imb, 64)[0] == pytest.approx(papers.zipf_for_share(16, 0.05, bottom=3))
    assert papers.smart_schedule_degree("fastermoe_johnny", 16, "FasterMoE/MoE-GPT-S") == 8
    assert papers.smart_schedule_degree("fastermoe_trevor", 64, "FasterMoE/MoE-BERT-Wide") == 32
    assert papers.smart_schedule_degree("proprophet_hpnv", 16, "MoE-GPT-M") == \
        16 // papers.load_testbed("proprophet_hpnv")["gpus_per_node"]          # one group per node
    e2e = papers.paper_cluster("fastermoe_johnny", "FasterMoE/MoE-GPT", 16, lo, 2, benchmark="end_to_end")
    assert e2e.t_fnec_s > 0 and e2e.t_step_s > 0
    (t3,) = [c for c in papers.load_published()["cells"] if c["table"] == "Table 3" and "metric" not in c]
    assert t3["benchmark"] == "end_to_end"
    sim = PaperSim(lo, 2)
    assert sim.iter_s("fastermoe_johnny", "FasterMoE/MoE-GPT", 16, 2, "FastMoE", "end_to_end") > \
        sim.iter_s("fastermoe_johnny", "FasterMoE/MoE-GPT", 16, 2, "FastMoE")


def test_flexmoe_cells_measure_the_steady_state():
    """FlexMoE's Fig. 5 is time to quality over a whole run: its cells are measured after the
    warm-up its placement needs to converge from plain EP; papers without the setting get none."""
    assert papers.steady_state_warmup("BERT-MoE-S") == 8 and papers.steady_state_warmup("MoE-GPT-S") == 0
    sim = PaperSim(Efficiency(0.05, 0.8), 2)
    a = sim.iter_s("flexmoe_ndv4", "BERT-MoE-S", 32, 2, "FastMoE")
    trace = sim._traces[("BERT-MoE-S", 32, 2, 2 + 8, 0)]     # traces are shared by all PaperSims
    assert trace.shape[0] == 2 + 8
    assert a == pytest.approx(papers.simulate_system(trace, "flexmoe_ndv4", "BERT-MoE-S", 32, 2, "FastMoE",
                                                     Efficiency(0.05, 0.8), skip=9))


def test_fastermoe_paper_cells_decide_with_the_artifacts_constants(monkeypatch):
    """FasterMoE's own cells price the shadowing decision as its code did (johnny's hard-coded rates,
    the 4 bytes per element in the FLOP count too, Eq. 8 literal), and so do Pro-Prophet's (its
    artifact ships the same policy code); FlexMoE's runs and training price it with the cluster's."""
    c = papers.shadow_decision_cost("FasterMoE/MoE-GPT-S", 16)
    assert c.fwd_s_per_input == pytest.approx(4 * 2 * 1024 ** 2 * 4 / 11.5e12)
    assert c.a2a_s_per_input == pytest.approx(1024 * 4 / 6.25e9)
    assert c.param_collective_s == pytest.approx(2 * 2 * 1024 ** 2 * 4 / 6.25e9)
    assert papers.shadow_decision_cost("MoE-GPT-S", 16).fwd_s_per_input == pytest.approx(
        4 * 2 * 512 ** 2 * 4 / 11.5e12)
    assert papers.shadow_decision_cost("BERT-MoE-S", 32) is None
    tr = papers.paper_trace("FasterMoE/MoE-GPT-S", 16, 2, 2)
    args = (tr, "fastermoe_johnny", "FasterMoE/MoE-GPT-S", 16, 2, "FasterMoE shadowing", Efficiency(0.05, 0.8))
    as_ran = papers.simulate_system(*args)
    monkeypatch.setattr(papers, "shadow_decision_cost", lambda model, ranks: None)
    assert papers.simulate_system(*args) != pytest.approx(as_ran, rel=1e-3)


def test_proprophet_systems_run_without_pipelining(monkeypatch):
    """models.json papers.proprophet.systems: in Pro-Prophet's runs neither FasterMoE nor Pro-Prophet
    pipelines (the artifact's FMOE_FUSE_GRAN = world size, a2a_and_ec syncs); FasterMoE's own paper
    keeps the smart schedule. Recorded at the simulator call."""
    calls = []
    real = papers.simulate

    def spy(trace, cl, pol, algo, policy_kwargs=None, degree=1):
        calls.append((pol, degree))
        return real(trace, cl, pol, algo, policy_kwargs=policy_kwargs, degree=degree)

    monkeypatch.setattr(papers, "simulate", spy)
    eff = Efficiency(0.1, 0.5)
    tr = papers.paper_trace("MoE-GPT-S", 8, 1, iterations=2)
    for system in ("FasterMoE", "Pro-Prophet"):
        papers.simulate_system(tr, "proprophet_lpwnv", "MoE-GPT-S", 8, 1, system, eff)
    tr = papers.paper_trace("FasterMoE/MoE-GPT-S", 16, 2, iterations=2)
    papers.simulate_system(tr, "fastermoe_johnny", "FasterMoE/MoE-GPT-S", 16, 2, "FasterMoE", eff)
    assert calls == [("fastermoe", 1), ("proprophet+overlap", 1), ("fastermoe", papers.smart_schedule_degree(
        "fastermoe_johnny", 16, "FasterMoE/MoE-GPT-S"))] and calls[-1][1] > 1


def test_proprophet_imbalance_keeps_the_16_expert_exponent():
    """Fig. 3 is measured on 16 experts; Table V's 8 and Fig. 10's 32 experts get the same Zipf
    exponent (the 3 lightest of 16 at 5%), not a re-matched one."""
    imb = papers.load_models()["papers"]["proprophet"]["imbalance"]
    s16 = papers.zipf_for_share(16, 0.05, bottom=3)
    for e in (8, 16, 32):
        assert papers._popularity(imb, e)[0] == pytest.approx(s16)


def test_proprophet_testbeds_carry_the_artifacts_collective_rate():
    for name in ("proprophet_hpwnv", "proprophet_hpnv", "proprophet_lpwnv"):
        ce = papers.load_testbed(name)["collective_efficiency"]
        assert ce["value"] == pytest.approx(15 / 100) and "Bd_Trans" in ce["source"]
    cl = papers.paper_cluster("proprophet_lpwnv", "MoE-GPT-M", 8, Efficiency(0.1, 0.5), 1)
    assert cl.bcast_efficiency == pytest.approx(0.15)
    assert papers.paper_cluster("flexmoe_ndv4", "BERT-MoE-S", 32, Efficiency(0.1, 0.5), 2).bcast_efficiency == 1.0


def test_proprophet_deepspeed_baseline_pads_to_the_hottest_count(monkeypatch):
    """models.json papers.proprophet.systems: Pro-Prophet's DeepSpeed-MoE runs DeepSpeed's
    drop_tokens=False mode (every expert slot padded to the largest count), recorded at the simulator
    call; other papers' DeepSpeed-MoE mapping is unchanged, and the padding makes it slower."""
    calls = []
    real = papers.simulate

    def spy(trace, cl, pol, algo, policy_kwargs=None, degree=1):
        calls.append((pol, dict(policy_kwargs or {})))
        return real(trace, cl, pol, algo, policy_kwargs=policy_kwargs, degree=degree)

    monkeypatch.setattr(papers, "simulate", spy)
    eff = Efficiency(0.1, 0.5)
    tr = papers.paper_trace("MoE-GPT-S", 8, 1, iterations=2)
    padded = papers.simulate_system(tr, "proprophet_lpwnv", "MoE-GPT-S", 8, 1, "DeepSpeed-MoE", eff)
    unpadded = papers.simulate_system(tr, "proprophet_lpwnv", "MoE-GPT-S", 8, 1, "FastMoE", eff)
    assert calls == [("deepspeed", {}), ("none", {})]
    assert papers.SYSTEMS["DeepSpeed-MoE"][0] == "none"
    assert padded > 1.1 * unpadded


def test_absolute_and_share_cells_read_the_engines_fields():
    """published.json 'metric' cells: iteration_ms is the system's own iteration time (ms), and
    trans_agg_share its Trans/Agg busy time over its iteration time; FasterMoE shadows on the
    skewed Pro-Prophet trace, so the share is positive and moves with the broadcast rate."""
    cells = papers.load_published()["cells"]
    (t1m,) = [c for c in cells if c["table"] == "Table I" and c["model"] == "MoE-GPT-M"]
    (t3a,) = [c for c in cells if c["table"] == "Table 3" and c.get("metric") == "iteration_ms"
              and c["system"] == "FastMoE"]
    sim = papers.PaperSim(Efficiency(0.1, 1.0), iterations=3)
    share = sim.cell(t1m)
    ta = sim.measure(t1m["testbed"], t1m["model"], 16, 1, "FasterMoE", "trans_agg_s")
    assert 0 < share < 1 and share == pytest.approx(ta / sim.iter_s(t1m["testbed"], t1m["model"], 16, 1, "FasterMoE"))
    assert sim.cell(t3a) == pytest.approx(1e3 * sim.iter_s(t3a["testbed"], t3a["model"], 16, 2, "FastMoE", "end_to_end"))
    orig = papers.load_testbed

    def faster_bcast(name):
        d = orig(name)
        d["collective_efficiency"] = dict(d["collective_efficiency"], value=1.0)
        return d

    import unittest.mock as um
    with um.patch.object(papers, "load_testbed", faster_bcast):
        assert papers.PaperSim(Efficiency(0.1, 1.0), iterations=3).cell(t1m) < share


def test_k2_checks_fig14_steps_and_pre_v014_deepspeed():
    """bench/paper_k2_checks.py (issue 21 item 3): Fig. 14's steps are simulated as the planner over
    dropless EP, + the block-wise scheduler (Eq. 6), + Eq. 8, at both k, against Sec. VI-C's numbers;
    DeepSpeed-MoE's top-2 before v0.14 (capacity 2 x S / E, drops) is a balanced-time baseline no
    balancer beats (< 1x), unlike the padded dropless mode the tables use (> 1x).  Mutation tried:
    the pre-v0.14 column run with the padded 'DeepSpeed-MoE' fails the < 1 check; Fig. 14's k=2
    published values swapped with k=1's fail the equality."""
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import paper_k2_checks as k2

    saved = dict(papers.SYSTEMS)
    try:
        res = k2.main(["--iterations", "2", "--parts", "fig14", "deepspeed"])
    finally:
        papers.SYSTEMS.clear()
        papers.SYSTEMS.update(saved)
    assert [(g, k) for g, k, _, _ in res["fig14"]] == [(16, 1), (16, 2), (32, 1), (32, 2)]
    for g, k, sim_gains, pub in res["fig14"]:
        assert pub == {1: (1.26, 1.14, 1.03), 2: (1.12, 1.01, 1.02)}[k]
        assert all(x > 0.9 for x in sim_gains), (g, k, sim_gains)
    for tb, m, g, k, v in res["deepspeed"]:
        assert k == 2
        for s, (padded, dropping) in v.items():
            assert padded > 1.0 > dropping, (tb, m, s, padded, dropping)


def test_k2_checks_uniform_second_choice_is_a_top2_inclusion_law():
    """The sensitivity law (second expert uniform over the other E - 1): every row sums to 2 (two
    distinct experts per token) and no entry exceeds 1; k=1 is the popularity itself.  Mutation
    tried: dividing by E instead of E - 1 fails the row sum."""
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import paper_k2_checks as k2

    p = np.array([[0.5, 0.3, 0.1, 0.05, 0.05], [0.2] * 5])
    pi = k2._uniform_second(p, 2)
    assert np.allclose(pi.sum(axis=1), 2.0) and (pi <= 1.0).all()
    assert np.allclose(k2._uniform_second(p, 1), p)
