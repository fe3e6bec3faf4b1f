"""Megatron-LM compatible command line: the same flag names, defaults and meanings.

Everything is validated here, before any process group starts, so a bad launch fails at once
with one line naming the flag (argparse's ``error: ...`` on stderr, exit code 2) instead of a hang
or a traceback on every rank. ``allow_abbrev=False``: a misspelt flag is an error, never a guess.

Features add their own flags, checks and refusals through one protocol (megatron_moe/features.py).
"""

from __future__ import annotations

import argparse
import os

from megatron_moe import features
from megatron_moe.flags.types import layer_freq as _layer_freq

class _Parser(argparse.ArgumentParser):
    def error(self, message):
        # one line naming the flag; the full usage is a wall of text on every rank
        self.exit(2, f"{self.prog}: error: {message}\n(see --help for the flag reference)\n")


def build_parser(extra_args_provider=None, prog="pretrain_gpt_moe.py") -> argparse.ArgumentParser:
    p = _Parser(prog=prog, allow_abbrev=False,
                               description="Megatron-style MoE pretraining on megatron-core.")
    _add_parallel_args(p)
    _add_model_args(p)
    _add_moe_args(p)
    _add_megatron_model_impl_args(p)
    _add_training_args(p)
    _add_data_args(p)
    _add_checkpoint_args(p)
    _add_logging_args(p)
    features.add_arguments(p)
    if extra_args_provider is not None:
        p = extra_args_provider(p) or p
    from megatron_moe import flags

    return flags.register(p)  # the rest of Megatron's flags: no-ops and refusals (flags/status.txt)


def _add_parallel_args(p):
    g = p.add_argument_group("distributed")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--context-parallel-size", type=int, default=1)
    g.add_argument("--expert-model-parallel-size", type=int, default=1)
    g.add_argument("--expert-tensor-parallel-size", type=int, default=None,
                   help="Defaults to --tensor-model-parallel-size.")
    g.add_argument("--sequence-parallel", action="store_true")
    g.add_argument("--use-distributed-optimizer", action="store_true")
    g.add_argument("--distributed-backend", default=None, choices=["nccl", "gloo"],
                   help="Default: nccl when CUDA is available, else gloo.")
    g.add_argument("--distributed-timeout-minutes", type=float, default=10,
                   help="Timeout of every collective (Megatron's flag; fractions allowed).")
    g.add_argument("--overlap-grad-reduce", action="store_true")
    g.add_argument("--overlap-param-gather", action="store_true")
    g.add_argument("--local-rank", type=int, default=None, help="Set by the launcher.")


def _add_model_args(p):
    g = p.add_argument_group("network size")
    g.add_argument("--num-layers", type=int, required=True)
    g.add_argument("--hidden-size", type=int, required=True)
    g.add_argument("--ffn-hidden-size", type=int, default=None, help="Default: 4 x hidden size.")
    g.add_argument("--num-attention-heads", type=int, required=True)
    g.add_argument("--num-query-groups", type=int, default=None, help="Grouped-query attention.")
    g.add_argument("--group-query-attention", action="store_true")
    g.add_argument("--kv-channels", type=int, default=None)
    g.add_argument("--seq-length", type=int, required=True)
    g.add_argument("--max-position-embeddings", type=int, default=None)
    g.add_argument("--position-embedding-type", default="learned_absolute",
                   choices=["learned_absolute", "rope", "yarn", "none"])
    g.add_argument("--rotary-base", type=int, default=10000)
    g.add_argument("--normalization", default="LayerNorm", choices=["LayerNorm", "RMSNorm"])
    g.add_argument("--norm-epsilon", type=float, default=1e-5)
    g.add_argument("--swiglu", action="store_true")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    g.add_argument("--disable-bias-linear", action="store_false", dest="add_bias_linear")
    g.add_argument("--add-bias-linear", action="store_true", dest="add_bias_linear",
                   help="The default; undoes an earlier --disable-bias-linear.")
    g.add_argument("--add-qkv-bias", action="store_true",
                   help="Bias in the QKV projection only (Qwen2); works with --disable-bias-linear.")
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    g.add_argument("--hidden-dropout", type=float, default=0.1)
    g.add_argument("--attention-dropout", type=float, default=0.1)
    g.add_argument("--init-method-std", type=float, default=0.02)


