"""tools/plan_placement.py (issue item 7), tools/routing_report.py (item 8), the flags and stats."""

import argparse
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from megatron_moe.balance import add_arguments, install
from megatron_moe.balance.policies.base import Placement
from megatron_moe.balance.stats import RoutingStats, imbalance

ROOT = Path(__file__).resolve().parents[1]
GOLD = [[2500, 800, 500, 296], [2200, 1200, 400, 296], [1800, 900, 900, 496], [1500, 700, 700, 1196]]


def _plan(tmp_path, *extra, counts=GOLD):
    path = tmp_path / "c.json"
    path.write_text(json.dumps(counts))
    cmd = [sys.executable, str(ROOT / "tools/plan_placement.py"), "--counts", str(path), "--policy",
           "proprophet", "--num-inputs", "16384", "--input-bytes", "4096", "--expert-bytes", "16777216",
           "--bandwidth", "12.5e9", "--throughput", "4255771.64", *extra]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path)


def test_plan_placement_golden(tmp_path):
    r = _plan(tmp_path, "--alpha", "1", "--n", "1")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["plan"] == [[0, [3]]]
    assert out["time_s"] == pytest.approx(9.2476e-3, abs=1e-7)
    assert out["noop_time_s"] == pytest.approx(12.8484e-3, abs=1e-7)
    assert out["balance_before"] == pytest.approx(2308.56, abs=0.01)
    assert out["balance_before"] / out["balance_after"] == pytest.approx(1.849, abs=1e-3)
    r = _plan(tmp_path, "--alpha", "0.25", "--n", "0", "--overlap", "--t-fnec", "0.0005", "--t-bnec", "0.001")
    assert json.loads(r.stdout)["plan"] == [[0, []], [1, []]]


def test_plan_placement_errors(tmp_path):
    r = _plan(tmp_path, "--n", "4")
    assert r.returncode != 0 and "--n 4" in r.stderr
    r = _plan(tmp_path, counts=[[1, 2], [3]])
    assert r.returncode != 0 and "different lengths" in r.stderr


def test_routing_report_synthetic(tmp_path):
    from tools import routing_report

    d = tmp_path / "trace"
    d.mkdir()
    rng = np.random.default_rng(0)
    with open(d / "counts_rank00000.jsonl", "w") as f:
        for it in range(5):
            for layer in (1, 2):
                C = rng.integers(0, 100, (2, 4)).tolist()
                f.write(json.dumps({"iteration": it, "layer": layer, "counts": C,
                                    "placement": [[0, []]] if it % 2 else []}) + "\n")
    lines = routing_report.main([str(d), "--out", str(tmp_path / "x.png"), "--summary", str(tmp_path / "s.txt")])
    assert len(lines) == 2 and (tmp_path / "x.png").exists() and "replicated experts/iter 0.40" in lines[0]
    with open(d / "counts_rank00000.jsonl", "a") as f:
        f.write("{not json\n")
    with pytest.raises(SystemExit, match="counts_rank00000.jsonl:11"):
        routing_report.main([str(d), "--out", str(tmp_path / "y.png")])


def test_flags_and_install_noop():
    p = add_arguments(argparse.ArgumentParser())
    a = p.parse_args(["--moe-balance-policy", "proprophet", "--moe-balance-alpha", "0.5", "--moe-balance-n", "1",
                      "--moe-balance-interval", "2", "--moe-balance-overlap", "--moe-balance-profile", "x.json",
                      "--moe-routing-trace-dir", "t"])
    assert (a.moe_balance_policy, a.moe_balance_alpha, a.moe_balance_n, a.moe_balance_interval,
            a.moe_balance_overlap, a.moe_balance_profile, a.moe_routing_trace_dir) == \
        ("proprophet", 0.5, 1, 2, True, "x.json", "t")
    with pytest.raises(SystemExit):
        p.parse_args(["--moe-balance-policy", "bogus"])
    spec = object()
    assert install(p.parse_args([]), spec) is spec        # policy none: the stock layer stays
    bad = p.parse_args(["--moe-balance-interval", "0"])
    with pytest.raises(ValueError, match="--moe-balance-interval"):
        install(bad, spec)


def test_stats_predictor_and_checkpoint():
    s = RoutingStats(history=2, predictor="ema", beta=0.5)
    s.add(1, 0, [[2, 0], [0, 2]])
    s.add(1, 1, [[4, 0], [0, 0]])
    assert np.allclose(s.predict(1), [[3, 0], [0, 1]]) and np.allclose(s.last(1), [[4, 0], [0, 0]])
    s.add(1, 2, [[0, 0], [0, 0]])
    assert len(s.history[1]) == 2
    t = RoutingStats(history=2, predictor="ema", beta=0.5)
    t.load_state_dict(json.loads(json.dumps(s.state_dict())))
    assert np.allclose(t.predict(1), s.predict(1)) and [i for i, _ in t.history[1]] == [1, 2]
    f = imbalance(np.array(GOLD), Placement.from_plan([(0, [])], 4, 4))
    assert f["balance_before"] == pytest.approx(2308.56, abs=0.01)
    assert f["balance_after"] == pytest.approx(1182.14, abs=0.01)


