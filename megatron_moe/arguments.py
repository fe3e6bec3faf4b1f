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

# the --tokenizer-type values that read a --tokenizer-model file
TOKENIZERS_WITH_MODEL = ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer",
                         "HuggingFaceTokenizer", "TikTokenizer")


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
    _add_megatron_ci_args(p)
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
    from megatron_moe.flags import add_megatron_argument

    add_megatron_argument(
        g, "--cp-comm-type",
        help="Context-parallel attention's communication (Transformer Engine's names): p2p, "
             "all_gather, a2a; one for all layers or one per layer. --transformer-impl local "
             "computes every one by all-gather (same result; docs/gpu.md).")
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
    g.add_argument("--num-layers", type=int, default=None,
                   help="Required unless --pipeline-model-parallel-layout defines the layers.")
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
    from megatron_moe.flags import add_megatron_argument

    add_megatron_argument(g, "--moe-shared-expert-overlap",
                          help="Run the shared experts in pieces inside the alltoall dispatcher, "
                               "on a side CUDA stream, while the tokens are exchanged "
                               "(megatron-core's SharedExpertMLP overlap).")
    g.add_argument("--moe-router-topk", type=int, default=2)
    g.add_argument("--moe-apply-probs-on-input", action="store_true",
                   help="Scale each token by its router probability before the expert instead of "
                        "its output (top-1 only; megatron-core moe_apply_probs_on_input).")
    g.add_argument("--moe-layer-freq", type=_layer_freq, default=1,
                   help="int N (every Nth layer is MoE) or a list such as '[1,0,1,0]'.")
    # one type and coefficient, or several paired in order (Megatron-LM: nargs '+', e.g.
    # "seq_aux_loss global_aux_loss" with "1e-3 1e-4"); megatron-core takes either form
    g.add_argument("--moe-router-load-balancing-type", nargs="+", default="aux_loss",
                   choices=["aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn",
                            "quantile_balancing", "none"])
    g.add_argument("--moe-aux-loss-coeff", type=float, nargs="+", default=0.0)
    g.add_argument("--moe-router-quantile-balancing-ema", type=float, default=0.0,
                   help="quantile_balancing: EMA of the per-expert bias across global batches "
                        "(megatron-core >= 0.19; 0 = the latest batch's quantile).")
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
    g.add_argument("--moe-router-force-biased", type=float, default=None, metavar="STD",
                   help="Benchmarking only (megatron-core >= 0.19): add a random per-expert bias "
                        "of standard deviation |STD| to the router logits, the same on every "
                        "rank; negative: drawn once per layer and kept (a fixed skew). Skewed "
                        "expert load for measuring the balance policies.")
    from megatron_moe.flags import add_megatron_argument

    add_megatron_argument(
        g, "--moe-enable-routing-replay",
        help="Give each router megatron-core's RouterReplay (TransformerConfig "
             "moe_enable_routing_replay): a program (an RL loop, a debugger) can record the top-k "
             "choices and replay them in later forward/backward passes "
             "(megatron.core.transformer.moe.router_replay). Training alone routes as without it.")
    g.add_argument("--moe-grouped-gemm", action="store_true")
    g.add_argument("--moe-per-layer-logging", action="store_true")


