"""megatron_moe.runtime.topology: where ranks-per-node comes from, the topology file, group layouts."""

import json

import pytest

from megatron_moe.runtime import topology
from megatron_moe.runtime.topology import Topology, members_per_node


@pytest.fixture(autouse=True)
def _reset(monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    topology.reset()
    yield
    topology.reset()


def test_precedence_flag_over_file_over_env(tmp_path, monkeypatch):
    assert topology.configure().ranks_per_node == 1  # nothing given: one node
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert topology.configure().ranks_per_node == 8
    f = tmp_path / "topo.json"
    f.write_text(json.dumps({"ranks_per_node": 4, "inter_bandwidth_gbps": 12.5}))
    t = topology.configure(topology_file=str(f))
    assert (t.ranks_per_node, t.inter_bandwidth_gbps) == (4, 12.5)
    t = topology.configure(ranks_per_node=2, topology_file=str(f))
    assert t.ranks_per_node == 2 and t.inter_bandwidth_gbps == 12.5  # flag overrides only rpn
    assert topology.current() is t


def test_link_cost_and_bandwidth_ratio():
    t = Topology(ranks_per_node=2, intra_bandwidth_gbps=100.0, inter_bandwidth_gbps=25.0)
    assert t.link_cost(0, 0) == 0.0
    assert t.link_cost(0, 1) == pytest.approx(1 / 100e9)
    assert t.link_cost(1, 2) == pytest.approx(1 / 25e9)
    assert t.bandwidth_ratio == 0.25
    assert [t.node_of(r) for r in range(6)] == [0, 0, 1, 1, 2, 2]
    assert t.num_nodes(6) == 3
    with pytest.raises(ValueError, match="--ranks-per-node=2 must divide"):
        t.num_nodes(5)


@pytest.mark.parametrize("content,match", [
    ("{not json", "line 1: invalid JSON"),
    ("[1, 2]", "expected a JSON object"),
    ('{"ranks_per_node": 2, "bogus": 1}', r"unknown keys \['bogus'\]"),
    ('{"ranks_per_node": "two"}', "must be a number"),
    ('{"ranks_per_node": 0}', "must be >= 1"),
    ('{"inter_bandwidth_gbps": 0}', "must be > 0"),
])
def test_bad_topology_file_names_file_and_key(tmp_path, content, match):
    f = tmp_path / "t.json"
    f.write_text(content)
    with pytest.raises(ValueError, match=match) as e:
        topology.load_topology_file(str(f))
    assert str(f) in str(e.value)


def test_missing_topology_file():
    with pytest.raises(ValueError, match="--topology-file /nonexistent.json: cannot read"):
        topology.load_topology_file("/nonexistent.json")


def test_members_per_node_of_megatron_groups():
    t = Topology(ranks_per_node=4)
    assert members_per_node(range(8), t) == 4          # whole world, 2 nodes
    assert members_per_node([0, 2, 4, 6], t) == 2      # EP group with TP=2: strided
    assert members_per_node([0, 4], t) == 1            # one rank per node
    assert members_per_node([4, 5, 6, 7], t) == 4      # a group inside one node
    with pytest.raises(ValueError, match="not node-major"):
        members_per_node([0, 4, 1, 5], t)              # interleaves nodes
    with pytest.raises(ValueError, match="not node-major"):
        members_per_node([0, 1, 2, 4], t)              # 3 members on one node, 1 on the other


def test_cli_rejects_ranks_per_node_not_dividing_world():
    import subprocess
    import sys

    from tests.test_training import ROOT, TINY

    cmd = [sys.executable, "pretrain_gpt_moe.py", *TINY, "--train-iters", "1",
           "--ranks-per-node", "3"]
    env = {**__import__("os").environ, "WORLD_SIZE": "4"}
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)
    assert p.returncode == 2 and "--ranks-per-node=3 must divide the world size 4" in p.stderr, \
        p.stderr[-2000:]
