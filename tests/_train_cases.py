"""Rank functions that run the real pretrain() entry point in-process (spawned by run_distributed)."""

import sys


def run_pretrain(rank, world_size, argv, stub_tokenizer=True):
    if stub_tokenizer:
        _install_stub_tokenizer()
    import pretrain_gpt_moe
    from megatron.core.enums import ModelType

    from megatron_moe.training import pretrain

    result = pretrain(pretrain_gpt_moe.train_valid_test_datasets_provider,
                      pretrain_gpt_moe.model_provider, ModelType.encoder_or_decoder,
                      pretrain_gpt_moe.forward_step, argv=argv)
    return result["history"]


def _install_stub_tokenizer():
    import types

    class Tok:
        vocab_size, eod, pad, unique_identifiers = 256, 0, 1, {"class": "stub"}

    mod = types.ModuleType("megatron_moe.data.tokenizers")
    mod.build_tokenizer = lambda args: Tok()
    mod.vocab_size_with_padding = lambda v, d, tp: ((v + d * tp - 1) // (d * tp)) * d * tp
    sys.modules[mod.__name__] = mod