def _add_training_args(p):
    g = p.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, required=True)
    g.add_argument("--global-batch-size", type=int, default=None,
                   help="Default: micro batch size x data-parallel size.")
    g.add_argument("--train-iters", type=int, default=None)
    g.add_argument("--train-samples", type=int, default=None)
    g.add_argument("--decrease-batch-size-if-needed", action="store_true",
                   help="Run each iteration's global batch rounded down to a multiple of "
                        "--micro-batch-size x data-parallel size; the rest is counted as "
                        "skipped samples.")
    g.add_argument("--rampup-batch-size", nargs=3, type=int, default=None,
                   metavar=("START", "INCREMENT", "SAMPLES"),
                   help="Grow the global batch from START by INCREMENT up to --global-batch-size "
                        "over SAMPLES consumed samples (megatron-core's calculator; needs "
                        "--train-samples).")
    from megatron_moe.flags import add_megatron_argument

    add_megatron_argument(
        g, "--step-batch-size-schedule", metavar="TOKENS:BATCH ...",
        help="The global batch as a step function of the tokens consumed, e.g. '0:8 1M:16' "
             "(K/M/B/T suffixes; megatron-core >= 0.19's calculator, thresholds in tokens as "
             "Megatron-LM passes --seq-length). Excludes --global-batch-size, "
             "--rampup-batch-size and --decrease-batch-size-if-needed.")
    add_megatron_argument(
        g, "--empty-unused-memory-level",
        help="Return the CUDA caching allocator's unused blocks to the device: 1 after each "
             "forward-backward and evaluation step, 2 also after each optimizer step (Megatron-LM's "
             "points; a CPU has no cache).")
    g.add_argument("--exit-interval", type=int, default=None,
                   help="Stop (and save) when iteration %% interval == 0.")
    g.add_argument("--exit-signal-handler", action="store_true",
                   help="On SIGTERM, save a checkpoint and exit.")
    # Megatron's choices: an unsupported optimizer gets the one-line refusal of
    # _validate_optimizer_choice, never argparse's "invalid choice"
    g.add_argument("--optimizer", default="adam",
                   choices=["adam", "sgd", "muon", "dist_muon", "lion", "soap", "adaptive_muon"])
    g.add_argument("--lr", type=float, default=None)
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument("--decoupled-lr", type=float, default=None,
                   help="Separate peak LR for the input embedding and output layer.")
    g.add_argument("--decoupled-min-lr", type=float, default=None,
                   help="Their minimum LR (default --min-lr; used only with --decoupled-lr).")
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
    _add_muon_args(g)
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--bf16", action="store_true")
    g.add_argument("--fp16", action="store_true")
    from megatron_moe.flags import add_megatron_argument

    # Megatron-LM's rule: with --bf16 gradients are accumulated and reduced in fp32 (DDP
    # grad_reduce_in_fp32) unless --grad-reduce-in-bf16; with --fp16 in fp16 unless this flag
    g.add_argument("--accumulate-allreduce-grads-in-fp32", action="store_true",
                   help="Accumulate and all-reduce gradients in fp32 (always with --bf16 unless "
                        "--grad-reduce-in-bf16; with --fp16 only when given).")
    add_megatron_argument(g, "--grad-reduce-in-bf16",
                          help="With --bf16: accumulate and reduce gradients in bf16 (DDP "
                               "grad_reduce_in_fp32=False; main_grad is bf16).")
    add_megatron_argument(g, "--ddp-average-in-collective",
                          help="Average gradients in the data-parallel collective (ReduceOp.AVG) "
                               "instead of scaling them by 1/DP before a sum.")
    # gradient buckets (reduced one by one as their gradients are ready with --overlap-grad-reduce)
    add_megatron_argument(g, "--ddp-bucket-size",
                          help="Elements per gradient bucket with --overlap-grad-reduce (default: "
                               "megatron-core's, max(40M, 1M x data-parallel size)).")
    add_megatron_argument(g, "--ddp-num-buckets",
                          help="Gradient buckets: this rank's parameters // N elements each "
                               "(not with --ddp-bucket-size).")
    add_megatron_argument(g, "--ddp-reduce-scatter-with-fp32-accumulation",
                          help="With --use-distributed-optimizer: reduce-scatter gradients as an "
                               "all-to-all of their 16-bit values, summed locally in fp32 "
                               "(megatron-core's).")
    add_megatron_argument(g, "--ddp-pad-buckets-for-high-nccl-busbw",
                          help="Pad gradient buckets to sizes that keep NCCL's bus bandwidth high.")
    g.add_argument("--main-grads-dtype", default="fp32",
                   help="dtype of the main gradients: fp32 (bf16 is refused).")
    g.add_argument("--loss-scale", type=float, default=None)
    g.add_argument("--initial-loss-scale", type=float, default=2 ** 32)
    # fp16 dynamic loss scaling (megatron-core's DynamicGradScaler, Megatron-LM's defaults): the
    # scale doubles after --loss-scale-window clean iterations, halves after --hysteresis
    # overflows in a row, never below --min-loss-scale
    g.add_argument("--min-loss-scale", type=float, default=1.0)
    g.add_argument("--loss-scale-window", type=float, default=1000)
    g.add_argument("--hysteresis", type=int, default=2)
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
                   help="Do not validate the loss and grads for NaN/Inf (--rerun-mode) nor stop on a "
                        "NaN/Inf loss.")


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
    from megatron_moe.data import sampler

    sampler.add_arguments(g)   # --dataloader-type, --no-data-sharding


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
    g.add_argument("--ckpt-format", default="torch_dist",
                   choices=["torch", "torch_dist", "torch_dcp", "fsdp_dtensor"],
                   help="torch_dist, or fsdp_dtensor with --use-megatron-fsdp; the others are "
                        "refused with one line.")
    g.add_argument("--ckpt-step", type=int, default=None,
                   help="Load this iteration from --load instead of the tracker's.")
    g.add_argument("--exit-on-missing-checkpoint", action="store_true",
                   help="With --load: exit (status 0, as Megatron-LM) instead of starting from "
                        "scratch when --load holds no checkpoint.")
    g.add_argument("--async-save", action="store_true",
                   help="Write checkpoint shards in the background (megatron-core's async save).")
    g.add_argument("--auto-detect-ckpt-format", action="store_true")
    g.add_argument("--use-checkpoint-opt_param-scheduler", "--use-checkpoint-opt-param-scheduler",
                   action="store_true",
                   dest="use_checkpoint_opt_param_scheduler")
    g.add_argument("--override-opt_param-scheduler", "--override-opt-param-scheduler",
                   action="store_true",
                   dest="override_opt_param_scheduler")
    from megatron_moe.flags import add_megatron_argument as add

    add(g, "--pretrained-checkpoint",
        help="Directory containing a pretrained model checkpoint for finetuning: loaded when "
             "--load holds no checkpoint, weights only (as --finetune: iteration 0, no optimizer, "
             "scheduler or RNG state).")
    add(g, "--use-checkpoint-args",
        help="Take the model flags (Megatron-LM's list) from the checkpoint under "
             "--pretrained-checkpoint, then --load: they override this command line's; "
             "--num-layers, --hidden-size, --seq-length, ... fill only what is not given.")
    add(g, "--no-use-tokenizer-model-from-checkpoint-args",
        help="With --use-checkpoint-args: keep this command line's --tokenizer-type and "
             "--tokenizer-model (by default the checkpoint's).")
    add(g, "--use-mp-args-from-checkpoint-args",
        help="With --use-checkpoint-args: the tensor, pipeline (and virtual pipeline) and expert "
             "model-parallel sizes are the checkpoint's too (Megatron-LM's list).")


def _add_logging_args(p):
    g = p.add_argument_group("logging")
    g.add_argument("--log-interval", type=int, default=100)
    g.add_argument("--eval-interval", type=int, default=1000)
    g.add_argument("--eval-iters", type=int, default=100)
    g.add_argument("--iterations-to-skip", type=int, nargs="+", default=[],
                   help="Iterations (1-based) whose batch is read and dropped: no forward, "
                        "backward or optimizer step (e.g. a batch that spiked the loss).")
    g.add_argument("--eval-micro-batch-size", type=int, default=None,
                   help="Micro-batch size of evaluation (default: --micro-batch-size).")
    g.add_argument("--eval-global-batch-size", type=int, default=None,
                   help="Samples per evaluation iteration (default: --global-batch-size).")
    g.add_argument("--skip-train", action="store_true",
                   help="No training iterations: evaluate on the validation and test sets, exit.")
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
    """Parse and validate. ``extra_args_provider(parser)`` adds an entry point's flags; it may
    set ``parser.validate_extra_args(args)`` (ValueError naming the flag) to check them here,
    after --use-checkpoint-args filled the model's flags and before validate_args."""
    parser = build_parser(extra_args_provider)
    if args_defaults:
        parser.set_defaults(**args_defaults)
    # --use-checkpoint-args may supply the model's size: required flags are checked after it
    required = [a for a in parser._actions if a.required]
    for action in required:
        action.required = False
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
    if args.use_mp_args_from_checkpoint_args and not args.use_checkpoint_args:
        parser.error("--use-mp-args-from-checkpoint-args needs --use-checkpoint-args (it takes "
                     "the model-parallel sizes along with the checkpoint's model flags)")
    if args.use_checkpoint_args:   # Megatron-LM: before the flags are validated
        _use_checkpoint_args(args, parser)
    missing = [a.option_strings[0] for a in required if getattr(args, a.dest, None) is None]
    if missing:
        parser.error(f"the following arguments are required: {', '.join(missing)}")
    validate_extra = getattr(parser, "validate_extra_args", None)   # an entry point's own flags
    if validate_extra is not None:
        try:
            validate_extra(args)
        except ValueError as exc:
            parser.error(str(exc))
    # the error for a world size that the parallel sizes do not divide names where it came from
    args.world_size_source = env.source if world_size is None else None
    try:
        validate_args(args, check_data_paths=check_data_paths)
    except ValueError as exc:
        parser.error(str(exc))
    finally:
        del args.world_size_source
    try:
        validate_megatron_ci_args(args)
        validate_extension_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    try:  # megatron-core's own consistency checks, still before any process group starts
        from megatron_moe.models.builder import transformer_config_from_args

        transformer_config_from_args(args)
    except (AssertionError, ValueError) as exc:
        parser.error(f"invalid model configuration: {exc}")
    return args


