"""Smoke test of bench/imbalance_training.py on a tiny model: one run, configs interleaved, and the
figures issue 21 item 6 asks for (x stock and the share of the stock -> forced gap, wall and
critical-path CPU, best policy against the bar). Asserts on what the bench computes, never on
timings."""

import json
import math
import re

import pytest

from bench import imbalance_training as bench
from megatron_moe.balance.cost_model import CostModel


def test_short_run(tmp_path, capsys):
    prof = tmp_path / "profile.json"
    prof.write_text(json.dumps(CostModel.from_profile(None).to_dict()))
    res = bench.main(["--iters", "1", "--warmup", "1", "--layers", "1", "--hidden", "32", "--ffn", "64",
                      "--seq", "16", "--mbs", "2", "--skews", "3", "--configs", "stock,fastermoe,proprophet,forced",
                      "--profile", str(prof), "--json", str(tmp_path / "r.json")])
    out = capsys.readouterr().out
    r = res[3.0]
    for label in ("wall", "critical-CPU"):
        assert r[label]["x_stock"]["stock"] == 1.0
        assert set(r[label]["x_stock"]) == {"stock", "fastermoe", "proprophet", "forced"}
        assert set(r[label]["gap_share"]) == {"fastermoe", "proprophet"}
        assert f"[{label}] over FasterMoE (median of 1 runs, ratios within each run): proprophet x" in out
        assert all(v > 0 and math.isfinite(v) for v in r[label]["tokens_per_s"].values())
        assert re.search(rf"\[{label}\] best policy (fastermoe|proprophet): x", out), out
    assert len(r["runs"]) == 1 and "host load average" in out
    assert "proprophet" in json.loads((tmp_path / "r.json").read_text())["3.0"]["wall"]["x_stock"]


def test_ranks_must_divide_experts(capsys):
    """EP = --ranks: an expert count it does not divide is refused naming both flags, before the
    calibration (no --profile given)."""
    with pytest.raises(SystemExit):
        bench.main(["--ranks", "4", "--experts", "6"])
    cap = capsys.readouterr()
    assert "--experts 6 must be a multiple of --ranks 4" in cap.err and "calibrated profile" not in cap.out


def test_link_run_puts_every_config_on_the_link(tmp_path, capsys):
    """--link-gbps: megatron-core's dispatcher (stock) and our layer (Trans/Agg) both pay the
    emulated link, and the bench reports each config's link time; the busy time is the bytes over
    the link's rate (no timing asserted)."""
    prof = tmp_path / "profile.json"
    prof.write_text(json.dumps(CostModel.from_profile(None).to_dict()))
    res = bench.main(["--iters", "1", "--warmup", "1", "--layers", "1", "--hidden", "32", "--ffn", "64",
                      "--seq", "16", "--mbs", "2", "--skews", "3", "--configs", "stock,fastermoe,proprophet+overlap",
                      "--profile", str(prof), "--link-gbps", "0.5"])
    out = capsys.readouterr().out
    link = res[3.0]["runs"][0]["link"]
    assert link["stock"]["a2a_bytes"] > 0 and link["stock"]["p2p_bytes"] == 0
    assert link["fastermoe"]["p2p_bytes"] > 0 and link["proprophet+overlap"]["p2p_bytes"] > 0
    for n, v in link.items():
        assert v["busy_s"] == pytest.approx((v["a2a_bytes"] + v["p2p_bytes"]) / 0.5e9), n
    assert "emulated link 0.5 GB/s" in out and re.search(r"proprophet\+overlap:\s+[\d.]+\s+[\d.]+\n", out)


def test_link_rate_refused():
    with pytest.raises(SystemExit):
        bench.main(["--link-gbps", "0"])
