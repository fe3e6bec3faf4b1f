"""BERT-MoE test helpers: a WordPiece vocab, a JSONL corpus, the real preprocessing tool, and
pretrain()/dataset rank functions (spawned by run_distributed)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

WORDS = ["the", "a", "cat", "dog", "sat", "ran", "on", "under", "mat", "table", "big", "small",
         "quick", "and", "then", "it", "was", "happy", "red", "blue", "bird", "sang", "tree",
         ".", ",", "##s", "##ly", "##ed"]
# Every sentence is one of a few templates, so a masked word is predictable from its neighbours
# and the masked-LM loss falls within a few iterations. "cats", "quickly", "sanged" need "##".
TEMPLATES = ["The cat sat on the mat.", "A big dog ran under the table.", "Then it was happy.",
             "The small cats sat quickly.", "A red bird sang, then a blue bird sang.",
             "The dog was on the table.", "It ran under the big tree."]


def write_vocab(path: str) -> str:
    with open(path, "w") as f:
        f.write("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + WORDS) + "\n")
    return path


def write_corpus(path: str, documents: int = 80, seed: int = 0) -> list[list[str]]:
    """JSONL, one document per line (3-6 sentences); returns the documents' sentences."""
    rng = np.random.RandomState(seed)
    docs = []
    with open(path, "w") as f:
        for _ in range(documents):
            sentences = [TEMPLATES[rng.randint(len(TEMPLATES))] for _ in range(rng.randint(3, 7))]
            docs.append(sentences)
            f.write(json.dumps({"text": " ".join(sentences)}) + "\n")
    return docs


def preprocess(workdir: str):
    """vocab + corpus -> tools/preprocess_data.py --split-sentences; (prefix, vocab, documents)."""
    vocab = write_vocab(os.path.join(workdir, "vocab.txt"))
    docs = write_corpus(os.path.join(workdir, "corpus.jsonl"))
    out = os.path.join(workdir, "corpus")
    subprocess.run([sys.executable, os.path.join(ROOT, "tools", "preprocess_data.py"),
                    "--input", os.path.join(workdir, "corpus.jsonl"), "--output-prefix", out,
                    "--tokenizer-type", "BertWordPieceLowerCase", "--vocab-file", vocab,
                    "--split-sentences", "--workers", "1", "--no-progress"],
                   check=True, capture_output=True, text=True, timeout=120)
    return out + "_text_sentence", vocab, docs


def run_pretrain_bert(rank, world_size, argv):
    import pretrain_bert_moe

    return pretrain_bert_moe.main(argv)["history"]


def masking_stats(rank, world_size, prefix, vocab):
    """Build the BERT train split with the real tokenizer, with and without the binary head, and
    measure what the dataset emits."""
    return {head: _masking_stats(prefix, vocab, head) for head in (True, False)}


def _masking_stats(prefix, vocab, binary_head):
    import argparse

    from megatron_moe.data.bert import build_bert_datasets
    from megatron_moe.data.tokenizers import build_tokenizer

    tok = build_tokenizer(tokenizer_type="BertWordPieceLowerCase", vocab_file=vocab)
    args = argparse.Namespace(
        seed=1234, seq_length=32, data_path=[prefix], train_data_path=None, valid_data_path=None,
        test_data_path=None, split="98,1,1", data_cache_path=None, mask_prob=0.15,
        short_seq_prob=0.1, bert_binary_head=binary_head)
    train, _, _ = build_bert_datasets(args, tok, [400, 0, 0])
    tokens = masked = as_mask = swapped = bad_frame = 0
    for i in range(len(train)):
        s = train[i]
        text, loss_mask, labels = s["text"], s["loss_mask"], s["labels"]
        # sequence length: up to the last non-pad position (a random replacement may itself be
        # [PAD]/[SEP]/[CLS]: megatron-core draws it from the whole vocabulary)
        n = int(np.flatnonzero(s["padding_mask"])[-1]) + 1
        pos = np.flatnonzero(loss_mask)
        kept = np.setdiff1d(np.arange(n), pos)
        seps = np.flatnonzero(text[kept] == tok.sep)
        bad_frame += int(text[0] != tok.cls or text[n - 1] != tok.sep or len(seps) not in (1, 2))
        tokens += n
        masked += len(pos)
        as_mask += int((text[pos] == tok.mask).sum())
        bad_frame += int((labels[pos] < 0).any() or (labels[pos] == tok.mask).any()
                         or (text[kept] == tok.mask).any())
        swapped += int(s["is_random"])
    return dict(samples=len(train), tokens=tokens, masked=masked,
                as_mask=as_mask, swapped=swapped, bad_frame=bad_frame)