def _add_megatron_model_impl_args(p):
    """Megatron's model-family and implementation flags (Qwen3-MoE, Mixtral scripts; issue 20)."""
    g = p.add_argument_group("model family and implementation")
    g.add_argument("--use-mcore-models", action="store_true", dest="deprecated_use_mcore_models",
                   help="Deprecated in Megatron: megatron-core models are the only implementation.")
    g.add_argument("--no-position-embedding", action="store_false", dest="add_position_embedding",
                   help="Deprecated Megatron form; accepted with --position-embedding-type rope.")
    g.add_argument("--use-rotary-position-embeddings", action="store_true",
                   help="Legacy form of --position-embedding-type rope.")
    g.add_argument("--rotary-percent", type=float, default=1.0,
                   help="Fraction of each head's dimensions rotated by RoPE.")
    g.add_argument("--qk-layernorm", action="store_true",
                   help="Normalise queries and keys per head (--normalization's kind; Qwen3).")
    g.add_argument("--moe-router-dtype", default=None, choices=["fp32", "fp64"],
                   help="Router logits, top-k and aux loss in this dtype (default: the input's).")
    g.add_argument("--attention-softmax-in-fp32", action="store_true",
                   help="Attention softmax in fp32 under --bf16/--fp16 (local attention).")
    g.add_argument("--transformer-impl", default=None,
                   choices=["local", "transformer_engine", "inference_optimized"],
                   help="Default: transformer_engine when Transformer Engine and CUDA are present, "
                        "else local (megatron-core's own modules).")
    g.add_argument("--attention-backend", default="auto",
                   choices=["flash", "fused", "unfused", "local", "auto"],
                   help="With --transformer-impl local: flash is torch SDPA (flash/cuDNN/"
                        "efficient kernels on CUDA), auto is SDPA on CUDA and megatron-core's "
                        "unfused math on CPU, local/unfused megatron-core's math; fused needs "
                        "--transformer-impl transformer_engine.")


def _add_moe_args(p):
    g = p.add_argument_group("moe")
    g.add_argument("--num-experts", type=int, default=None)
    g.add_argument("--moe-ffn-hidden-size", type=int, default=None)
    g.add_argument("--moe-shared-expert-intermediate-size", type=int, default=None)
    g.add_argument("--moe-shared-expert-gate", action="store_true",
                   help="Sigmoid gate on the shared experts' output (Qwen2-MoE).")
    g.add_argument("--moe-router-topk", type=int, default=2)
    g.add_argument("--moe-layer-freq", type=_layer_freq, default=1,
                   help="int N (every Nth layer is MoE) or a list such as '[1,0,1,0]'.")
    g.add_argument("--moe-router-load-balancing-type", default="aux_loss",
                   choices=["aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none"])
    g.add_argument("--moe-aux-loss-coeff", type=float, default=0.0)
    g.add_argument("--moe-z-loss-coeff", type=float, default=None)
    g.add_argument("--moe-input-jitter-eps", type=float, default=None)
    g.add_argument("--moe-expert-capacity-factor", type=float, default=None)
    g.add_argument("--moe-pad-expert-input-to-capacity", action="store_true")
    g.add_argument("--moe-token-drop-policy", default="probs", choices=["probs", "position"])
    g.add_argument("--moe-token-dispatcher-type", default="allgather",
                   choices=["allgather", "alltoall", "flex"])
    g.add_argument("--moe-router-score-function", default="softmax", choices=["softmax", "sigmoid"])
    g.add_argument("--moe-router-pre-softmax", action="store_true")
    g.add_argument("--moe-router-num-groups", type=int, default=None)
    g.add_argument("--moe-router-group-topk", type=int, default=None)
    g.add_argument("--moe-router-topk-scaling-factor", type=float, default=None)
    g.add_argument("--moe-router-enable-expert-bias", action="store_true")
    g.add_argument("--moe-router-bias-update-rate", type=float, default=1e-3)
    g.add_argument("--moe-router-force-load-balancing", action="store_true",
                   help="Benchmarking only: route tokens uniformly (megatron-core's forced balance).")
    g.add_argument("--moe-grouped-gemm", action="store_true")
    g.add_argument("--moe-per-layer-logging", action="store_true")


