"""Rank functions for tests/test_hf_convert.py (spawned by megatron_moe.runtime.local_ranks.run_distributed)."""

import json
import os

# Flags that complete a pretrain_gpt_moe.py command line around the model flags.
RUN = ["--micro-batch-size", "1", "--train-iters", "1", "--lr", "0", "--mock-data",
       "--tokenizer-type", "NullTokenizer"]


def model_flags(hf_dir):
    from megatron_moe.hf.families import family_for_config

    cfg = json.load(open(os.path.join(hf_dir, "config.json")))
    return family_for_config(cfg).flags_from_config(cfg), cfg["vocab_size"]


def logits_rank(rank, world_size, hf_dir, ckpt, layouts, tokens, load_checks=None):
    """Our training model (gpt_model_provider, every spec hook) loaded from ``ckpt`` with
    pretrain_gpt_moe.py's own load path, at each layout; full-vocab logits from rank 0."""
    import torch
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    from megatron_moe.arguments import parse_args
    from megatron_moe.training.checkpointing import load_checkpoint
    from megatron_moe.data.tokenizers import vocab_size_with_padding
    from megatron_moe.runtime.initialize import initialize_distributed
    from megatron_moe.models.builder import gpt_model_provider

    flags, vocab = model_flags(hf_dir)
    if "--mtp-num-layers" in flags:  # the main model's logits (transformers has no MTP); the
        i = flags.index("--mtp-num-layers")  # checkpoint's mtp.* tensors are left unread
        flags = flags[:i] + flags[i + 2:]
    out = []
    for layout in layouts:
        args = parse_args(flags + RUN + ["--vocab-size", str(vocab - 1), "--load", ckpt]
                          + layout.split(), world_size=world_size)
        args.padded_vocab_size = vocab_size_with_padding(vocab, args.make_vocab_size_divisible_by,
                                                         args.tensor_model_parallel_size)
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        initialize_distributed(args)
        model = gpt_model_provider(args)
        torch.nn.init.zeros_(next(model.parameters()))  # loading must overwrite it
        iteration = load_checkpoint([model], None, None, args)[0]
        model.eval()
        ids = torch.tensor(tokens)
        pos = torch.arange(ids.shape[1]).unsqueeze(0).expand_as(ids)
        with torch.no_grad():
            logits = model(ids, pos, None)
            logits = gather_from_tensor_model_parallel_region(logits)
        out.append((iteration, logits[..., :vocab].clone() if rank == 0 else None))
    return out


def pipeline_rank(rank, world_size, train_runs, logit_jobs):
    """pretrain() runs in this process, then logits_rank for each
    (hf_dir, ckpt, layouts, tokens) job."""
    import pretrain_gpt_moe
    from megatron.core.enums import ModelType

    from megatron_moe.training.loop import pretrain

    from megatron.core import parallel_state

    histories = []
    for argv in train_runs:
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()  # the runs may use different layouts
        result = pretrain(pretrain_gpt_moe.train_valid_test_datasets_provider,
                          pretrain_gpt_moe.model_provider, ModelType.encoder_or_decoder,
                          pretrain_gpt_moe.forward_step, argv=argv)
        histories.append(result["history"])
    return histories, [logits_rank(rank, world_size, *job) for job in logit_jobs]
