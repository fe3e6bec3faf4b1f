"""Command line of the inference tools: Megatron's training flags + ``--use-checkpoint-args``.

With ``--use-checkpoint-args`` (Megatron-LM's flag) the architecture, tokenizer and data flags come
from the ``args`` stored in the checkpoint under ``--load``; any flag given on the command line
wins (``--no-use-tokenizer-model-from-checkpoint-args``: the tokenizer's too, as in training).
The parallel layout (TP/PP/EP/ETP/CP) and the seed come from the command line: a checkpoint is
reshardable, so it loads into whatever layout this launch asks for; with
``--use-mp-args-from-checkpoint-args`` the tensor, pipeline and expert sizes not given here are the
checkpoint's (Megatron-LM's list without its virtual-pipeline entries: the stage split is this
launch's, as below). The checkpoint
is read by ``megatron_moe/training/checkpoint_args.py``, training's reader; training applies
Megatron-LM's narrower rule there (model flags only; the checkpoint's win).
"""

from __future__ import annotations

import argparse
import os

# Never taken from the checkpoint: this launch's layout, process identity, paths, derived values.
NOT_FROM_CHECKPOINT = frozenset({
    "tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
    "expert_model_parallel_size", "expert_tensor_parallel_size", "sequence_parallel",
    "use_distributed_optimizer", "distributed_backend", "distributed_timeout_minutes",
    "overlap_grad_reduce", "overlap_param_gather", "local_rank", "rank", "world_size",
    "data_parallel_size", "num_microbatches", "load", "save", "seed", "tensorboard_dir",
    "moe_routing_trace_dir", "exit_interval", "exit_signal_handler",
    # how the training run split the layers over its pipeline stages (models/pipeline_split.py):
    # its layout, not the model's (the split it would need at this launch's PP is this launch's)
    "pipeline_model_parallel_layout", "num_layers_per_virtual_pipeline_stage",
    "num_virtual_stages_per_pipeline_rank", "decoder_first_pipeline_num_layers",
    "decoder_last_pipeline_num_layers", "account_for_embedding_in_pipeline_split",
    "account_for_loss_in_pipeline_split",
    # the training run's length and schedule: a run given in samples stores the iterations it
    # derived too, and the two are exclusive on a command line
    "train_iters", "train_samples", "rampup_batch_size", "step_batch_size_schedule",
    "decrease_batch_size_if_needed",
    "lr_decay_samples", "lr_warmup_samples", "lr_wsd_decay_samples", "lr_decay_iters",
    "lr_warmup_iters", "lr_wsd_decay_iters", "lr_warmup_fraction", "skip_train",
    "exit_on_missing_checkpoint", "eval_num_microbatches",
    # how the experts hold their parameters (one per expert or one per linear): the checkpoint is
    # the same for both, and generation (ring memory) streams experts one at a time
    "moe_single_grouped_weight", "moe_single_grouped_bias",
    # how the training run wrapped and sharded its model for data parallelism (Megatron-FSDP), and
    # the format it saved in: its layout, not the model's (the checkpoint says its own format)
    "use_megatron_fsdp", "data_parallel_sharding_strategy", "outer_dp_sharding_strategy",
    "ckpt_format",
    # which checkpoint to read and how: this launch's
    "ckpt_step", "pretrained_checkpoint", "use_checkpoint_args",
    "use_tokenizer_model_from_checkpoint_args", "use_mp_args_from_checkpoint_args",
})

# ... except with --use-mp-args-from-checkpoint-args: these sizes (Megatron-LM's list without its
# virtual-pipeline entries: the stage split stays this launch's, as above)
MP_FROM_CHECKPOINT = frozenset({"tensor_model_parallel_size", "pipeline_model_parallel_size",
                                "expert_model_parallel_size"})


def _explicit(parser, argv) -> argparse.Namespace:
    """Only the flags that ``argv`` names (every default replaced by SUPPRESS for one parse)."""
    saved = [(a, a.default, a.required) for a in parser._actions]
    saved_defaults = dict(parser._defaults)
    try:
        parser._defaults.clear()
        for action in parser._actions:
            action.default = argparse.SUPPRESS
            action.required = False
        return parser.parse_args(argv)
    finally:
        parser._defaults.update(saved_defaults)
        for action, default, required in saved:
            action.default, action.required = default, required