def _use_checkpoint_args(args, parser):
    """--use-checkpoint-args (megatron_moe/training/checkpoint_args.py); rank 0 says what the
    checkpoint set, as Megatron-LM does."""
    from megatron_moe.training.checkpoint_args import load_args_from_checkpoint

    try:
        applied = load_args_from_checkpoint(args)
    except ValueError as exc:
        parser.error(str(exc))
    if args.rank == 0:
        for ckpt, changed in applied:
            values = ", ".join(f"{k} {a} -> {b}" for k, (a, b) in changed.items())
            print(f"> --use-checkpoint-args: {ckpt} set {values or 'no flag (all equal)'}",
                  flush=True)


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
    _resolve_virtual_pipeline(args)   # --pipeline-model-parallel-layout / virtual stages (may set num_layers)
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
    if not training:   # a forward pass runs no batch schedule
        args.step_batch_size_schedule = None
    _validate_step_batch_schedule(args)   # before --global-batch-size gets its default
    if args.global_batch_size is None:
        args.global_batch_size = args.micro_batch_size * args.data_parallel_size
    if args.global_batch_size % (args.micro_batch_size * args.data_parallel_size) != 0 and \
            not args.decrease_batch_size_if_needed:
        raise ValueError(
            f"--global-batch-size ({args.global_batch_size}) must be a multiple of "
            f"--micro-batch-size ({args.micro_batch_size}) x data-parallel size "
            f"({args.data_parallel_size}) (or pass --decrease-batch-size-if-needed)")
    if args.global_batch_size < args.micro_batch_size * args.data_parallel_size:
        raise ValueError(
            f"--global-batch-size ({args.global_batch_size}) is smaller than --micro-batch-size "
            f"({args.micro_batch_size}) x data-parallel size ({args.data_parallel_size})")
    # micro-batches per iteration at --global-batch-size (after any ramp-up)
    args.num_microbatches = args.global_batch_size // (args.micro_batch_size * args.data_parallel_size)
    # evaluation's batch (Megatron-LM: its own flags, defaulting to training's)
    if args.eval_micro_batch_size is None:
        args.eval_micro_batch_size = args.micro_batch_size
    if args.eval_global_batch_size is None:   # training's, in whole micro-batches (as it runs
        # under --decrease-batch-size-if-needed)
        args.eval_global_batch_size = args.num_microbatches * args.micro_batch_size * \
            args.data_parallel_size
    eval_step = args.eval_micro_batch_size * args.data_parallel_size
    if args.eval_micro_batch_size < 1 or args.eval_global_batch_size % eval_step != 0 or \
            args.eval_global_batch_size < eval_step:
        raise ValueError(
            f"--eval-global-batch-size ({args.eval_global_batch_size}) must be a positive multiple "
            f"of --eval-micro-batch-size ({args.eval_micro_batch_size}) x data-parallel size "
            f"({args.data_parallel_size})")
    args.eval_num_microbatches = args.eval_global_batch_size // eval_step
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
    if args.fp16 and args.loss_scale is None and args.check_for_nan_in_loss:
        # Megatron-LM's rule: under dynamic loss scaling a NaN/Inf gradient is the scaler's signal
        # (the step is skipped and the scale backs off), not a fault for result validation
        args.check_for_nan_in_loss = False
        if getattr(args, "rank", 0) == 0:
            print("WARNING: Setting args.check_for_nan_in_loss_and_grad to False since dynamic "
                  "loss scaling is being used", flush=True)
    if args.main_grads_dtype != "fp32":
        raise ValueError(f"--main-grads-dtype {args.main_grads_dtype}: only fp32 (gradients are "
                         "accumulated and reduced in fp32 here)" + (
                             "" if args.main_grads_dtype == "bf16" else "; Megatron's choices: fp32, bf16"))
    # Megatron-LM's rule: --bf16 accumulates and reduces in fp32 unless --grad-reduce-in-bf16;
    # --fp16 in the parameters' fp16 unless --accumulate-allreduce-grads-in-fp32 (fp32 parameters'
    # gradients are fp32 either way)
    if args.bf16:
        args.accumulate_allreduce_grads_in_fp32 = not args.grad_reduce_in_bf16
    if args.ddp_num_buckets is not None and (args.ddp_bucket_size is not None
                                             or args.ddp_num_buckets <= 0):
        raise ValueError("--ddp-num-buckets: " + (
            "cannot be used with --ddp-bucket-size (Megatron-LM's rule)"
            if args.ddp_bucket_size is not None else "must be greater than 0"))
    if args.ddp_reduce_scatter_with_fp32_accumulation and (
            not args.use_distributed_optimizer
            or getattr(args, "num_distributed_optimizer_instances", 1) > 1):
        raise ValueError("--ddp-reduce-scatter-with-fp32-accumulation needs "
                         "--use-distributed-optimizer with one optimizer instance (it replaces "
                         "that optimizer's reduce-scatter; megatron-core's rule)")
    if args.ddp_bucket_size is not None and args.ddp_bucket_size <= 0:
        raise ValueError("--ddp-bucket-size: must be greater than 0 (elements per gradient bucket)")
    if args.ddp_average_in_collective and getattr(args, "calculate_per_token_loss", False):
        raise ValueError("--ddp-average-in-collective cannot be used with "
                         "--calculate-per-token-loss (megatron-core's DDP: the per-token loss "
                         "sums gradients)")
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
        for dest in ("moe_router_load_balancing_type", "moe_aux_loss_coeff"):
            value = getattr(args, dest)
            if isinstance(value, list) and len(value) == 1:   # Megatron-LM's validate_args
                setattr(args, dest, value[0])
        kinds, coeffs = args.moe_router_load_balancing_type, args.moe_aux_loss_coeff
        if isinstance(kinds, list) and (not isinstance(coeffs, list) or len(coeffs) != len(kinds)):
            raise ValueError(f"--moe-aux-loss-coeff needs one value per "
                             f"--moe-router-load-balancing-type ({len(kinds)}: {' '.join(kinds)}), "
                             f"got {coeffs}")
        if "quantile_balancing" in (kinds if isinstance(kinds, list) else [kinds]):
            from megatron_moe.compat.versions import mcore_at_least, megatron_core_version

            if not mcore_at_least("0.19"):
                raise ValueError(f"--moe-router-load-balancing-type quantile_balancing needs "
                                 f"megatron-core >= 0.19; installed {megatron_core_version()}")
        if args.moe_router_force_biased is not None:
            from megatron_moe.compat.versions import mcore_at_least, megatron_core_version

            if not mcore_at_least("0.19"):   # its router applies the bias (TopKRouter.forward)
                raise ValueError(f"--moe-router-force-biased needs megatron-core >= 0.19; "
                                 f"installed {megatron_core_version()}")
        if args.moe_apply_probs_on_input and args.moe_router_topk != 1:
            raise ValueError(f"--moe-apply-probs-on-input needs --moe-router-topk 1, got "
                             f"{args.moe_router_topk} (megatron-core applies one probability "
                             f"per token)")
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
        if args.moe_shared_expert_overlap and (args.moe_shared_expert_intermediate_size is None
                                               or args.moe_token_dispatcher_type != "alltoall"):
            raise ValueError("--moe-shared-expert-overlap needs shared experts "
                             "(--moe-shared-expert-intermediate-size) and "
                             "--moe-token-dispatcher-type alltoall (the dispatcher that runs "
                             "them between its exchanges)")
        if args.moe_token_dispatcher_type == "flex" and not _cuda_available():
            raise ValueError("--moe-token-dispatcher-type flex needs CUDA and DeepEP/HybridEP")
    if tp == 1 and args.sequence_parallel:
        args.sequence_parallel = False  # Megatron does the same: SP is meaningless without TP
    # training length and schedule
    if args.train_iters is None and args.train_samples is None:
        raise ValueError("one of --train-iters or --train-samples is required")
    if args.train_iters is not None and args.train_samples is not None:
        raise ValueError("--train-iters and --train-samples are mutually exclusive")
    if args.lr is None:
        raise ValueError("--lr is required")
    if args.min_lr > args.lr:
        raise ValueError(f"--min-lr ({args.min_lr}) is larger than --lr ({args.lr})")
    if args.decoupled_lr is not None:
        decoupled_min = args.min_lr if args.decoupled_min_lr is None else args.decoupled_min_lr
        if decoupled_min > args.decoupled_lr:
            raise ValueError(f"--decoupled-min-lr ({decoupled_min}"
                             f"{'; --min-lr' if args.decoupled_min_lr is None else ''}) is larger "
                             f"than --decoupled-lr ({args.decoupled_lr})")
    if getattr(args, "override_opt_param_scheduler", False) and \
            getattr(args, "use_checkpoint_opt_param_scheduler", False):
        raise ValueError("--override-opt_param-scheduler (this command line's schedule) and "
                         "--use-checkpoint-opt_param-scheduler (the checkpoint's) exclude "
                         "each other")
    if not training:   # a forward pass runs no batch schedule (generate.py may take the
        args.rampup_batch_size = None   # training run's flags from its checkpoint)
    _validate_lr_schedule(args)   # iteration- or sample-based, as Megatron computes it
    from megatron_moe.data import sampler

    sampler.validate_args(args)   # --dataloader-type
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
    if args.tokenizer_type in TOKENIZERS_WITH_MODEL and not args.mock_data:
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
    if training and args.pretrained_checkpoint is not None:
        from megatron_moe.training.checkpoint_args import has_checkpoint

        if not has_checkpoint(args.load) and not has_checkpoint(args.pretrained_checkpoint):
            raise ValueError(f"--pretrained-checkpoint: no checkpoint under "
                             f"{args.pretrained_checkpoint} (no latest_checkpointed_iteration.txt)"
                             f"{'' if args.load is None else ' nor under --load ' + args.load}")
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
    if args.use_rotary_position_embeddings:
        args.position_embedding_type = "rope"
    if not args.add_position_embedding and args.position_embedding_type != "rope":
        raise ValueError("--no-position-embedding is deprecated in Megatron and accepted only with "
                         "--position-embedding-type rope; use --position-embedding-type none|rope")
    if args.overlap_param_gather and not (args.use_distributed_optimizer
                                          or args.use_megatron_fsdp):
        raise ValueError("--overlap-param-gather needs --use-distributed-optimizer or "
                         "--use-megatron-fsdp (Megatron's rule: parameters are gathered only "
                         "from their shards)")
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


