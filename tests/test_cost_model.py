"""One cost model: megatron_moe/balance/cost_model.py is imported by planners, policies, scheduler and
simulator; the training side never imports the simulator; calibration writes what everything reads."""

import ast
import json
import pathlib

import numpy as np
import pytest

from megatron_moe.balance.cost_model import CostModel, PlannerCost, as_planner_cost, save_profile

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _imports(path: pathlib.Path, source=None):
    """Every module name imported by ``path`` (top-level and function-local, absolute and relative)."""
    tree = ast.parse(path.read_text() if source is None else source, filename=str(path))
    pkg = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield node.lineno, a.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = pkg.split(".")
                parts = parts[: len(parts) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            yield node.lineno, base
            for a in node.names:               # "from megatron_moe import sim"
                yield node.lineno, f"{base}.{a.name}"


def test_balance_never_imports_the_simulator():
    files = sorted((ROOT / "megatron_moe" / "balance").rglob("*.py"))
    assert len(files) >= 8, files                  # the walk found the package
    bad = [f"{f.relative_to(ROOT)}:{ln}: {mod}" for f in files for ln, mod in _imports(f)
           if mod == "megatron_moe.sim" or mod.startswith("megatron_moe.sim.")]
    assert not bad, "training code imports the simulator:\n" + "\n".join(bad)


def test_the_checker_sees_a_simulator_import():
    """Mutation control: the same walk flags a relative and a function-local import of sim."""
    fake = ROOT / "megatron_moe" / "balance" / "policies" / "probe.py"
    src = "def f():\n    from ...sim import runner\n    from megatron_moe import sim\n"
    mods = [m for _, m in _imports(fake, src)]
    assert "megatron_moe.sim" in mods and "megatron_moe.sim.runner" in mods


def test_one_module_everyone_imports():
    """The simulator and the policies use the same classes (no second cost module)."""
    from megatron_moe.balance.policies import fastermoe, flexmoe, proprophet
    from megatron_moe.sim import cluster, runner

    assert not (ROOT / "megatron_moe" / "sim" / "costs.py").exists()
    assert fastermoe.as_planner_cost is as_planner_cost and flexmoe.as_planner_cost is as_planner_cost
    assert proprophet.CostModel is CostModel
    cl = cluster.load_cluster(4)
    assert isinstance(cl.planner_cost(np.arange(4)), PlannerCost)
    assert isinstance(cl.cost_model(np.arange(4)), CostModel)
    assert runner.simulate.__module__ == "megatron_moe.sim.runner"


def test_calibration_writes_what_everything_reads(tmp_path):
    prof = {"a2a_bandwidth": [[65536, 1e9], [None, 4e9]], "trans_bandwidth": 2e9, "throughput": 5e5,
            "input_bytes": 512, "expert_bytes": 2 * 128 * 512 * 4, "t_fnec": 1e-3, "t_bnec": 2e-3,
            "a2a_latency": 2e-4, "trans_latency": 3e-5, "trans_ring": False, "meta": {"source": "test"}}
    path = tmp_path / "p.json"
    save_profile(str(path), prof)
    cm = CostModel.from_profile(str(path))
    assert cm.to_dict() == {k: v for k, v in prof.items() if k != "meta"}
    # the policies' pricing and the simulator's cluster come from the same file
    pc = cm.planner_cost(4)
    assert pc.fwd_s_per_input == pytest.approx(1 / 5e5)
    assert pc.param_collective_s == pytest.approx(cm.t_trans(1, 0, 4))
    assert pc.param_collective_s == pytest.approx(cm.expert_bytes / 2e9 + 3 * 3e-5)   # 3 hops
    assert pc.lat == 3e-5
    assert pc.a2a_lat_s == pytest.approx(3 * 2e-4)        # one round: one message per peer
    from megatron_moe.sim.cluster import load_cluster
    cl = load_cluster(4, profile=str(path))
    assert cl.cost_model(np.arange(4)).throughput == pytest.approx(5e5)
    # a profile training would refuse is never written
    with pytest.raises(ValueError, match="unknown keys"):
        save_profile(str(tmp_path / "bad.json"), dict(prof, typo=1))
    with pytest.raises(ValueError, match="throughput"):
        save_profile(str(tmp_path / "bad.json"), dict(prof, throughput=0))
    assert not (tmp_path / "bad.json").exists()
    assert json.loads(path.read_text())["meta"] == {"source": "test"}


def test_an_all_to_all_that_crosses_no_rank_is_priced_zero():
    """The runtime skips an all-to-all whose EP-group matrix has no off-diagonal traffic
    (balance/layer.py), so the one cost model prices it at zero, latency included; any crossing
    input pays the bandwidth and the per-peer latency of all 4 rounds."""
    from megatron_moe.balance.cost_model import a2a_crosses, rank_time_s
    from megatron_moe.balance.layer import crosses_ranks
    from megatron_moe.balance.policies.auto import AutoPolicy
    from megatron_moe.balance.policies.base import Placement

    cm = CostModel.from_dict({"throughput": 1e5, "input_bytes": 512, "a2a_latency": 3e-4})
    pc = cm.planner_cost(2)
    processed = np.array([1000.0, 1000.0])
    local = np.array([[600.0, 0.0], [0.0, 400.0]])          # diagonal only: nothing crosses
    crossing = np.array([[600.0, 1.0], [0.0, 400.0]])       # one input crosses
    assert not a2a_crosses(local) and a2a_crosses(crossing)
    assert list(a2a_crosses(np.stack([local, crossing]))) == [False, True]
    np.testing.assert_allclose(rank_time_s(pc, processed, local), pc.compute_s(processed))
    extra = rank_time_s(pc, processed, crossing) - pc.compute_s(processed)
    assert extra == pytest.approx(4 * (pc.pair_s_per_input[0, 1] + 3e-4))
    # the runtime's rule is this rule: send[e, src, dst] summed over experts
    send = np.zeros((2, 2, 2))
    send[0] = local
    assert not crosses_ranks(send)
    send[1, 0, 1] = 1
    assert crosses_ranks(send)
    # auto's price: every hot expert replicated where its inputs are (Pro-Prophet at skew) runs no
    # all-to-all; moving one expert away (FlexMoE's placement) pays the latency of all 4 rounds
    counts = np.array([[512.0, 512.0, 0, 0], [512.0, 512.0, 0, 0]])
    auto = AutoPolicy(4, 2, cost=cm, persistent=False)
    everywhere = Placement([[0, 1], [0, 1], [1], [1]], 2)
    base, fec = auto._ranks(counts, everywhere)
    np.testing.assert_allclose(base, 3 * fec)
    moved = Placement([[0], [0, 1], [1], [1]], 2, vexperts=[[4, 0], [0, 2], [0, 1], [0, 1]])
    base, fec = auto._ranks(counts, moved)
    assert base.max() - 3 * fec.max() >= 4 * 3e-4
