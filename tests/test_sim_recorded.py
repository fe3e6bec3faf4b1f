"""The simulator replays a routing trace written by real 2-rank training (--moe-routing-trace-dir)."""

import numpy as np

from megatron_moe.sim.cluster import load_cluster
from megatron_moe.sim.runner import compare
from megatron_moe.sim.traces import load_trace_dir
from megatron_moe.runtime.local_ranks import run_distributed
from tests import _policy_cases


def test_replay_recorded_trace(tmp_path):
    d = str(tmp_path / "trace")
    out = run_distributed(_policy_cases.record_trace_rank, 2, d, 3, timeout_s=240)
    n_layers = out[0]
    tr = load_trace_dir(d)
    assert tr.shape[:3] == (3, n_layers, 2) and tr.shape[3] == 4
    # every token of the micro-batch is routed top-2 from each rank
    assert (tr.sum(axis=3) == 2 * 2 * 8).all()
    rows = compare(tr, load_cluster(2), ["fastermoe", "flexmoe"], ["flat"])
    for r in rows.values():
        assert np.isfinite(r["iter_s"]) and r["iter_s"] > 0
    # replayed at scale: the 2 recorded source rows tiled over 8 ranks = 2 EP groups of 4 (E = 4)
    big = compare(tr, load_cluster(8), ["fastermoe"], ["flat"])
    assert big[("flat", "none")]["iter_s"] > 0
