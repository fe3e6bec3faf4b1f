"""Mutations for tests/test_checkpoint_args.py, installed inside the spawned ranks
(run_pretrain_steps' ``mutate``: each returns its undo)."""

from __future__ import annotations


def _patch(module, name, value):
    real = getattr(module, name)
    setattr(module, name, value)
    return lambda: setattr(module, name, real)


def checkpoint_args_not_applied():
    """--use-checkpoint-args reads the checkpoint but sets none of its flags."""
    from megatron_moe.training import checkpoint_args

    return _patch(checkpoint_args, "_apply", lambda args, stored: {})


def pretrained_checkpoint_ignored():
    """The loader never falls back to --pretrained-checkpoint."""
    import argparse

    from megatron_moe.training import checkpointing

    real = checkpointing.checkpoint_source
    return _patch(checkpointing, "checkpoint_source", lambda args: real(
        argparse.Namespace(**dict(vars(args), pretrained_checkpoint=None))))


def pretrained_checkpoint_resumed():
    """--pretrained-checkpoint's checkpoint is resumed (iteration, optimizer, ...), not finetuned."""
    from megatron_moe.training import checkpointing

    real = checkpointing.checkpoint_source
    return _patch(checkpointing, "checkpoint_source",
                  lambda args: real(args)._replace(finetune=False))