def _add_training_args(p):
    g = p.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, required=True)
    g.add_argument("--global-batch-size", type=int, default=None,
                   help="Default: micro batch size x data-parallel size.")
    g.add_argument("--train-iters", type=int, default=None)
    g.add_argument("--train-samples", type=int, default=None)
    g.add_argument("--exit-interval", type=int, default=None,
                   help="Stop (and save) when iteration %% interval == 0.")
    g.add_argument("--exit-signal-handler", action="store_true",
                   help="On SIGTERM, save a checkpoint and exit.")
    g.add_argument("--optimizer", default="adam", choices=["adam", "sgd"])
    g.add_argument("--lr", type=float, default=None)
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument("--lr-decay-style", default="linear",
                   choices=["constant", "linear", "cosine", "inverse-square-root", "WSD"])
    g.add_argument("--lr-decay-iters", type=int, default=None)
    g.add_argument("--lr-warmup-iters", type=int, default=0)
    g.add_argument("--lr-warmup-fraction", type=float, default=None)
    g.add_argument("--lr-warmup-init", type=float, default=0.0)
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--start-weight-decay", type=float, default=None)
    g.add_argument("--end-weight-decay", type=float, default=None)
    g.add_argument("--weight-decay-incr-style", default="constant",
                   choices=["constant", "linear", "cosine"])
    g.add_argument("--clip-grad", type=float, default=1.0)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--sgd-momentum", type=float, default=0.9)
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--bf16", action="store_true")
    g.add_argument("--fp16", action="store_true")
    g.add_argument("--loss-scale", type=float, default=None)
    g.add_argument("--initial-loss-scale", type=float, default=2 ** 32)
    g.add_argument("--use-cpu-initialization", action="store_true")
    # Activation recomputation: Megatron's flags, handed to megatron-core's TransformerConfig
    # (same field names), which checks the combinations when the trial config is built.
    g.add_argument("--recompute-activations", action="store_true",
                   help="Selective recomputation (same as --recompute-granularity selective).")
    g.add_argument("--recompute-granularity", default=None, choices=["full", "selective"])
    g.add_argument("--recompute-method", default=None, choices=["uniform", "block"])
    g.add_argument("--recompute-num-layers", type=int, default=None)
    g.add_argument("--no-check-for-nan-in-loss-and-grad", "--no-nan-check", action="store_false",
                   dest="check_for_nan_in_loss",
                   help="Do not stop on a NaN/Inf loss.")


def _add_data_args(p):
    g = p.add_argument_group("data and tokenizer")
    g.add_argument("--data-path", nargs="*", default=None,
                   help="PREFIX, or WEIGHT1 PREFIX1 WEIGHT2 PREFIX2 ... for blending.")
    g.add_argument("--split", default="969,30,1")
    g.add_argument("--train-data-path", nargs="*", default=None)
    g.add_argument("--valid-data-path", nargs="*", default=None)
    g.add_argument("--test-data-path", nargs="*", default=None)
    g.add_argument("--data-cache-path", default=None)
    g.add_argument("--mock-data", action="store_true", help="Synthetic data (no --data-path).")
    g.add_argument("--num-workers", type=int, default=0)
    g.add_argument("--reset-position-ids", action="store_true")
    g.add_argument("--reset-attention-mask", action="store_true")
    g.add_argument("--eod-mask-loss", action="store_true")
    g.add_argument("--tokenizer-type", default="SentencePieceTokenizer")
    g.add_argument("--tokenizer-model", default=None)
    g.add_argument("--vocab-file", default=None)
    g.add_argument("--merge-file", default=None)
    g.add_argument("--vocab-size", type=int, default=None,
                   help="For NullTokenizer; TikTokenizer's vocabulary (default 131072).")
    from megatron_moe.data.tokenizers import add_tiktoken_args

    add_tiktoken_args(g)


