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
            "meta": {"source": "test"}}
    path = tmp_path / "p.json"
    save_profile(str(path), prof)
    cm = CostModel.from_profile(str(path))
    assert cm.to_dict() == {k: v for k, v in prof.items() if k != "meta"}
    # the policies' pricing and the simulator's cluster come from the same file
    pc = cm.planner_cost(4)
    assert pc.fwd_s_per_input == pytest.approx(1 / 5e5)
    assert pc.param_collective_s == pytest.approx(cm.t_trans(1, 0, 4))
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
