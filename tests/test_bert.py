"""BERT-MoE end to end on gloo: the sentence-level data path and pretraining.

* ``tools/preprocess_data.py --split-sentences`` round trip (one sequence per sentence, documents
  kept) with the real BertWordPieceLowerCase tokenizer and a local vocab file;
* megatron-core's BERT dataset over it: [CLS] A [SEP] B [SEP] framing, 15% masking (80/10/10),
  sentence-order swaps only with the binary head;
* pretrain_bert_moe on 2 ranks with EP=2: the loss falls, a resume is bit-identical, and a
  checkpoint written with the hidden-partitioned embedding resumes under the vocab-parallel one.
"""

import os

import numpy as np
import pytest

from megatron_moe.runtime.local_ranks import run_distributed
from tests._bert_cases import masking_stats, preprocess, run_pretrain_bert

TINY = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32 "
        "--micro-batch-size 2 --global-batch-size 8 --lr 1e-2 --lr-decay-style constant "
        "--split 98,1,1 --num-experts 4 --moe-router-topk 2 --moe-token-dispatcher-type alltoall "
        "--moe-aux-loss-coeff 0.01 --log-interval 1 --eval-interval 1000 --eval-iters 1 "
        "--expert-model-parallel-size 2 --train-iters 6 "
        "--tokenizer-type BertWordPieceLowerCase").split()
HIDDEN = "--embedding-partition hidden --untie-embeddings-and-output-weights".split()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return preprocess(str(tmp_path_factory.mktemp("bert")))


# --- data ----------------------------------------------------------------------------------------
def test_sentence_level_preprocessing_round_trip(corpus):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    from megatron_moe.data.tokenizers import build_tokenizer

    prefix, vocab, docs = corpus
    tok = build_tokenizer(tokenizer_type="BertWordPieceLowerCase", vocab_file=vocab)
    ds = IndexedDataset(prefix)
    bounds = ds.document_indices
    assert len(bounds) - 1 == len(docs)  # one document per input line
    for d, sentences in enumerate(docs):
        seqs = [ds[i].tolist() for i in range(bounds[d], bounds[d + 1])]
        # one sequence per sentence, each exactly the tokenizer's ids for that sentence
        assert seqs == [tok.tokenize(s) for s in sentences], d
    assert tok.vocab["[UNK]"] not in np.concatenate([ds[i] for i in range(len(ds))])
    # "cats" and "quickly" went through WordPiece continuation pieces
    assert tok.tokenize("cats quickly") == [tok.vocab["cat"], tok.vocab["##s"],
                                            tok.vocab["quick"], tok.vocab["##ly"]]


@pytest.fixture(scope="module")
def stats(corpus):
    prefix, vocab, _ = corpus
    return run_distributed(masking_stats, 1, prefix, vocab, timeout_s=120)[0]


@pytest.mark.parametrize("binary_head", [True, False])
def test_bert_dataset_masks_like_bert(stats, binary_head):
    s = stats[binary_head]
    assert s["samples"] >= 400 and s["bad_frame"] == 0, s
    # --mask-prob 0.15 of the tokens ([CLS]/[SEP] count in the budget, as in megatron-core)
    assert 0.11 < s["masked"] / s["tokens"] < 0.19, s
    # 80% [MASK], 10% random, 10% unchanged
    assert 0.72 < s["as_mask"] / s["masked"] < 0.88, s
    # sentence-order prediction swaps A and B half of the time; never without the head
    if binary_head:
        assert 0.38 < s["swapped"] / s["samples"] < 0.62, s
    else:
        assert s["swapped"] == 0, s


# --- training ------------------------------------------------------------------------------------
def train(corpus, extra):
    prefix, vocab, _ = corpus
    argv = TINY + ["--data-path", prefix, "--vocab-file", vocab] + extra
    return run_distributed(run_pretrain_bert, 2, argv, timeout_s=300)[0]


def test_bert_moe_loss_falls_resumes_exactly_and_across_partitionings(corpus, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    # hidden-partitioned embedding (EP group = DP group: no embedding all-reduce), binary head on;
    # checkpoints at iterations 3 and 6
    full = train(corpus, HIDDEN + ["--save", ckpt, "--save-interval", "3"])
    losses = full["lm_loss"]
    assert all(l == l for l in losses), losses
    assert sum(losses[-2:]) / 2 < sum(losses[:2]) / 2 - 0.3, losses
    assert os.path.isdir(os.path.join(ckpt, "iter_0000003"))
    # resume from iteration 3 (the tracker names the checkpoint to load, as in Megatron)
    with open(os.path.join(ckpt, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("3")

    second = train(corpus, HIDDEN + ["--load", ckpt])
    assert second["iteration"] == [4, 5, 6]
    # bit-identical continuation (dropout on: RNG, data position and optimizer restored)
    assert second["lm_loss"] == full["lm_loss"][3:]
    assert second["grad_norm"] == full["grad_norm"][3:]

    # the hidden checkpoint holds the full logical table: a vocab-parallel run resumes from it
    # (weights, Adam state and RNG): the same run continues, up to float summation order
    other = train(corpus, ["--untie-embeddings-and-output-weights", "--load", ckpt,
                           "--embedding-partition", "vocab"])
    assert other["iteration"] == [4, 5, 6]
    assert other["lm_loss"] == pytest.approx(full["lm_loss"][3:], rel=1e-4)
    assert other["grad_norm"] == pytest.approx(full["grad_norm"][3:], rel=1e-4)


def test_per_token_loss_is_refused_for_bert():
    """BERT's loss_func reports the masked-LM mean, not Megatron's (sum, tokens) pair: the flag is
    refused at parse time in one line instead of logging a wrong value."""
    import argparse

    import pytest

    from megatron_moe.data.bert import validate_bert_args

    args = argparse.Namespace(mask_prob=0.15, short_seq_prob=0.1, mock_data=False, seq_length=32,
                              calculate_per_token_loss=True)
    with pytest.raises(ValueError, match="--calculate-per-token-loss"):
        validate_bert_args(args)
    args.calculate_per_token_loss = False
    validate_bert_args(args)