def _add_checkpoint_args(p):
    g = p.add_argument_group("checkpointing")
    g.add_argument("--save", default=None)
    g.add_argument("--load", default=None)
    g.add_argument("--save-interval", "--persistent-save-interval", type=int, default=None)
    g.add_argument("--no-save-optim", action="store_true")
    g.add_argument("--no-save-rng", action="store_true")
    g.add_argument("--no-load-optim", action="store_true")
    g.add_argument("--no-load-rng", action="store_true")
    g.add_argument("--finetune", action="store_true",
                   help="Load weights only; reset iteration, optimizer and scheduler.")
    g.add_argument("--ckpt-format", default="torch_dist", choices=["torch_dist"])
    g.add_argument("--ckpt-step", type=int, default=None,
                   help="Load this iteration from --load instead of the tracker's.")
    g.add_argument("--async-save", action="store_true",
                   help="Write checkpoint shards in the background (megatron-core's async save).")
    g.add_argument("--auto-detect-ckpt-format", action="store_true")
    g.add_argument("--use-checkpoint-opt_param-scheduler", "--use-checkpoint-opt-param-scheduler",
                   action="store_true",
                   dest="use_checkpoint_opt_param_scheduler")
    g.add_argument("--override-opt_param-scheduler", "--override-opt-param-scheduler",
                   action="store_true",
                   dest="override_opt_param_scheduler")


def _add_logging_args(p):
    g = p.add_argument_group("logging")
    g.add_argument("--log-interval", type=int, default=100)
    g.add_argument("--eval-interval", type=int, default=1000)
    g.add_argument("--eval-iters", type=int, default=100)
    g.add_argument("--tensorboard-dir", default=None)
    g.add_argument("--tensorboard-log-interval", type=int, default=1)
    g.add_argument("--log-throughput", action="store_true")
    g.add_argument("--log-expert-load", action="store_true", default=True,
                   help="Per-MoE-layer expert-load imbalance lines (default on).")
    g.add_argument("--no-log-expert-load", action="store_false", dest="log_expert_load")


# --- validation ------------------------------------------------------------------------------------
def validate_extension_args(args):
    """The features' own checks and declared exclusions (ValueError names the flags)."""
    features.validate_args(args)


def parse_args(argv=None, extra_args_provider=None, args_defaults=None, world_size=None,
               check_data_paths=True):
    parser = build_parser(extra_args_provider)
    if args_defaults:
        parser.set_defaults(**args_defaults)
    args = parser.parse_args(argv)
    from megatron_moe import flags

    try:
        flags.check_refused(args)  # a refused Megatron flag: one line saying why (flags/status.txt)
    except ValueError as exc:
        parser.error(str(exc))
    from megatron_moe.runtime.launcher import launcher_env   # torchrun's variables, else srun's

    try:
        env = launcher_env()
    except ValueError as exc:
        parser.error(str(exc))
    args.world_size = env.world_size if world_size is None else world_size
    args.rank = env.rank
    # the error for a world size that the parallel sizes do not divide names where it came from
    args.world_size_source = env.source if world_size is None else None
    try:
        validate_args(args, check_data_paths=check_data_paths)
    except ValueError as exc:
        parser.error(str(exc))
    finally:
        del args.world_size_source
    try:
        validate_extension_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    try:  # megatron-core's own consistency checks, still before any process group starts
        from megatron_moe.models.builder import transformer_config_from_args

        transformer_config_from_args(args)
    except (AssertionError, ValueError) as exc:
        parser.error(f"invalid model configuration: {exc}")
    return args


