"""BERT-MoE pretraining end to end on gloo (2 ranks, EP=2): loss falls, exact resume, and resume
across embedding partitionings (hidden -> vocab), on a sentence-level indexed corpus.

The tokenizer is a toy WordPiece vocabulary (tests/_bert_cases.py) so this test does not depend on
a vocab file; the corpus is written with megatron-core's IndexedDatasetBuilder one sentence per
sequence, exactly the layout ``tools/preprocess_data.py --split-sentences`` produces.
"""

import os

import pytest

from megatron_moe.testing import run_distributed
from tests._bert_cases import run_pretrain_bert, write_sentence_corpus

TINY = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32 "
        "--micro-batch-size 2 --global-batch-size 8 --lr 1e-2 --lr-decay-style constant "
        "--split 98,1,1 --num-experts 4 --moe-router-topk 2 --moe-token-dispatcher-type alltoall "
        "--moe-aux-loss-coeff 0.01 --log-interval 1 --eval-interval 1000 --eval-iters 1 "
        "--expert-model-parallel-size 2 --train-iters 6").split()
HIDDEN = "--embedding-partition hidden --untie-embeddings-and-output-weights".split()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    prefix = str(tmp_path_factory.mktemp("bert") / "corpus_text_sentence")
    write_sentence_corpus(prefix)
    return prefix


def train(corpus, extra):
    argv = TINY + ["--data-path", corpus] + extra
    return run_distributed(run_pretrain_bert, 2, argv, timeout_s=300)[0]


def test_bert_moe_loss_falls_resumes_exactly_and_across_partitionings(corpus, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    # hidden-partitioned embedding (EP group = DP group: no embedding all-reduce), binary head on
    full = train(corpus, HIDDEN)
    losses = full["lm_loss"]
    assert all(l == l for l in losses), losses
    assert sum(losses[-2:]) / 2 < sum(losses[:2]) / 2 - 0.3, losses

    first = train(corpus, HIDDEN + ["--save", ckpt, "--exit-interval", "3"])
    assert open(os.path.join(ckpt, "latest_checkpointed_iteration.txt")).read() == "3"
    second = train(corpus, HIDDEN + ["--load", ckpt])
    assert second["iteration"][0] == 4
    # bit-identical continuation (dropout on: RNG, data position and optimizer restored)
    assert first["lm_loss"] + second["lm_loss"] == full["lm_loss"]
    assert first["grad_norm"] + second["grad_norm"] == full["grad_norm"]

    # the hidden checkpoint holds the full logical table: a vocab-parallel run resumes from it
    # (weights, Adam state and RNG): the same run continues, up to float summation order
    other = train(corpus, ["--untie-embeddings-and-output-weights", "--load", ckpt,
                           "--embedding-partition", "vocab"])
    assert other["iteration"] == [4, 5, 6]
    assert other["lm_loss"] == pytest.approx(full["lm_loss"][3:], rel=1e-4)
    assert other["grad_norm"] == pytest.approx(full["grad_norm"][3:], rel=1e-4)
