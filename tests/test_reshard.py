"""Resharding on 4 CPU ranks: a checkpoint saved in one layout, loaded into another.

Check: a tiny GPT-MoE (no dropout, constant LR) trains 3 iterations in layout A (TP1 PP1 EP2,
DP4), saving after each. Another layout loads iteration 1 (--ckpt-step 1) and trains iterations
2-3. Iteration 2's loss uses the loaded weights and the same global batch, so it equals A's
iteration-2 loss up to summation order (rel 1e-6: fp32, other reduction orders); iteration 3
also uses the loaded Adam state, so equal again means the optimizer carried over.

Covered: TP1->TP2 (the trained vocabulary padding is kept), PP1->PP2, EP2->EP4, EP4->EP2 (from
the EP4 run's own checkpoint) and a DP change (DP4 -> DP2, world 4 -> 2), each with the chained
optimizer and with --use-distributed-optimizer (fully reshardable format; without Transformer
Engine or apex its torch-Adam fallback is bridged by compat/distrib_optimizer.py), weights and
Adam state both. Every save is also checked to be quiet (no "common state dict differs" warning)
in each of these layouts.
"""

import os

import pytest

from megatron_moe.runtime.local_ranks import run_distributed
from tests._ckpt_cases import TINY, run_pretrain_capture, run_pretrain_sequence, differs

BASE = TINY + ["--train-iters", "3", "--hidden-dropout", "0", "--attention-dropout", "0",
               "--lr-decay-style", "constant"]
A = ["--expert-model-parallel-size", "2"]
TARGETS = {
    "tp1->tp2": "--tensor-model-parallel-size 2 --sequence-parallel --expert-model-parallel-size 2",
    "pp1->pp2": "--pipeline-model-parallel-size 2 --expert-model-parallel-size 2",
    "ep2->ep4": "--expert-model-parallel-size 4",
}
REL = 1e-6

_SOURCES = {}


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """Layout A's run and checkpoints, once per optimizer kind (shared by the tests below)."""
    def get(distopt):
        if distopt not in _SOURCES:
            ckpt = str(tmp_path_factory.mktemp("src") / "a")
            extra = ["--use-distributed-optimizer"] if distopt else []
            out = run_distributed(run_pretrain_capture, 4, BASE + A + extra + [
                "--save", ckpt, "--save-interval", "1"], timeout_s=400)
            for _, warnings, saves in out:
                assert saves == [1, 2, 3] and differs(warnings) == []
            _SOURCES[distopt] = ckpt, out[0][0]
        return _SOURCES[distopt]
    return get


def _check(history, ref):
    assert history["iteration"] == [2, 3]
    assert history["lm_loss"][0] == pytest.approx(ref["lm_loss"][1], rel=REL)
    assert history["lm_loss"][1] == pytest.approx(ref["lm_loss"][2], rel=REL)  # Adam carried


@pytest.mark.parametrize("distopt", [False, True], ids=["chained-optimizer", "distributed-optimizer"])
def test_reshard_tp_pp_ep(sources, tmp_path, distopt):
    src, ref = sources(distopt)
    extra = ["--use-distributed-optimizer"] if distopt else []
    ep4 = str(tmp_path / "ep4")
    runs = [BASE + TARGETS[name].split() + extra + ["--load", src, "--ckpt-step", "1"]
            for name in TARGETS]
    runs[-1] += ["--save", ep4, "--save-interval", "1"]
    # EP4 -> EP2: the EP4 run's own iteration-2 checkpoint back into layout A
    runs.append(BASE + A + extra + ["--load", ep4, "--ckpt-step", "2"])
    histories = run_distributed(run_pretrain_sequence, 4, runs, timeout_s=600)[0]
    for name, history in zip(TARGETS, histories):
        _check(history, ref)
    back = histories[-1]
    assert back["iteration"] == [3]
    assert back["lm_loss"][0] == pytest.approx(histories[2]["lm_loss"][1], rel=REL)


@pytest.mark.parametrize("distopt", [False, True], ids=["chained-optimizer", "distributed-optimizer"])
def test_reshard_dp4_to_dp2(sources, distopt):
    src, ref = sources(distopt)
    extra = ["--use-distributed-optimizer"] if distopt else []
    out = run_distributed(run_pretrain_capture, 2, BASE + A + extra + [
        "--load", src, "--ckpt-step", "1"], timeout_s=400)
    _check(out[0][0], ref)
