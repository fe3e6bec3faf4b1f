"""Smoke test of bench/policies.py: calibration -> real 2-rank training per policy -> simulator
agreement -> simulator at scale, in one short run.

Asserts on what the bench computes, never on timings: the calibration profile is a valid
``--moe-balance-profile``, the skewed run really is skewed (recorded max/mean rank load 2.00) and
the balancing policies replicate under it, and the simulator
produced a finite prediction for every policy.
"""

import math

import numpy as np

from bench import policies as bench
from megatron_moe.balance.cost_model import CostModel
from megatron_moe.sim.traces import load_trace_dir


def test_short_run(tmp_path, capsys):
    res = bench.main(["--a-iters", "1", "--gpus", "8", "--iterations", "3", "--experts", "8",
                      "--algorithms", "flat", "--a-timeout", "400"])
    out = capsys.readouterr().out
    prof = res["profile"]
    cm = CostModel.from_dict({k: v for k, v in prof.items() if k != "meta"})
    assert cm.throughput > 0 and prof["meta"]["a2a_latency_s"] > 0
    # the planners' per-peer round latency comes from the same calibration as the table
    assert cm.a2a_latency == prof["meta"]["a2a_latency_s"]
    assert cm.planner_cost(2).a2a_lat_s == cm.a2a_latency

    skewed = res["measured"][True]
    trace = load_trace_dir(skewed["trace_dir"])          # [iterations, layers, src, experts]
    assert trace.shape[1:] == (2, 2, 4)
    per_rank = trace.reshape(-1, 2, 2, 2).sum(axis=(1, 3))  # inputs computed per owner rank
    assert np.allclose(per_rank.max(axis=1) / per_rank.mean(axis=1), 2.0)
    for pol in ("fastermoe", "proprophet"):   # replicating is worth 30x its cost at this skew
        assert skewed[pol]["replicated"] > 0
    assert set(res["errors"]) == {"none", "fastermoe", "flexmoe", "proprophet"}
    assert all(math.isfinite(e) for e in res["errors"].values())
    assert "stated tolerance 25%" in out and "speedup" in out


def test_link_run_adds_the_scheduler_and_folds_the_link(capsys):
    """--link-gbps: the profile's bandwidths carry the link (each at most the link's rate), the
    scheduler runs as a fifth policy and the simulator predicts it too; part (b) skipped."""
    res = bench.main(["--a-iters", "1", "--a-timeout", "400", "--link-gbps", "0.5", "--skip-b"])
    out = capsys.readouterr().out
    prof = res["profile"]
    assert prof["meta"]["ep_link_gbps"] == 0.5
    assert prof["trans_bandwidth"] < 0.5e9 and all(b < 0.5e9 for _, b in prof["a2a_bandwidth"])
    assert prof["t_fnec"] > 0 and prof["t_bnec"] > 0          # Eq. 8 / the Trans split read them
    assert res["measured"][True]["proprophet+overlap"]["replicated"] > 0
    assert set(res["errors"]) == {"none", "fastermoe", "flexmoe", "proprophet", "proprophet+overlap"}
    assert "emulated link 0.5 GB/s" in out and "speedup" not in out   # no part (b)