# --- Megatron-LM's CI-config flags (its MoE functional tests set them on every run) -----------------
# Housekeeping, determinism, parallel mapping and model options that megatron-core implements:
# each is defined with Megatron's shape (flags.add_megatron_argument) and handed to megatron-core
# where it acts (runtime/initialize.py, models/builder.py, training/checkpointing.py).

def _add_megatron_ci_args(p):
    from megatron_moe.flags import add_megatron_argument as add

    g = p.add_argument_group("Megatron-LM housekeeping and determinism")
    add(g, "--deterministic-mode",
        help="Deterministic algorithms (torch.use_deterministic_algorithms) and Megatron's "
             "environment (NCCL_ALGO=Ring, NVTE_ALLOW_NONDETERMINISTIC_ALGO=0, "
             "CUBLAS_WORKSPACE_CONFIG=:4096:8); megatron-core's deterministic_mode.")
    add(g, "--dist-ckpt-strictness",
        help="megatron-core's StrictHandling of unexpected/missing keys at load.")
    add(g, "--use-persistent-ckpt-worker",
        help="--async-save writes through one persistent worker process (megatron-core).")
    add(g, "--dist-ckpt-optim-fully-reshardable",
        help="Always the case here: the distributed optimizer is saved fully reshardable.")
    add(g, "--async-ckpt-use-cpu-shm",
        help="--async-save stages GPU tensors in CPU shared memory (megatron-core >= 0.19; "
             "host tensors need no staging).")
    add(g, "--verify-integrity",
        help="Write a per-file hash manifest at save and re-hash at load (megatron-core >= 0.19).")
    add(g, "--save-retain-interval",
        help="Checkpoints at multiples of N are kept; every other one is deleted once a newer "
             "one is complete and named by the tracker (Megatron-LM's rule).")
    add(g, "--log-progress",
        help="Append job start, checkpoint saves (throughput, FLOPs, tokens) and deletions to "
             "<save>/progress.txt.")
    add(g, "--no-create-attention-mask-in-dataloader",
        help="GPT data: no [s, s] attention mask per sample; the attention's own causal mask.")
    add(g, "--disable-gloo-process-groups",
        help="NCCL runs: megatron-core creates no Gloo copies of its process groups.")
    g = p.add_argument_group("Megatron-LM parallel mapping")
    add(g, "--num-distributed-optimizer-instances",
        help="Distributed-optimizer shards replicated over N instances (megatron-core).")
    add(g, "--use-tp-pp-dp-mapping",
        help="Rank order tp-cp-ep-pp-dp instead of tp-cp-ep-dp-pp.")
    add(g, "--pipeline-model-parallel-layout",
        help="Layers per (virtual) pipeline stage, e.g. 'Et*3|(tt|)*6mL' (E embedding, t layer, "
             "m MTP, L loss, | stage boundary); defines --num-layers and the virtual stages.")
    add(g, "--num-virtual-stages-per-pipeline-rank",
        help="Virtual pipeline stages (model chunks) per rank: megatron-core's interleaved 1F1B.")
    add(g, "--num-layers-per-virtual-pipeline-stage",
        help="Layers per virtual pipeline stage (the other way to ask for the interleaved schedule).")
    add(g, "--decoder-first-pipeline-num-layers",
        help="Transformer layers on the first pipeline stage (default: an even split); the rest "
             "split evenly over the other stages (megatron-core's uneven pipeline).")
    add(g, "--decoder-last-pipeline-num-layers",
        help="Transformer layers on the last pipeline stage (default: an even split).")
    add(g, "--account-for-embedding-in-pipeline-split",
        help="Count the embedding as one layer of the first pipeline stage when splitting "
             "(it builds one transformer layer fewer).")
    add(g, "--account-for-loss-in-pipeline-split",
        help="Count the output layer and loss as one layer of the last pipeline stage when "
             "splitting (it builds one transformer layer fewer).")
    g2 = p.add_argument_group("Megatron-LM sample-based and WSD schedules")
    add(g2, "--lr-decay-samples", help="Samples to decay the LR over (default --train-samples).")
    add(g2, "--lr-warmup-samples", help="Samples of linear LR warmup.")
    add(g2, "--lr-wsd-decay-samples", help="Samples of the WSD schedule's decay phase.")
    add(g2, "--lr-wsd-decay-iters", help="Iterations of the WSD schedule's decay phase.")
    add(g2, "--lr-wsd-decay-style", help="Shape of the WSD decay phase.")
    add(g, "--check-weight-hash-across-dp-replicas-interval",
        help="Every N iterations, assert parameters are bit-identical across data-parallel "
             "replicas (megatron-core's check_param_hashes_across_dp_replicas).")
    g = p.add_argument_group("Megatron-LM model options (megatron-core TransformerConfig)")
    add(g, "--padded-vocab-size",
        help="The embedding's row count as given (no --make-vocab-size-divisible-by padding).")
    add(g, "--rotary-seq-len-interpolation-factor",
        help="RoPE position interpolation: positions divided by this factor (megatron-core "
             "GPTModel seq_len_interpolation_factor).")
    add(g, "--trust-remote-code",
        help="HuggingFaceTokenizer: let transformers run the tokenizer directory's own code.")
    add(g, "--calculate-per-token-loss",
        help="Loss summed over tokens and divided by the global token count, not averaged per "
             "micro-batch.")
    add(g, "--apply-query-key-layer-scaling",
        help="Scale Q.K^T by 1/layer number (fp16); implies --attention-softmax-in-fp32.")
    add(g, "--recompute-modules",
        help="Selective recompute of these submodules (core_attn, moe_act, layernorm, "
             "mla_up_proj, mlp, moe, shared_experts).")
    add(g, "--moe-layer-recompute",
        help="Deprecated Megatron form of --recompute-modules moe (selective).")
    add(g, "--overlap-moe-expert-parallel-comm",
        help="megatron-core's EP all-to-all overlap (combined 1F1B schedule on CUDA streams).")
    g = p.add_argument_group("GPU-only Megatron-LM features (megatron-core TransformerConfig; "
                             "refused on a CPU)")
    for flag, (_, reason) in GPU_ONLY_FLAGS.items():
        add(g, flag, help=f"GPU only, handed to megatron-core: {reason}.")


