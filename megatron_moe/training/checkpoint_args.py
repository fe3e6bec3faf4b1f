"""Flags from a checkpoint: Megatron-LM's ``--use-checkpoint-args``.

Every checkpoint stores the ``args`` of the run that wrote it (``checkpointing.save_checkpoint``).
``read_checkpoint_common`` finds the checkpoint a directory resumes and reads them; training
(``megatron_moe/arguments.py``) and the inference tools (``megatron_moe/inference/arguments.py``)
both read through it.

Training applies Megatron-LM's rule (its ``load_args_from_checkpoint``), before the flags are
validated: the checkpoint's values of the model flags in ``FROM_CHECKPOINT`` replace the command
line's; those in ``UNLESS_GIVEN`` fill only a flag the command line left unset; with
``--use-tokenizer-model-from-checkpoint-args`` (the default; ``--no-...`` turns it off, e.g. when
the checkpoint was written on another cluster) ``--tokenizer-type`` and ``--tokenizer-model`` are
the checkpoint's too; with ``--use-mp-args-from-checkpoint-args`` so are the model-parallel sizes
in ``MODEL_PARALLEL`` (tensor, pipeline, virtual pipeline, expert; Megatron-LM's list: context and
expert-tensor parallelism stay the command line's). Everything else (data, schedule, the rest of
the parallel layout, and the model flags Megatron-LM does not list) is this command line's: the
shape check of the load names any of those that disagrees with the checkpoint. ``--pretrained-checkpoint`` is read first, then ``--load``
(Megatron-LM's order: a resumed finetune's own checkpoint has the last word).
"""

from __future__ import annotations

import os

# Megatron-LM's load_args_from_checkpoint, the flags it sets with force=True: the checkpoint's value
# wins over the command line's (a value the checkpoint stores as None leaves the flag alone).
# Names this parser does not define (Mamba, heterogeneous layers, ...) are skipped.
FROM_CHECKPOINT = (
    "num_query_groups", "group_query_attention", "position_embedding_type",
    "add_position_embedding", "use_rotary_position_embeddings", "rotary_base", "rotary_percent",
    "rotary_interleaved", "add_bias_linear", "add_qkv_bias", "squared_relu", "swiglu",
    "untie_embeddings_and_output_weights", "apply_layernorm_1p", "normalization",
    "apply_query_key_layer_scaling", "attention_dropout", "hidden_dropout",
    "mtp_hybrid_override_pattern", "mtp_num_layers", "mtp_use_repeated_layer", "spec",
    "num_experts", "moe_layer_freq", "moe_router_topk", "moe_router_pre_softmax",
    "moe_grouped_gemm", "moe_single_grouped_weight", "moe_single_grouped_bias",
    "moe_shared_expert_intermediate_size", "moe_router_score_function",
    "moe_router_enable_expert_bias", "moe_router_topk_scaling_factor", "mamba_state_dim",
    "mamba_head_dim", "mamba_num_groups", "mamba_num_heads",
    "heterogeneous_layers_config_path", "heterogeneous_layers_config_encoded_json",
    "moe_latent_size", "tiktoken_pattern",
)
# ... and those it sets without force: only when the command line left them unset (None).
UNLESS_GIVEN = (
    "num_layers", "hidden_size", "ffn_hidden_size", "seq_length", "num_attention_heads",
    "kv_channels", "max_position_embeddings", "moe_token_dispatcher_type", "hybrid_layer_pattern",
    "padded_vocab_size", "ckpt_format",
)
# with --use-tokenizer-model-from-checkpoint-args (default on): forced as well
TOKENIZER = ("tokenizer_model", "tokenizer_type")
# with --use-mp-args-from-checkpoint-args: (name, force) as Megatron-LM sets them. The virtual
# pipeline size is derived again by validation (from the per-stage layer count, the only way
# Megatron-LM takes it through), as it is there.
MODEL_PARALLEL = (
    ("tensor_model_parallel_size", True), ("pipeline_model_parallel_size", True),
    ("virtual_pipeline_model_parallel_size", True),
    ("num_layers_per_virtual_pipeline_stage", False), ("expert_model_parallel_size", True),
)