def parse_inference_args(argv, add_tool_args, prog: str, *, need_data: bool = False,
                         keep_batch_size: bool = False, validate_tool=None):
    """Megatron flags + the tool's flags, merged with the checkpoint's args; validated before any
    process group starts. Errors exit with code 2 and one line naming the flag (argparse style).

    ``keep_batch_size``: keep the checkpoint's micro/global batch size (evaluation reproduces the
    training validation line); otherwise the batch flags default to one sequence per rank.
    """
    from megatron_moe import arguments as margs

    from megatron_moe import flags
    from megatron_moe.training.checkpoint_args import read_checkpoint_common

    # --use-checkpoint-args is defined by build_parser (training's flag); here it takes the model,
    # tokenizer and data flags from the checkpoint under --load, flags given here overriding them
    parser = margs.build_parser(extra_args_provider=add_tool_args, prog=prog)
    # --num-layers is optional in training only because --pipeline-model-parallel-layout may
    # define it; a model to generate with needs it (or the checkpoint's)
    required = {a.dest: a.option_strings[0] for a in parser._actions
                if a.required or a.dest == "num_layers"}
    for action in parser._actions:
        action.required = False
    parser.set_defaults(train_iters=1, lr=0.0)  # training-only values a model build never reads
    explicit = vars(_explicit(parser, argv))
    args = parser.parse_args(argv)
    try:
        flags.check_refused(args)  # a refused Megatron flag: one line saying why
    except ValueError as exc:
        parser.error(str(exc))
    if args.pretrained_checkpoint is not None:
        parser.error("--pretrained-checkpoint is a training flag (finetuning); inference loads "
                     "the checkpoint under --load")
    if args.use_mp_args_from_checkpoint_args and not args.use_checkpoint_args:
        parser.error("--use-mp-args-from-checkpoint-args needs --use-checkpoint-args (it takes "
                     "the model-parallel sizes along with the checkpoint's model flags)")
    if args.load is None:
        parser.error("--load is required (a checkpoint directory written by pretrain_gpt_moe.py)")
    try:
        ckpt_dir, common = read_checkpoint_common(args.load)
    except ValueError as exc:
        parser.error(str(exc))
    args.checkpoint_dir = ckpt_dir
    args.checkpoint_iteration = common.get("iteration")
    args.checkpoint_args = common.get("args")  # the training run's flags (evaluate.py sizes splits)
    if args.use_checkpoint_args:
        stored = vars(common.get("args") or argparse.Namespace())
        dests = {a.dest for a in parser._actions}
        from megatron_moe.training import checkpoint_args

        kept = NOT_FROM_CHECKPOINT | (set() if args.use_tokenizer_model_from_checkpoint_args
                                      else set(checkpoint_args.TOKENIZER))
        if args.use_mp_args_from_checkpoint_args:
            kept -= MP_FROM_CHECKPOINT
        for key, value in stored.items():
            if key in dests and key not in kept and key not in explicit:
                setattr(args, key, value)
        for key in ("micro_batch_size", "global_batch_size"):
            if not keep_batch_size and key not in explicit:
                setattr(args, key, None)
            if key in explicit or not keep_batch_size:   # evaluation follows the batch given here
                if f"eval_{key}" not in explicit:
                    setattr(args, f"eval_{key}", None)
    if args.micro_batch_size is None:
        args.micro_batch_size = 1
    missing = [flag for dest, flag in required.items() if getattr(args, dest, None) is None]
    if missing:
        parser.error(f"{', '.join(missing)} required (or --use-checkpoint-args to read them from "
                     f"the checkpoint under --load)")
    stored_vocab = getattr(args.checkpoint_args, "padded_vocab_size", None)
    if stored_vocab and stored_vocab % args.tensor_model_parallel_size:
        parser.error(f"--tensor-model-parallel-size {args.tensor_model_parallel_size}: the "
                     f"checkpoint's padded vocabulary ({stored_vocab} rows) does not split into "
                     f"that many shards")
    if args.num_experts and args.tensor_model_parallel_size > 1:
        args.sequence_parallel = True  # megatron-core's MoE+TP requirement; same math
    args.world_size = int(os.environ.get("WORLD_SIZE", "1"))
    args.rank = int(os.environ.get("RANK", "0"))
    no_data = not (args.mock_data or args.data_path or args.train_data_path or args.valid_data_path)
    if no_data and need_data:
        parser.error("--data-path (or --valid-data-path) is required")
    try:
        if no_data:  # generation reads no dataset: validate as if data were mocked
            args.mock_data = True
            margs.validate_args(args, check_data_paths=False, training=False)
            args.mock_data = False
        else:
            margs.validate_args(args, check_data_paths=need_data, training=False)
        margs.validate_megatron_ci_args(args)   # GPU-only flags, determinism, formats
        margs.validate_extension_args(args)
        _check_tokenizer_files(args)
        if validate_tool is not None:
            validate_tool(args)
    except ValueError as exc:
        parser.error(str(exc))
    try:
        from megatron_moe.models.builder import transformer_config_from_args

        transformer_config_from_args(args)
    except (AssertionError, ValueError) as exc:
        parser.error(f"invalid model configuration: {exc}")
    # Inference loads weights only; optimizer and RNG state stay in the checkpoint.
    args.no_load_optim = args.no_load_rng = True
    args.finetune = False
    return args


def _check_tokenizer_files(args):
    from megatron_moe.arguments import TOKENIZERS_WITH_MODEL

    if args.tokenizer_type in TOKENIZERS_WITH_MODEL and args.tokenizer_model is None:
        raise ValueError(f"--tokenizer-type {args.tokenizer_type} needs --tokenizer-model")
    for flag in ("tokenizer_model", "vocab_file", "merge_file"):
        path = getattr(args, flag, None)
        if path is not None and not os.path.exists(path):
            raise ValueError(f"--{flag.replace('_', '-')}: {path} does not exist (pass the file's "
                             f"current path if the checkpoint was written elsewhere)")