# flag -> (TransformerConfig field its dest fills, why it cannot run on a CPU). On a GPU the value
# reaches megatron-core's TransformerConfig by name (models/builder.py); unverified on a GPU here.
GPU_ONLY_FLAGS = {
    "--fp8-format": ("fp8", "FP8 GEMMs are Transformer Engine kernels (Hopper/Blackwell)"),
    "--fp8-recipe": ("fp8_recipe", "FP8 scaling recipes are Transformer Engine's"),
    "--first-last-layers-bf16": ("first_last_layers_bf16",
                                 "an FP8 option (Transformer Engine kernels)"),
    "--cuda-graph-impl": ("cuda_graph_impl", "CUDA graphs capture CUDA kernels"),
    "--cuda-graph-modules": ("cuda_graph_modules", "CUDA graphs capture CUDA kernels"),
    "--cuda-graph-warmup-steps": ("cuda_graph_warmup_steps", "CUDA graphs capture CUDA kernels"),
    "--delay-wgrad-compute": ("delay_wgrad_compute",
                              "Transformer Engine's split weight-gradient GEMMs"),
    "--use-transformer-engine-op-fuser": ("use_transformer_engine_op_fuser",
                                          "Transformer Engine's operation fuser"),
    "--fine-grained-activation-offloading": ("fine_grained_activation_offloading",
                                             "activations offload to host over CUDA streams"),
    "--offload-modules": ("offload_modules", "activations offload to host over CUDA streams"),
}


def validate_megatron_ci_args(args):
    """Checks of the flags above, before any process group starts (ValueError names the flag)."""
    _validate_determinism(args)
    _validate_checkpoint_housekeeping(args)
    _validate_mask_and_gloo_groups(args)
    _validate_parallel_mapping(args)
    _validate_model_options(args)
    _validate_context_parallel(args)
    _validate_optimizer_choice(args)
    _validate_gpu_only(args)
    if args.ckpt_format not in ("torch_dist", "fsdp_dtensor"):   # fsdp_dtensor: Megatron-FSDP's
        raise ValueError(f"--ckpt-format {args.ckpt_format} is refused: checkpoints here are "
                         f"megatron-core's torch_dist, or fsdp_dtensor with --use-megatron-fsdp "
                         f"(torch/torch_dcp belong to Megatron's legacy loaders)")


def _validate_determinism(args):
    if not args.deterministic_mode:
        return
    if getattr(args, "cross_entropy_loss_fusion", False):
        raise ValueError("--deterministic-mode needs --cross-entropy-loss-fusion off (Megatron's rule)")
    from megatron_moe.runtime.determinism import check_environment

    check_environment(os.environ)


def _validate_mask_and_gloo_groups(args):
    if args.reset_attention_mask and not args.create_attention_mask_in_dataloader:
        # Megatron-LM's get_ltor_masks_and_position_ids asserts the same
        raise ValueError("--reset-attention-mask edits the dataloader's attention mask, which "
                         "--no-create-attention-mask-in-dataloader turns off")
    if not args.use_gloo_process_groups and args.distributed_backend == "gloo":
        raise ValueError("--disable-gloo-process-groups needs --distributed-backend nccl: on a "
                         "gloo run every process group is a Gloo group")


def _validate_checkpoint_housekeeping(args):
    from megatron_moe.compat import checkpoint_options as ckpt_compat

    retain = args.save_retain_interval
    if args.save is not None and retain is not None and (retain <= 0 or retain % args.save_interval):
        raise ValueError(f"--save-retain-interval {retain} must be a positive multiple of "
                         f"--save-interval {args.save_interval}")

    if args.verify_integrity and not ckpt_compat.HAS_INTEGRITY_MANIFEST:
        raise ValueError(f"--verify-integrity needs megatron-core >= 0.19 (its checkpoint integrity "
                         f"manifest); installed {ckpt_compat.MCORE_VERSION}")
    if args.async_ckpt_use_cpu_shm and not ckpt_compat.HAS_CPU_SHM and _cuda_available():
        raise ValueError(f"--async-ckpt-use-cpu-shm needs megatron-core >= 0.19 on a GPU; installed "
                         f"{ckpt_compat.MCORE_VERSION}")


