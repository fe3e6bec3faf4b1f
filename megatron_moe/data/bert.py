"""BERT masked-LM datasets over megatron-core's sentence-level indexed datasets.

The .bin/.idx files must be sentence level (``tools/preprocess_data.py --split-sentences``): each
sequence is one sentence and documents group them; megatron-core's
``BERTMaskedWordPieceDataset`` packs consecutive sentences of a document into samples of
``--seq-length`` ([CLS] A [SEP] B [SEP]), masks ``--mask-prob`` of the WordPiece words (80% [MASK],
10% random, 10% unchanged; whole words, n-grams up to 3) and, with the binary head, swaps A and B
half of the time for sentence-order prediction. The masking settings are Megatron-LM's.
"""

from __future__ import annotations

import argparse

from megatron.core.datasets.bert_dataset import (
    BERTMaskedWordPieceDataset,
    BERTMaskedWordPieceDatasetConfig,
)
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder

from megatron_moe.data.gpt import check_split_sizes, common_dataset_kwargs

_TOKENIZER_FIELDS = ("cls", "sep", "mask", "pad", "inv_vocab", "vocab_size")


def add_bert_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Megatron-LM's BERT flags (same names and defaults)."""
    g = parser.add_argument_group("bert")
    g.add_argument("--mask-prob", type=float, default=0.15,
                   help="Probability of replacing a token with mask.")
    g.add_argument("--short-seq-prob", type=float, default=0.1,
                   help="Probability of producing a short sequence.")
    g.add_argument("--bert-no-binary-head", action="store_false", dest="bert_binary_head",
                   help="Disable the BERT binary (sentence-order prediction) head.")
    return parser


def validate_bert_args(args) -> None:
    """ValueError naming the flag for settings the BERT dataset cannot serve."""
    if not 0.0 < args.mask_prob < 1.0:
        raise ValueError(f"--mask-prob must be in (0, 1) (got {args.mask_prob})")
    if not 0.0 <= args.short_seq_prob <= 1.0:
        raise ValueError(f"--short-seq-prob must be in [0, 1] (got {args.short_seq_prob})")
    if args.mock_data:
        raise ValueError("BERT has no synthetic data: pass --data-path with a sentence-level "
                         "dataset (tools/preprocess_data.py --split-sentences)")
    if getattr(args, "context_parallel_size", 1) > 1:
        # Megatron-LM's BERT (examples/bert/pretrain_bert.py) never splits its batch over CP ranks
        raise ValueError("--context-parallel-size > 1 is not supported for BERT (nor by "
                         "Megatron-LM's BERT): its padding-masked attention sees whole sequences")
    if getattr(args, "calculate_per_token_loss", False):
        raise ValueError("--calculate-per-token-loss is for GPT's next-token loss (pretrain_gpt_moe.py); "
                         "BERT's loss here is the masked-LM mean (+ the per-sequence order loss)")
    if args.seq_length < 4:
        raise ValueError(f"--seq-length ({args.seq_length}) must leave room for [CLS] and two "
                         f"[SEP] tokens")


def check_wordpiece_tokenizer(tokenizer) -> None:
    missing = [f for f in _TOKENIZER_FIELDS if not hasattr(tokenizer, f)]
    if missing:
        raise ValueError(
            f"--tokenizer-type: the BERT dataset needs a WordPiece tokenizer with "
            f"{', '.join(_TOKENIZER_FIELDS)}; {type(tokenizer).__name__} lacks "
            f"{', '.join(missing)} (use BertWordPieceLowerCase/BertWordPieceCase with --vocab-file)")


def bert_dataset_config(args, tokenizer) -> BERTMaskedWordPieceDatasetConfig:
    check_wordpiece_tokenizer(tokenizer)
    return BERTMaskedWordPieceDatasetConfig(
        **common_dataset_kwargs(args, tokenizer),
        masking_probability=args.mask_prob,
        short_sequence_probability=args.short_seq_prob,
        masking_max_ngram=3,
        masking_do_full_word=True,
        masking_do_permutation=False,
        masking_use_longer_ngrams=False,
        masking_use_geometric_distribution=False,
        classification_head=args.bert_binary_head,
    )


def build_bert_datasets(args, tokenizer, num_samples):
    """(train, valid, test) BERTMaskedWordPieceDatasets; every rank builds (index cache shared)."""
    config = bert_dataset_config(args, tokenizer)
    check_split_sizes(config, args.split)
    builder = BlendedMegatronDatasetBuilder(BERTMaskedWordPieceDataset, num_samples,
                                            lambda: True, config)
    return builder.build()
