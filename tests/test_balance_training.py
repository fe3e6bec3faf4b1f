"""The real training loop (megatron_moe.training.loop.pretrain, EP=2 gloo) with Pro-Prophet on: same loss
curve as plain EP, replicas actually used, routing trace written and readable by routing_report."""

import os

import pytest

from megatron_moe.runtime.local_ranks import run_distributed
from tests._train_cases import run_pretrain

TINY = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32 "
        "--micro-batch-size 2 --global-batch-size 8 --lr 3e-3 --mock-data "
        "--tokenizer-type NullTokenizer --vocab-size 256 --num-experts 4 --moe-router-topk 2 "
        "--moe-token-dispatcher-type alltoall --moe-aux-loss-coeff 0.0 --log-interval 1 "
        "--eval-interval 1000 --eval-iters 1 --disable-bias-linear --expert-model-parallel-size 2 "
        "--train-iters 3").split()


def test_training_loop_proprophet_matches_plain_ep(tmp_path):
    trace = str(tmp_path / "trace")
    base = run_distributed(run_pretrain, 2, TINY, timeout_s=300)[0]
    ours = run_distributed(run_pretrain, 2, TINY + [
        "--moe-balance-policy", "proprophet", "--moe-balance-alpha", "0", "--moe-balance-overlap",
        "--moe-routing-trace-dir", trace], timeout_s=300)[0]
    assert ours["lm_loss"] == pytest.approx(base["lm_loss"], rel=1e-4, abs=1e-5)
    from tools import routing_report

    lines = routing_report.main([trace, "--out", str(tmp_path / "r.png")])
    assert len(lines) == 2 and "(3)" in lines[0]
    # iterations after the first ran with a planned (replicating) placement
    assert any("replicated experts/iter 0.00" not in l for l in lines), lines