def _validate_parallel_mapping(args):
    n = args.num_distributed_optimizer_instances
    if n < 1:
        raise ValueError(f"--num-distributed-optimizer-instances must be >= 1 (got {n})")
    if n > 1:
        if not args.use_distributed_optimizer:
            raise ValueError("--num-distributed-optimizer-instances > 1 needs "
                             "--use-distributed-optimizer")
        if args.data_parallel_size % n != 0:
            raise ValueError(f"--num-distributed-optimizer-instances ({n}) must divide the "
                             f"data-parallel size ({args.data_parallel_size})")
    interval = args.check_weight_hash_across_dp_replicas_interval
    if interval is not None and interval < 1:
        raise ValueError("--check-weight-hash-across-dp-replicas-interval must be >= 1")


# Transformer Engine's context-parallel communication types (megatron-core TransformerConfig
# cp_comm_type; Megatron-LM's help spells all_gather "allgather", which TE would reject)
CP_COMM_TYPES = ("p2p", "all_gather", "a2a", "a2a+p2p")


def _validate_context_parallel(args):
    """--context-parallel-size / --cp-comm-type. Megatron-LM's rules (the sequence splits into
    2 x cp chunks; a2a+p2p needs hierarchical CP sizes, not supported here), then the attention:
    Transformer Engine's, or on the local path this package's SDPA attention (all-gather CP,
    models/attention.py); megatron-core's local attention has no context parallelism."""
    from megatron_moe.models.attention import use_sdpa

    cp, comm = args.context_parallel_size, args.cp_comm_type
    comm = [comm] if isinstance(comm, str) else list(comm)
    for kind in comm:
        if kind not in CP_COMM_TYPES:
            raise ValueError(f"--cp-comm-type {kind}: choose from {', '.join(CP_COMM_TYPES)} "
                             f"(Transformer Engine's names)")
    if len(comm) not in (1, args.num_layers):
        raise ValueError(f"--cp-comm-type takes one value or one per layer ({args.num_layers}), "
                         f"got {len(comm)}")
    if "a2a+p2p" in comm:
        raise ValueError("--cp-comm-type a2a+p2p needs --hierarchical-context-parallel-sizes, "
                         "which is not supported")
    if cp == 1:
        return
    if args.seq_length is not None and args.seq_length % (2 * cp):
        raise ValueError(f"--seq-length ({args.seq_length}) must be divisible by 2 x "
                         f"--context-parallel-size ({cp})")
    if args.transformer_impl == "local" and not use_sdpa(args):
        raise ValueError(f"--context-parallel-size {cp} with --attention-backend "
                         f"{args.attention_backend} is not supported: megatron-core's local "
                         f"attention has no context parallelism; use --attention-backend flash "
                         f"(or auto: torch SDPA with all-gather context parallelism)")


def _validate_model_options(args):
    tp = args.tensor_model_parallel_size
    if args.padded_vocab_size is not None and args.padded_vocab_size % tp:
        raise ValueError(f"--padded-vocab-size ({args.padded_vocab_size}) must be divisible by "
                         f"--tensor-model-parallel-size ({tp}) (vocab-parallel embedding)")
    if args.rotary_seq_len_interpolation_factor is not None \
            and args.rotary_seq_len_interpolation_factor < 1:
        raise ValueError("--rotary-seq-len-interpolation-factor must be >= 1")
    if args.apply_query_key_layer_scaling:
        args.attention_softmax_in_fp32 = True   # Megatron: the scaling needs the fp32 softmax
    if args.recompute_modules and args.recompute_granularity != "selective" \
            and not args.recompute_activations:
        raise ValueError("--recompute-modules needs --recompute-granularity selective")
    if args.recompute_modules and "moe_act" in args.recompute_modules and not args.moe_grouped_gemm:
        raise ValueError("--recompute-modules moe_act needs --moe-grouped-gemm (megatron-core "
                         "recomputes the expert activation only in its grouped-GEMM experts)")
    if args.overlap_moe_expert_parallel_comm and not _cuda_available():
        raise ValueError("--overlap-moe-expert-parallel-comm needs CUDA: megatron-core overlaps the "
                         "EP all-to-all with compute on a second CUDA stream (combined 1F1B schedule)")


def _add_muon_args(g):
    """Megatron-LM's --muon-* flags (its shapes and defaults), megatron-core 0.19's OptimizerConfig
    fields of the same names (megatron_moe/compat/optimizer.py hands them over)."""
    from megatron_moe.flags import add_megatron_argument as add

    for flag in ("--muon-momentum", "--muon-no-split-qkv", "--muon-nesterov", "--muon-scale-mode",
                 "--muon-fp32-matmul-prec", "--muon-coefficient-type", "--muon-num-ns-steps",
                 "--muon-tp-mode", "--muon-extra-scale-factor", "--muon-scalar-optimizer"):
        add(g, flag, help="megatron-core's Muon (--optimizer muon), as in Megatron-LM")


def _validate_optimizer_choice(args):
    args.use_layer_wise_distributed_optimizer = False
    if args.optimizer in ("adam", "sgd"):
        return
    if args.optimizer in ("muon", "dist_muon"):
        from megatron_moe.compat.optimizer import check_muon_available

        check_muon_available(args.optimizer)
        if args.fp16:
            raise ValueError(f"--optimizer {args.optimizer} does not support --fp16 "
                             f"(megatron-core's emerging optimizers: use --bf16)")
        # Megatron-LM's validate_args: dist_muon is the deprecated spelling of muon with the
        # layer-wise distributed optimizer, which --use-distributed-optimizer also selects for Muon
        if args.optimizer == "dist_muon":
            args.optimizer = "muon"
            args.use_layer_wise_distributed_optimizer = True
        if args.use_distributed_optimizer:
            args.use_layer_wise_distributed_optimizer = True
            args.use_distributed_optimizer = False
        if args.use_layer_wise_distributed_optimizer and not args.bf16:
            # its fp32 chain holds bare torch optimizers, which the schedule's loss scaling
            # (optimizer.scale_loss -> get_loss_scale) cannot call; fp16 Muon megatron-core refuses
            raise ValueError("--optimizer dist_muon (or muon with --use-distributed-optimizer) "
                             "needs --bf16: megatron-core's layer-wise distributed optimizer "
                             "wraps its optimizers for loss scaling only in bf16")
        return
    if args.optimizer in ("adaptive_muon", "lion", "soap"):
        try:
            import emerging_optimizers  # noqa: F401
        except ImportError:
            raise ValueError(f"--optimizer {args.optimizer} needs the emerging-optimizers package "
                             f"(megatron-core's Muon/Lion/SOAP; not installed here)") from None
        raise ValueError(f"--optimizer {args.optimizer} is refused: megatron-core's emerging "
                         f"optimizers are not wired into this trainer")