def validate_args(args, check_data_paths=True, training=True):
    """Fill derived values and reject impossible combinations (ValueError names the flag).
    ``training=False`` (the inference tools): refuse only what a forward pass cannot do."""
    tp, pp, cp = (args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
                  args.context_parallel_size)
    ep = args.expert_model_parallel_size
    if args.expert_tensor_parallel_size is None:
        args.expert_tensor_parallel_size = tp
    etp = args.expert_tensor_parallel_size
    world = args.world_size
    for flag, value in (("--tensor-model-parallel-size", tp), ("--pipeline-model-parallel-size", pp),
                        ("--context-parallel-size", cp), ("--expert-model-parallel-size", ep),
                        ("--expert-tensor-parallel-size", etp), ("--micro-batch-size",
                                                                  args.micro_batch_size)):
        if value < 1:
            raise ValueError(f"{flag} must be >= 1 (got {value})")
    # srun with one task per rank: the world size is Slurm's task count (--ntasks)
    named = (f"{world} (SLURM_NTASKS, srun's --ntasks)"
             if getattr(args, "world_size_source", None) == "SLURM_NTASKS" else f"{world}")
    if world % (tp * pp * cp) != 0:
        raise ValueError(
            f"world size {named} is not divisible by --tensor-model-parallel-size ({tp}) x "
            f"--pipeline-model-parallel-size ({pp}) x --context-parallel-size ({cp})")
    if world % (etp * ep * pp) != 0:
        raise ValueError(
            f"world size {named} is not divisible by --expert-tensor-parallel-size ({etp}) x "
            f"--expert-model-parallel-size ({ep}) x --pipeline-model-parallel-size ({pp})")
    args.data_parallel_size = world // (tp * pp * cp)
    if args.global_batch_size is None:
        args.global_batch_size = args.micro_batch_size * args.data_parallel_size
    if args.global_batch_size % (args.micro_batch_size * args.data_parallel_size) != 0:
        raise ValueError(
            f"--global-batch-size ({args.global_batch_size}) must be a multiple of "
            f"--micro-batch-size ({args.micro_batch_size}) x data-parallel size "
            f"({args.data_parallel_size})")
    args.num_microbatches = args.global_batch_size // (args.micro_batch_size * args.data_parallel_size)
    if pp > 1 and args.num_layers % pp != 0:
        raise ValueError(f"--num-layers ({args.num_layers}) must be divisible by "
                         f"--pipeline-model-parallel-size ({pp})")
    if args.kv_channels is None and args.hidden_size % args.num_attention_heads != 0:
        raise ValueError(f"--hidden-size ({args.hidden_size}) must be divisible by "
                         f"--num-attention-heads ({args.num_attention_heads}) (or set --kv-channels)")
    _validate_model_impl_args(args)
    if args.num_attention_heads % tp != 0:
        raise ValueError(f"--num-attention-heads ({args.num_attention_heads}) must be divisible "
                         f"by --tensor-model-parallel-size ({tp})")
    if args.ffn_hidden_size is None:
        args.ffn_hidden_size = 4 * args.hidden_size
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    if args.seq_length > args.max_position_embeddings and args.position_embedding_type == "learned_absolute":
        raise ValueError(f"--seq-length ({args.seq_length}) exceeds --max-position-embeddings "
                         f"({args.max_position_embeddings})")
    if args.bf16 and args.fp16:
        raise ValueError("--bf16 and --fp16 are mutually exclusive")
    if args.recompute_activations:
        args.recompute_granularity = "selective"
    if args.recompute_granularity == "full" and (args.recompute_method is None
                                                 or args.recompute_num_layers is None):
        raise ValueError("--recompute-granularity full needs --recompute-method uniform|block "
                         "and --recompute-num-layers N")
    if args.num_query_groups is not None:
        args.group_query_attention = True
    # MoE
    if args.num_experts is None:
        if ep > 1:
            raise ValueError("--expert-model-parallel-size > 1 needs --num-experts")
    else:
        if args.num_experts % ep != 0:
            raise ValueError(f"--num-experts ({args.num_experts}) must be divisible by "
                             f"--expert-model-parallel-size ({ep})")
        if not 1 <= args.moe_router_topk <= args.num_experts:
            raise ValueError(f"--moe-router-topk ({args.moe_router_topk}) must be in "
                             f"[1, --num-experts={args.num_experts}]")
        if args.moe_ffn_hidden_size is None:
            args.moe_ffn_hidden_size = args.ffn_hidden_size
        if tp > 1 and not args.sequence_parallel:
            raise ValueError("MoE with --tensor-model-parallel-size > 1 requires --sequence-parallel")
        if etp > 1 and args.add_bias_linear:
            raise ValueError(f"--expert-tensor-parallel-size {etp} needs --disable-bias-linear "
                             f"(megatron-core supports expert biases only with ETP=1)")
        if ep == 1 and args.add_bias_linear and training:
            # megatron-core 0.16 adds the expert bias in place on a view (mlp.py) when experts are
            # not expert-parallel; it fails at the first backward (generation never runs one)
            raise ValueError("MoE with --expert-model-parallel-size 1 needs --disable-bias-linear "
                             "(megatron-core's expert-bias path fails there)")
        if isinstance(args.moe_layer_freq, list) and len(args.moe_layer_freq) != args.num_layers:
            raise ValueError(f"--moe-layer-freq has {len(args.moe_layer_freq)} entries, "
                             f"--num-layers is {args.num_layers}")
        if args.moe_expert_capacity_factor is not None and args.moe_token_dispatcher_type == "allgather":
            raise ValueError("--moe-expert-capacity-factor needs --moe-token-dispatcher-type "
                             "alltoall (megatron-core drops tokens only there)")
        if args.moe_pad_expert_input_to_capacity and args.moe_expert_capacity_factor is None:
            raise ValueError("--moe-pad-expert-input-to-capacity needs --moe-expert-capacity-factor")
        if args.moe_shared_expert_gate and args.moe_shared_expert_intermediate_size is None:
            raise ValueError("--moe-shared-expert-gate needs --moe-shared-expert-intermediate-size")
        if args.moe_shared_expert_intermediate_size is not None and args.add_bias_linear:
            raise ValueError("--moe-shared-expert-intermediate-size needs --disable-bias-linear "
                             "(megatron-core's shared experts have no biases)")
        if args.moe_token_dispatcher_type == "flex" and not _cuda_available():
            raise ValueError("--moe-token-dispatcher-type flex needs CUDA and DeepEP/HybridEP")
    if tp == 1 and args.sequence_parallel:
        args.sequence_parallel = False  # Megatron does the same: SP is meaningless without TP
    # training length and schedule
    if args.train_iters is None and args.train_samples is None:
        raise ValueError("one of --train-iters or --train-samples is required")
    if args.train_iters is not None and args.train_samples is not None:
        raise ValueError("--train-iters and --train-samples are mutually exclusive")
    if args.train_iters is None:
        args.train_iters = args.train_samples // args.global_batch_size
    if args.lr is None:
        raise ValueError("--lr is required")
    if args.min_lr > args.lr:
        raise ValueError(f"--min-lr ({args.min_lr}) is larger than --lr ({args.lr})")
    if getattr(args, "override_opt_param_scheduler", False) and \
            getattr(args, "use_checkpoint_opt_param_scheduler", False):
        raise ValueError("--override-opt_param-scheduler (this command line's schedule) and "
                         "--use-checkpoint-opt_param-scheduler (the checkpoint's) exclude "
                         "each other")
    if args.lr_decay_iters is None:
        args.lr_decay_iters = args.train_iters
    if args.lr_warmup_fraction is not None:
        if args.lr_warmup_iters:
            raise ValueError("--lr-warmup-fraction and --lr-warmup-iters are mutually exclusive")
        args.lr_warmup_iters = int(args.lr_warmup_fraction * args.lr_decay_iters)
    if args.lr_decay_style != "constant" and args.lr_warmup_iters >= args.lr_decay_iters:
        raise ValueError(f"--lr-warmup-iters ({args.lr_warmup_iters}) must be smaller than "
                         f"--lr-decay-iters ({args.lr_decay_iters}; defaults to --train-iters)")
    if args.start_weight_decay is None:
        args.start_weight_decay = args.weight_decay
    if args.end_weight_decay is None:
        args.end_weight_decay = args.weight_decay
    if args.distributed_timeout_minutes <= 0:
        raise ValueError("--distributed-timeout-minutes must be > 0")
    if args.async_save and args.save is None:
        raise ValueError("--async-save needs --save")
    if args.save is not None and args.save_interval is None:
        args.save_interval = args.train_iters  # save at the end at least
    if args.save_interval is not None and args.save_interval < 1:
        raise ValueError("--save-interval must be >= 1")
    if args.log_interval < 1:
        raise ValueError("--log-interval must be >= 1")
    if args.distributed_backend is None:
        args.distributed_backend = "nccl" if _cuda_available() else "gloo"
    if args.distributed_backend == "nccl" and not _cuda_available():
        raise ValueError("--distributed-backend nccl needs CUDA; use gloo on a CPU-only machine")
    args.params_dtype = "bf16" if args.bf16 else ("fp16" if args.fp16 else "fp32")
    # data
    if not args.mock_data and not (args.data_path or args.train_data_path):
        raise ValueError("--data-path is required (or --mock-data for synthetic data)")
    if check_data_paths and not args.mock_data:
        for flag in ("data_path", "train_data_path", "valid_data_path", "test_data_path"):
            for prefix in _prefixes(getattr(args, flag)):
                for ext in (".bin", ".idx"):
                    if not os.path.isfile(prefix + ext):
                        raise ValueError(
                            f"--{flag.replace('_', '-')}: {prefix + ext} does not exist (a data path "
                            f"is the prefix that both .bin and .idx extend)")
    if args.tokenizer_type in ("SentencePieceTokenizer", "GPTSentencePieceTokenizer",
                               "Llama2Tokenizer", "HuggingFaceTokenizer", "TikTokenizer") \
            and not args.mock_data:
        if args.tokenizer_model is None:
            raise ValueError(f"--tokenizer-type {args.tokenizer_type} needs --tokenizer-model")
        if not os.path.exists(args.tokenizer_model):
            raise ValueError(f"--tokenizer-model: {args.tokenizer_model} does not exist")
    for flag in ("vocab_file", "merge_file"):
        path = getattr(args, flag)
        if path is not None and not os.path.isfile(path):
            raise ValueError(f"--{flag.replace('_', '-')}: {path} does not exist")
    if args.load is not None and os.path.exists(args.load) and not os.path.isdir(args.load):
        raise ValueError(f"--load: {args.load} is not a directory")
    return args


