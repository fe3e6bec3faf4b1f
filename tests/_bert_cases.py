"""BERT-MoE test helpers: a toy WordPiece tokenizer, a sentence-level corpus, pretrain() runs."""

from __future__ import annotations

import sys

import numpy as np

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
VOCAB = 96


class ToyWordPiece:
    """The attributes megatron-core's BERT dataset and Megatron's BERT tokenizers expose."""

    def __init__(self, size=VOCAB):
        # every third piece continues a word ("##"), so whole-word masking has work to do
        tokens = SPECIALS + [("##" if i % 3 == 2 else "") + f"w{i}" for i in range(size - 5)]
        self.vocab = {t: i for i, t in enumerate(tokens)}
        self.inv_vocab = {i: t for t, i in self.vocab.items()}
        self.vocab_size = len(tokens)
        self.pad, self.cls, self.sep, self.mask = 0, 2, 3, 4
        self.eod = self.sep
        self.unique_identifiers = {"class": "ToyWordPiece", "size": size}


def install_toy_tokenizer():
    import types

    mod = types.ModuleType("megatron_moe.data.tokenizers")
    mod.build_tokenizer = lambda args: ToyWordPiece()
    mod.vocab_size_with_padding = lambda v, d, tp: ((v + d * tp - 1) // (d * tp)) * d * tp
    sys.modules[mod.__name__] = mod


def write_sentence_corpus(prefix: str, documents: int = 80, seed: int = 0):
    """Sentence-level .bin/.idx (one sequence per sentence, documents end with end_document()).

    Every sentence is one of a few fixed templates, so masked tokens are predictable from their
    neighbours and the masked-LM loss falls within a few iterations.
    """
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    rng = np.random.RandomState(seed)
    templates = [torch.arange(s, s + n, dtype=torch.int32)
                 for s, n in ((5, 9), (20, 7), (40, 11), (60, 8), (75, 10), (10, 6))]
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.int32)
    for _ in range(documents):
        for _ in range(rng.randint(3, 7)):
            builder.add_item(templates[rng.randint(len(templates))])
        builder.end_document()
    builder.finalize(prefix + ".idx")


def run_pretrain_bert(rank, world_size, argv):
    install_toy_tokenizer()
    import pretrain_bert_moe

    result = pretrain_bert_moe.main(argv)
    return result["history"]