def _validate_gpu_only(args):
    """GPU_ONLY_FLAGS: set to other than Megatron's default, refused on a CPU with the reason;
    on a GPU, refused only when the installed megatron-core has no such config field."""
    import dataclasses

    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_moe import flags

    fields = {f.name for f in dataclasses.fields(TransformerConfig)}
    for flag, (field, reason) in GPU_ONLY_FLAGS.items():
        record = flags.all_megatron_flags()[flag]
        if getattr(args, record["dest"]) in (record["default"], None, [], False):
            continue
        if not _cuda_available():
            raise ValueError(f"{flag} needs CUDA: {reason}")
        if field not in fields:
            raise ValueError(f"{flag} needs a newer megatron-core (TransformerConfig has no "
                             f"{field} field in this release)")


def _resolve_virtual_pipeline(args):
    """Megatron's validate_args: at most one of the three ways to ask for virtual pipeline stages;
    ``args.virtual_pipeline_model_parallel_size`` (None for one chunk per rank), and with a layout
    the decoder layer count it defines."""
    layout = args.pipeline_model_parallel_layout
    per_stage = args.num_layers_per_virtual_pipeline_stage
    per_rank = args.num_virtual_stages_per_pipeline_rank
    given = [f for f, v in (("--pipeline-model-parallel-layout", layout),
                            ("--num-virtual-stages-per-pipeline-rank", per_rank),
                            ("--num-layers-per-virtual-pipeline-stage", per_stage)) if v is not None]
    if len(given) > 1:
        raise ValueError(f"{' and '.join(given)} are mutually exclusive (Megatron's rule)")
    pp = args.pipeline_model_parallel_size
    vpp = None
    if layout is not None:
        from megatron.core.transformer.enums import LayerType
        from megatron.core.transformer.pipeline_parallel_layer_layout import (
            PipelineParallelLayerLayout)

        try:
            stages = PipelineParallelLayerLayout.get_num_stages_from_str(layout)
            parsed = PipelineParallelLayerLayout.from_str(layout, pp) if stages % pp == 0 else None
        except Exception as exc:   # megatron-core's parser: any malformed string
            raise ValueError(f"--pipeline-model-parallel-layout {layout!r}: {exc}") from None
        if parsed is None:
            raise ValueError(f"--pipeline-model-parallel-layout has {stages} stages, not a multiple "
                             f"of --pipeline-model-parallel-size ({pp})")
        decoders = sum(chunk.count(LayerType.decoder) for rank in parsed.layout for chunk in rank)
        if args.num_layers is None:
            args.num_layers = decoders
        elif args.num_layers != decoders:
            raise ValueError(f"--num-layers ({args.num_layers}) differs from the "
                             f"{decoders} layers of --pipeline-model-parallel-layout")
        vpp = stages // pp
    elif per_rank is not None:
        vpp = per_rank
    elif per_stage is not None:
        uneven = [f for f, v in (("--decoder-first-pipeline-num-layers",
                                  args.decoder_first_pipeline_num_layers),
                                 ("--decoder-last-pipeline-num-layers",
                                  args.decoder_last_pipeline_num_layers)) if v is not None]
        if uneven:
            raise ValueError(f"{uneven[0]} with virtual pipeline stages needs "
                             f"--num-virtual-stages-per-pipeline-rank, not "
                             f"--num-layers-per-virtual-pipeline-stage (Megatron-LM's rule)")
        # Megatron-LM: the embedding / loss counted in the split count here too
        layers = None if args.num_layers is None else args.num_layers + \
            bool(args.account_for_embedding_in_pipeline_split) + \
            bool(args.account_for_loss_in_pipeline_split)
        if layers is None or layers % pp or (layers // pp) % per_stage:
            raise ValueError(f"--num-layers-per-virtual-pipeline-stage ({per_stage}) must divide "
                             f"the layers per pipeline stage (--num-layers / "
                             f"--pipeline-model-parallel-size)")
        vpp = layers // pp // per_stage
    if args.num_layers is None:
        raise ValueError("--num-layers is required (or --pipeline-model-parallel-layout)")
    args.virtual_pipeline_model_parallel_size = vpp if vpp and vpp > 1 else None
    if args.virtual_pipeline_model_parallel_size is not None:
        if pp == 1:
            raise ValueError(f"{given[0]} needs --pipeline-model-parallel-size > 1")
        if pp == 2 and not getattr(args, "overlap_p2p_comm", True):
            raise ValueError("virtual pipeline stages with --pipeline-model-parallel-size 2 need "
                             "p2p overlap (drop --no-overlap-p2p-communication; Megatron's rule)")
    from megatron_moe.models.pipeline_split import validate_split_args

    validate_split_args(args)   # layers per stage: even, uneven first/last, embedding/loss counted


def _validate_rampup(args) -> None:
    """--rampup-batch-size: Megatron-LM's validate_args refusal (iteration-based training), and
    what megatron-core's calculator would assert at run time: every batch of the ramp splits into
    whole micro-batches, the ramp ends at --global-batch-size."""
    if args.rampup_batch_size is None:
        return
    if args.train_samples is None:
        raise ValueError("--rampup-batch-size needs sample-based training (--train-samples), "
                         "not --train-iters")
    start, increment, samples = args.rampup_batch_size
    flag = f"--rampup-batch-size {start} {increment} {samples}"
    if start < 1 or increment < 1 or samples < 1:
        raise ValueError(f"{flag}: start batch, increment and ramp-up samples must be >= 1")
    if start >= args.global_batch_size or (args.global_batch_size - start) % increment:
        raise ValueError(f"{flag}: --global-batch-size ({args.global_batch_size}) must be the start "
                         f"batch plus a positive multiple of the increment")
    step = args.micro_batch_size * args.data_parallel_size
    if args.decrease_batch_size_if_needed:
        from megatron_moe.compat.batch_schedule import check_rampup_with_decrease

        check_rampup_with_decrease()
        if start < step:
            raise ValueError(f"{flag}: the start batch is smaller than --micro-batch-size "
                             f"({args.micro_batch_size}) x data-parallel size "
                             f"({args.data_parallel_size})")
    elif start % step or increment % step:
        raise ValueError(f"{flag}: the start batch and the increment must be multiples of "
                         f"--micro-batch-size ({args.micro_batch_size}) x data-parallel size "
                         f"({args.data_parallel_size}) (or pass --decrease-batch-size-if-needed)")
    pp = args.pipeline_model_parallel_size
    if args.virtual_pipeline_model_parallel_size is not None and start // step < pp:
        raise ValueError(f"{flag}: the start batch runs {start // step} micro-batch(es); "
                         f"megatron-core's interleaved schedule (virtual pipeline stages) needs "
                         f"at least --pipeline-model-parallel-size ({pp})")
    if getattr(args, "moe_balance_policy", "none") not in (None, "none"):
        raise ValueError(f"{flag} cannot be combined with --moe-balance-policy (its scheduler "
                         f"plans for a fixed number of micro-batches)")


def _validate_step_batch_schedule(args) -> None:
    """--step-batch-size-schedule: Megatron-LM's refusals (with --global-batch-size; megatron-core's
    with --decrease-batch-size-if-needed), the schedule parsed by megatron-core's own calculator,
    and what its consistency check would assert mid-run: every batch of the schedule splits into
    whole micro-batches over the data-parallel ranks."""
    schedule = args.step_batch_size_schedule
    if schedule is None:
        return
    from megatron_moe.compat.batch_schedule import step_schedule_batches
    from megatron_moe.compat.versions import mcore_at_least, megatron_core_version

    flag = f"--step-batch-size-schedule {schedule!r}"
    if not mcore_at_least("0.19"):
        raise ValueError(f"--step-batch-size-schedule needs megatron-core >= 0.19 (its "
                         f"step-schedule calculator); installed {megatron_core_version()}")
    for other, given in (("--global-batch-size", args.global_batch_size is not None),
                         ("--rampup-batch-size", args.rampup_batch_size is not None),
                         ("--decrease-batch-size-if-needed", args.decrease_batch_size_if_needed)):
        if given:
            raise ValueError(f"--step-batch-size-schedule and {other} exclude each other "
                             f"(Megatron-LM's rule: the schedule sets the global batch)")
    batches = step_schedule_batches(schedule, args.seq_length, args.micro_batch_size,
                                    args.data_parallel_size)
    if isinstance(batches, str):
        raise ValueError(f"{flag}: {batches}")
    step = args.micro_batch_size * args.data_parallel_size
    uneven = [b for b in batches if b % step]
    if uneven:
        raise ValueError(f"{flag}: batch {uneven[0]} is not a multiple of --micro-batch-size "
                         f"({args.micro_batch_size}) x data-parallel size "
                         f"({args.data_parallel_size})")
    pp = args.pipeline_model_parallel_size
    if args.virtual_pipeline_model_parallel_size is not None and min(batches) // step < pp:
        raise ValueError(f"{flag}: batch {min(batches)} runs {min(batches) // step} "
                         f"micro-batch(es); megatron-core's interleaved schedule (virtual "
                         f"pipeline stages) needs at least --pipeline-model-parallel-size ({pp})")
    if getattr(args, "moe_balance_policy", "none") not in (None, "none"):
        raise ValueError(f"--step-batch-size-schedule cannot be combined with "
                         f"--moe-balance-policy (its scheduler plans for a fixed number of "
                         f"micro-batches)")


def _validate_lr_schedule(args):
    """Megatron's validate_args: iteration-based and sample-based options do not mix; with
    --train-samples the run is --train-samples // --global-batch-size iterations."""
    _validate_rampup(args)
    if args.train_samples is None:
        for flag, value in (("--lr-decay-samples", args.lr_decay_samples),
                            ("--lr-wsd-decay-samples", args.lr_wsd_decay_samples)):
            if value is not None:
                raise ValueError(f"{flag} needs sample-based training (--train-samples), not "
                                 f"--train-iters")
        if args.lr_warmup_samples:
            raise ValueError("--lr-warmup-samples needs sample-based training (--train-samples)")
        if args.lr_decay_iters is None:
            args.lr_decay_iters = args.train_iters
    else:
        for flag, value in (("--lr-decay-iters", args.lr_decay_iters),
                            ("--lr-wsd-decay-iters", args.lr_wsd_decay_iters)):
            if value is not None:
                raise ValueError(f"{flag} needs iteration-based training (--train-iters); with "
                                 f"--train-samples use {flag.replace('iters', 'samples')}")
        if args.lr_warmup_iters:
            raise ValueError("--lr-warmup-iters needs iteration-based training; with "
                             "--train-samples use --lr-warmup-samples")
        if args.rampup_batch_size is not None:   # Megatron-LM's update_train_iters
            from megatron_moe.compat.batch_schedule import rampup_train_iters

            args.train_iters = rampup_train_iters(args)
        elif args.step_batch_size_schedule is not None:
            from megatron_moe.compat.batch_schedule import step_schedule_train_iters

            args.train_iters = step_schedule_train_iters(args)
        else:
            args.train_iters = args.train_samples // args.global_batch_size
        if args.lr_decay_samples is None:
            args.lr_decay_samples = args.train_samples
    if args.lr_warmup_fraction is not None and (args.lr_warmup_iters or args.lr_warmup_samples):
        raise ValueError("--lr-warmup-fraction excludes --lr-warmup-iters / --lr-warmup-samples")
    steps = lr_schedule_steps(args)
    if args.lr_decay_style != "constant" and steps["lr_warmup_steps"] >= steps["lr_decay_steps"]:
        if args.train_samples is None and args.lr_warmup_fraction is None:
            # iteration-based: name the flags and values the user gave
            raise ValueError(f"--lr-warmup-iters ({args.lr_warmup_iters}) must be smaller than "
                             f"--lr-decay-iters ({args.lr_decay_iters}; defaults to --train-iters)")
        raise ValueError(f"the LR warmup ({steps['lr_warmup_steps']} samples) must be shorter than "
                         f"the decay ({steps['lr_decay_steps']} samples): check --lr-warmup-* "
                         f"against --lr-decay-* (defaults to the run's length)")
    if args.lr_decay_style == "WSD" and steps["wsd_decay_steps"] is None:
        raise ValueError("--lr-decay-style WSD needs --lr-wsd-decay-iters (or --lr-wsd-decay-samples)")


def lr_schedule_steps(args) -> dict:
    """OptimizerParamScheduler's step counts (in samples), as Megatron-LM's
    get_optimizer_param_scheduler computes them (core_v0.19.0)."""
    gbs = args.global_batch_size
    if args.train_samples is None:
        lr_decay_steps = args.lr_decay_iters * gbs
        wd_incr_steps = args.train_iters * gbs
        wsd = args.lr_wsd_decay_iters * gbs if args.lr_wsd_decay_iters is not None else None
        warmup = (args.lr_warmup_fraction * lr_decay_steps if args.lr_warmup_fraction is not None
                  else args.lr_warmup_iters * gbs)
    else:
        lr_decay_steps = args.lr_decay_samples
        wd_incr_steps = args.train_samples
        wsd = args.lr_wsd_decay_samples
        warmup = (args.lr_warmup_fraction * lr_decay_steps if args.lr_warmup_fraction is not None
                  else args.lr_warmup_samples)
    return {"lr_warmup_steps": warmup, "lr_decay_steps": lr_decay_steps,
            "wd_incr_steps": wd_incr_steps, "wsd_decay_steps": wsd}