def test_customize_spec_swaps_moe_layers_in_block_spec():
    from types import SimpleNamespace

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from megatron_moe import balance, features
    from megatron_moe.balance import customize_spec

    def validate_args(args):   # the feature's checks and declared exclusions, as the parser runs them
        features.validate_args(args, features=(balance,))
    from megatron_moe.balance.layer import ReplicaPlacement
    from megatron_moe.compat import replace_spec, spec_module, spec_params  # ModuleSpec or partial
    from megatron_moe.moe.layer import MoELayer as OurMoELayer

    a = add_arguments(argparse.ArgumentParser()).parse_args(["--moe-balance-policy", "proprophet"])
    a.num_experts = 4
    block = SimpleNamespace(layer_specs=[get_gpt_layer_local_spec(num_experts=4), get_gpt_layer_local_spec()])
    dense_mlp = spec_module(block.layer_specs[1].submodules.mlp)
    customize_spec(a, block)
    assert spec_module(block.layer_specs[0].submodules.mlp) is OurMoELayer
    assert isinstance(spec_params(block.layer_specs[0].submodules.mlp)["placement"], ReplicaPlacement)
    assert spec_module(block.layer_specs[1].submodules.mlp) is dense_mlp
    a.moe_grouped_gemm = True    # TE's grouped experts are refused; the local ones run replicas
    a.transformer_impl = "transformer_engine"
    with pytest.raises(ValueError, match="--moe-grouped-gemm"):
        validate_args(a)
    a.transformer_impl = "local"
    validate_args(a)
    class Other(MoELayer):
        pass
    a.moe_grouped_gemm = False
    spec = get_gpt_layer_local_spec(num_experts=4)
    spec.submodules.mlp = replace_spec(spec.submodules.mlp, module=Other)
    with pytest.raises(ValueError, match="already customised"):
        customize_spec(a, spec)
    # args built without the balance flags: defaults apply, nothing is swapped
    bare = argparse.Namespace(num_experts=4)
    s = get_gpt_layer_local_spec(num_experts=4)
    assert spec_module(customize_spec(bare, s).submodules.mlp) is MoELayer


def test_calibration_compute_part_feeds_the_cost_model(tmp_path):
    from megatron_moe.balance.cost_model import CostModel
    from tools.calibrate_balance import measure_compute

    prof = measure_compute(16, 32, 64, 16, reps=1)
    assert prof["throughput"] > 0 and prof["t_fnec"] > 0 and prof["t_bnec"] >= 0
    prof.update(a2a_bandwidth=[[65536, 1e8], [None, 1e9]], input_bytes=64, expert_bytes=4096,
                meta={"host": "test"})
    path = tmp_path / "p.json"
    path.write_text(json.dumps(prof))
    cm = CostModel.from_profile(str(path))
    assert cm.bandwidth(1000) == 1e8 and cm.bandwidth(1 << 20) == 1e9 and cm.t_fnec == prof["t_fnec"]


def test_calibrated_bandwidth_table_is_monotone():
    """A best-of-N point-to-point time disturbed by other processes must not price one message size
    (the 1 MB row: one expert's Trans) below the smaller and larger ones."""
    from tools.calibrate_balance import monotone_table

    noisy = [[1 << 14, 2.5e8], [1 << 18, 2.0e9], [1 << 20, 5.2e8], [1 << 22, 2.3e9]]
    assert monotone_table(noisy) == [[1 << 14, 2.5e8], [1 << 18, 2.0e9], [1 << 20, 2.0e9], [1 << 22, 2.3e9]]
    assert monotone_table(noisy[:2]) == noisy[:2]


def test_routing_report_follows_flexmoe_vexperts(tmp_path):
    """With a trace row's vexperts, the 'after' load is FlexMoE's router split, not locality."""
    from tools import routing_report

    d = tmp_path / "trace"
    d.mkdir()
    # rank 0 sends all 200 inputs to expert 0; expert 0 has one vExpert slot on each rank
    row = {"iteration": 1, "layer": 1, "counts": [[200, 0], [0, 0]], "placement": [[0, []]]}
    (d / "counts_rank00000.jsonl").write_text(json.dumps(dict(row, vexperts=[[1, 1], [0, 1]])) + "\n")
    flex = routing_report.main([str(d), "--out", str(tmp_path / "f.png")])
    assert "rank max/mean 2.000 -> 1.000" in flex[0], flex
    (d / "counts_rank00000.jsonl").write_text(json.dumps(row) + "\n")   # Pro-Prophet locality rule
    local = routing_report.main([str(d), "--out", str(tmp_path / "l.png")])
    assert "rank max/mean 2.000 -> 2.000" in local[0], local