def _validate_model_impl_args(args):
    """--transformer-impl / --attention-backend / position-embedding forms, as Megatron resolves them."""
    te = _transformer_engine_available()
    if args.transformer_impl is None:
        args.transformer_impl = "transformer_engine" if te else "local"
    if args.transformer_impl == "inference_optimized":
        raise ValueError("--transformer-impl inference_optimized is refused: Megatron's "
                         "inference-only layers; training needs local or transformer_engine")
    if args.transformer_impl == "transformer_engine" and not te:
        raise ValueError("--transformer-impl transformer_engine needs Transformer Engine and CUDA "
                         "(not available here); use --transformer-impl local")
    if args.attention_backend == "fused" and args.transformer_impl != "transformer_engine":
        raise ValueError("--attention-backend fused needs --transformer-impl transformer_engine "
                         "(Transformer Engine's cuDNN attention); with --transformer-impl local "
                         "use --attention-backend flash (torch SDPA) or local|unfused|auto")
    if args.context_parallel_size > 1 and args.transformer_impl == "local":
        raise ValueError(f"--transformer-impl local needs --context-parallel-size 1 (got "
                         f"{args.context_parallel_size}); megatron-core's local attention and this "
                         f"package's SDPA one have no context parallelism (Transformer Engine's has)")
    if args.use_rotary_position_embeddings:
        args.position_embedding_type = "rope"
    if not args.add_position_embedding and args.position_embedding_type != "rope":
        raise ValueError("--no-position-embedding is deprecated in Megatron and accepted only with "
                         "--position-embedding-type rope; use --position-embedding-type none|rope")
    if args.overlap_param_gather and not args.use_distributed_optimizer:
        raise ValueError("--overlap-param-gather needs --use-distributed-optimizer (Megatron's "
                         "rule: parameters are gathered only from distributed-optimizer shards)")
    if not 0.0 < args.rotary_percent <= 1.0:
        raise ValueError(f"--rotary-percent ({args.rotary_percent}) must be in (0, 1]")


def _transformer_engine_available():
    from megatron_moe.models.builder import have_transformer_engine

    return have_transformer_engine()


def _prefixes(values):
    """Data prefixes from a --data-path list (weights are numbers, prefixes are not)."""
    if not values:
        return []
    out = []
    for value in values:
        try:
            float(value)
        except ValueError:
            out.append(value)
    return out


def _cuda_available():
    import torch

    return torch.cuda.is_available()