def has_checkpoint(root: str | None) -> bool:
    """Megatron-LM's checkpoint_exists: the directory has a tracker file."""
    from megatron_moe.training.checkpointing import TRACKER

    return root is not None and os.path.isfile(os.path.join(root, TRACKER))


def read_checkpoint_common(root: str, iteration: int | None = None,
                           flag: str = "--load") -> tuple[str, dict]:
    """(checkpoint directory, common state) of the checkpoint under ``root`` (its tracker's, or
    ``iteration``); ValueError naming ``flag`` and the file when there is none."""
    from torch.distributed.checkpoint.api import CheckpointException

    from megatron_moe.training.checkpointing import (
        TRACKER, CheckpointError, checkpoint_dir, read_common, read_tracker)

    if not os.path.isdir(root):
        raise ValueError(f"{flag}: {root} is not a directory")
    try:
        tracked = read_tracker(root)
    except CheckpointError as exc:
        raise ValueError(f"{flag}: {exc}") from None
    if iteration is None and tracked is None:
        raise ValueError(f"{flag}: no {TRACKER} under {root}")
    if iteration is None:
        iteration = tracked
    ckpt = checkpoint_dir(root, iteration)
    if not os.path.isdir(ckpt):
        where = f"{os.path.join(root, TRACKER)} points at" if iteration == tracked else \
            "--ckpt-step asks for"
        raise ValueError(f"{flag}: {where} iteration {iteration}, but {ckpt} does not exist")
    try:
        return ckpt, read_common(ckpt)
    except (Exception, CheckpointException) as exc:  # 0.19 reads it through torch DCP
        raise ValueError(f"{flag}: cannot read {ckpt} ({type(exc).__name__}: {exc})") from None


def _apply(args, stored) -> dict:
    """Megatron-LM's rule, one checkpoint's args onto ``args``; {dest: (before, after)} of the
    values it changed."""
    changed = {}

    def take(name, force):
        if not hasattr(args, name) or (not force and getattr(args, name) is not None):
            return
        value, before = getattr(stored, name, None), getattr(args, name)
        if value is not None:
            setattr(args, name, value)
            if value != before:
                changed[name] = (before, value)

    for name in UNLESS_GIVEN:
        take(name, force=False)
    for name in FROM_CHECKPOINT:
        take(name, force=True)
    if getattr(stored, "num_experts", None) is not None:
        take("moe_ffn_hidden_size", force=True)
    else:   # a dense checkpoint: no expert width (validate_args derives none)
        args.moe_ffn_hidden_size = None
    if args.use_tokenizer_model_from_checkpoint_args:
        for name in TOKENIZER:
            take(name, force=True)
    if getattr(args, "use_mp_args_from_checkpoint_args", False):
        for name, force in MODEL_PARALLEL:
            take(name, force)
    return changed


def load_args_from_checkpoint(args) -> list:
    """--use-checkpoint-args for training: the model (and tokenizer) flags of the checkpoint under
    --pretrained-checkpoint, then of the one under --load, onto ``args`` (before validation).
    ValueError in one line when neither holds a checkpoint. Returns [(checkpoint dir, {dest:
    (before, after)})] of each checkpoint read: the values it changed."""
    if args.load is None and args.pretrained_checkpoint is None:
        raise ValueError("--use-checkpoint-args needs --load (or --pretrained-checkpoint): the "
                         "checkpoint to read the model's flags from")
    sources = [(flag, root) for flag, root in (("--pretrained-checkpoint", args.pretrained_checkpoint),
                                               ("--load", args.load)) if has_checkpoint(root)]
    if not sources:
        named = " or ".join(f"{flag} {root}" for flag, root in
                            (("--load", args.load), ("--pretrained-checkpoint",
                                                     args.pretrained_checkpoint)) if root)
        raise ValueError(f"--use-checkpoint-args: no checkpoint under {named} (no "
                         f"latest_checkpointed_iteration.txt) to read the model's flags from")
    applied = []
    for flag, root in sources:
        ckpt, common = read_checkpoint_common(root, getattr(args, "ckpt_step", None), flag)
        stored = common.get("args")
        if stored is None:
            raise ValueError(f"{flag}: {ckpt} stores no args to take with --use-checkpoint-args")
        applied.append((ckpt, _apply(args, stored)))
    return applied
