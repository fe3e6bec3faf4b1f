#!/usr/bin/env python
"""Per-GPU theoretical memory of a training run from its Megatron flags (Megatron-LM's tool name).

    WORLD_SIZE=8 python tools/report_theoretical_memory.py <the pretrain_gpt_moe.py flags> \
        [--world-size N] [--gpu-memory-gb 80] [--vocab-size V]

Accepts the flags a launch script passes to pretrain_gpt_moe.py (the same parser); Megatron-LM
flags this project refuses are listed and ignored; recomputation / attention-backend /
virtual-pipeline flags are Megatron's; --qk-layernorm, --kv-channels and MLA are counted.
Prints, for the most loaded pipeline stage, the bytes of parameters, gradients, optimizer
state and activations, the model FLOPs of one iteration (the count --log-throughput uses,
megatron_moe/flops.py), then Megatron's summary line
``Theoretical memory footprints: weight and optimizer=... MB, activation=... MB, total=... MB``.
The arithmetic (docs/memory.md) is our own; it differs from Megatron-LM's
``theoretical_memory_usage.py`` in that experts are sharded by EP x ETP (not TP) and their
distributed-optimizer state by the expert-data-parallel size, and MoE activations scale with
top-k (gradients: fp32 with --bf16 and fp32 parameters, fp16 with --fp16, as DDP keeps them), and
Megatron-FSDP's ZeRO-1/2/3 shard what they shard (Megatron-LM counts them as the distributed
optimizer).
"""

from __future__ import annotations

import argparse
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from megatron_moe.flops import gated_mlp  # noqa: E402  (the one gate-factor rule)

MB = 1024 * 1024
GB = 1e9
# Allocator fragmentation, CUDA context, NCCL/communication buffers and workspace: an estimate
# "fits" a card when it stays under this share of the card minus the fixed reserve.
FIT_FRACTION = 0.9
FIT_RESERVE_GB = 3.0

# Megatron flags this tool reads that the training parser may not define (added only if absent).
_EXTRA = [
    ("--recompute-granularity", dict(default=None, choices=["full", "selective"])),
    ("--recompute-method", dict(default=None, choices=["uniform", "block"])),
    ("--recompute-num-layers", dict(type=int, default=None)),
    ("--recompute-activations", dict(action="store_true")),
    ("--virtual-pipeline-model-parallel-size", dict(type=int, default=None)),
    ("--num-layers-per-virtual-pipeline-stage", dict(type=int, default=None)),
    ("--attention-backend", dict(default="auto",
                                 choices=["auto", "flash", "fused", "unfused", "local"])),
    ("--use-flash-attn", dict(action="store_true")),
]
_OWN = [
    ("--world-size", dict(type=int, default=None,
                          help="GPUs in the run (default: $WORLD_SIZE, else 1).")),
    ("--gpu-memory-gb", dict(type=float, default=None,
                             help="Check the estimate against a card of this size (GB = 1e9 B).")),
    ("--num-microbatches", dict(type=int, default=None,
                                help="Default: global batch / (micro batch x DP).")),
]
_TOKENIZER_VOCAB = {"GPT2BPETokenizer": 50257, "BertWordPieceLowerCase": 30522,
                    "BertWordPieceCase": 28996}


def _help_parser():
    # --help must not import torch / megatron-core (the full parser's extension modules do)
    p = argparse.ArgumentParser(prog="report_theoretical_memory.py", description=__doc__.split("\n")[0],
                                epilog="Also accepts every pretrain_gpt_moe.py flag "
                                       "(python pretrain_gpt_moe.py --help).")
    for name, kw in _EXTRA + _OWN:
        p.add_argument(name, **kw)
    return p


def parse(argv):
    """(args, ignored flags): the training parser + the flags above, unknown Megatron flags kept
    aside; derived values (DP, ETP, ffn sizes, padded vocabulary) filled like training does."""
    from megatron_moe.arguments import build_parser

    def add_own(parser):  # before build_parser registers Megatron's refused/no-op flags
        have = set(parser._option_string_actions)
        for name, kw in _EXTRA + _OWN:
            if name not in have:
                parser.add_argument(name, **kw)
        return parser

    from megatron_moe import flags

    parser = build_parser(add_own, prog="report_theoretical_memory.py")
    args, unknown = parser.parse_known_args(argv)
    ignored = flags.refused_given(args) + [u for u in unknown if u.startswith("--")]
    args.world_size = args.world_size or int(os.environ.get("WORLD_SIZE", "1"))
    tp, pp, cp = (args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
                  args.context_parallel_size)
    if args.expert_tensor_parallel_size is None:
        args.expert_tensor_parallel_size = tp
    ep, etp = args.expert_model_parallel_size, args.expert_tensor_parallel_size
    for what, d in (("TP x PP x CP", tp * pp * cp), ("ETP x EP x PP", etp * ep * pp)):
        if args.world_size % d:
            parser.error(f"world size {args.world_size} is not divisible by {what} = {d} "
                         "(pass --world-size or WORLD_SIZE)")
    args.data_parallel_size = args.world_size // (tp * pp * cp)
    from megatron_moe.models.pipeline_split import validate_split_args

    try:   # the layers each stage holds (an uneven split too): checked as training checks them
        validate_split_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    if args.global_batch_size is None:
        args.global_batch_size = args.micro_batch_size * args.data_parallel_size
    if args.ffn_hidden_size is None:
        args.ffn_hidden_size = 4 * args.hidden_size
    if args.recompute_activations:
        args.recompute_granularity = "selective"
    if getattr(args, "padded_vocab_size", None) is None:
        vocab = args.vocab_size or _TOKENIZER_VOCAB.get(args.tokenizer_type)
        if vocab is None:
            vocab = 32000
            args.memory_notes = ["vocabulary size unknown for this tokenizer: 32000 assumed "
                                 "(pass --vocab-size)"]
        mult = args.make_vocab_size_divisible_by * tp
        args.padded_vocab_size = int(math.ceil(vocab / mult) * mult)
    return args, ignored


# --- parameters ------------------------------------------------------------------------------------
def _moe_pattern(args):
    L = args.num_layers
    if not args.num_experts:
        return [0] * L
    f = args.moe_layer_freq
    return list(f) if isinstance(f, list) else [1 if i % f == 0 else 0 for i in range(L)]


def _mla(args):
    return getattr(args, "multi_latent_attention", False)


def _norm_params(args, n):
    return n if args.normalization == "RMSNorm" else 2 * n


def attention_params(args):
    """(attention params sharded over TP, replicated over TP) of one layer, without biases and
    the layer's two norms. MLA (megatron-core's MLASelfAttention): q (LoRA or full), kv down
    projection to kv_lora_rank + the RoPE part, kv up projection to heads x (qk + v), output from
    heads x v; the down projections are TE's duplicated linears on GPU, column-parallel locally.
    QK-norm: per-head q/k norms, or MLA's q/kv latent norms."""
    h, a = args.hidden_size, args.num_attention_heads
    qk_norm = getattr(args, "qk_layernorm", False)
    if _mla(args):
        qh = args.qk_head_dim + args.qk_pos_emb_head_dim
        q_lora, kv_lora = args.q_lora_rank, args.kv_lora_rank
        down = h * (kv_lora + args.qk_pos_emb_head_dim) + (h * q_lora if q_lora else 0)
        shard = (q_lora * a * qh if q_lora else h * a * qh) \
            + kv_lora * a * (args.qk_head_dim + args.v_head_dim) + a * args.v_head_dim * h
        rep = 0
        if _local(args):
            shard += down
        else:
            rep += down
        if qk_norm:
            rep += _norm_params(args, kv_lora) + (_norm_params(args, q_lora) if q_lora else 0)
        return shard, rep
    kv = args.kv_channels or h // a
    g = args.num_query_groups if (args.group_query_attention and args.num_query_groups) else a
    return h * (a + 2 * g) * kv + a * kv * h, (2 * _norm_params(args, kv) if qk_norm else 0)


def mtp_params(args):
    """(sharded over TP, replicated) of the MTP layers without their transformer layer: the two
    input norms, the 2h -> h projection (column-parallel), the final norm (megatron-core's
    MultiTokenPredictionLayer)."""
    n = getattr(args, "mtp_num_layers", None) or 0
    h = args.hidden_size
    return n * 2 * h * h, n * 3 * _norm_params(args, h)


def layer_params(args):
    """(non-expert params of a dense layer, of an MoE layer, expert params of one MoE layer); each
    non-expert entry is (sharded over TP, replicated over TP)."""
    h, a = args.hidden_size, args.num_attention_heads
    kv = args.kv_channels or h // a
    g = args.num_query_groups if (args.group_query_attention and args.num_query_groups) else a
    bias = getattr(args, "add_bias_linear", True)
    gate = 2 if gated_mlp(args) else 1
    norm = h if args.normalization == "RMSNorm" else 2 * h
    attn, attn_rep_extra = attention_params(args)
    qkv_out = (a * (args.qk_head_dim + args.qk_pos_emb_head_dim) * 3 if _mla(args)
               else (a + 2 * g) * kv)
    attn_b = (qkv_out if (bias or getattr(args, "add_qkv_bias", False)) else 0)
    if getattr(args, "softmax_type", "vanilla") == "learnable":
        attn_b += a                                       # one sink logit per head (gpt-oss)
    attn_rep = 2 * norm + (h if bias else 0) + attn_rep_extra   # the two norms, the proj bias
    f = args.ffn_hidden_size
    mlp = h * f * gate + f * h + ((f * gate) if bias else 0)
    dense = (attn + attn_b + mlp, attn_rep + (h if bias else 0))
    experts = 0
    moe = (attn + attn_b, attn_rep)
    if args.num_experts:
        fm = args.moe_ffn_hidden_size or f
        one = h * fm * gate + fm * h + ((fm * gate + h) if bias else 0)
        experts = args.num_experts * one
        sh = args.moe_shared_expert_intermediate_size or 0
        shared = h * sh * gate + sh * h
        router = args.num_experts * (h + (1 if bias else 0))
        moe = (attn + attn_b + shared, attn_rep + router
               + (h if getattr(args, "moe_shared_expert_gate", False) else 0))
    return dense, moe, experts


def stage_pattern(args, stage) -> list:
    """The MoE-or-dense pattern of the decoder layers on pipeline rank ``stage`` (all its virtual
    stages): the layers megatron-core builds there (even split, uneven first / last stage,
    embedding / loss counted in the split, or --pipeline-model-parallel-layout)."""
    from megatron_moe.models.pipeline_split import stage_layers

    pattern = _moe_pattern(args)
    return [pattern[i] for chunk in stage_layers(args, stage) for i in chunk]


def stage_params(args, stage):
    """(non-expert params on one rank of ``stage``, expert params on one rank)."""
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    ep, etp = args.expert_model_parallel_size, args.expert_tensor_parallel_size
    mine = stage_pattern(args, stage)
    pattern = _moe_pattern(args)
    dense, moe, experts = layer_params(args)
    n_moe = sum(mine)
    n_dense = len(mine) - n_moe
    nonexp = (n_dense * (dense[0] / tp + dense[1]) + n_moe * (moe[0] / tp + moe[1]))
    h, V = args.hidden_size, args.padded_vocab_size
    mtp = getattr(args, "mtp_num_layers", None) or 0
    if mtp and stage == pp - 1:
        # the MTP layers live on the last stage; each has a copy of the last decoder layer
        last_moe = bool(pattern[-1])
        sh, rep = mtp_params(args)
        layer = moe if last_moe else dense
        nonexp += sh / tp + rep + mtp * (layer[0] / tp + layer[1])
        if last_moe:
            n_moe += mtp                     # their experts, counted below
        if pp > 1:
            nonexp += V * h / tp             # the MTP stage keeps an embedding copy
    if stage == 0:
        nonexp += V * h / tp
        if args.position_embedding_type == "learned_absolute":
            nonexp += (args.max_position_embeddings or args.seq_length) * h
    if stage == pp - 1:
        nonexp += (h if args.normalization == "RMSNorm" else 2 * h)
        if args.untie_embeddings_and_output_weights or pp > 1:
            nonexp += V * h / tp      # PP > 1: the tied output weight is a copy on the last stage
    exp = n_moe * experts / (ep * etp)
    return nonexp, exp


# --- bytes -----------------------------------------------------------------------------------------
def weight_and_optimizer_bytes(args, stage):
    """dict(params, grads, optimizer) bytes on one rank of ``stage``."""
    nonexp, exp = stage_params(args, stage)
    mixed = args.bf16 or args.fp16
    p_bytes = 2 if mixed else 4
    # megatron-core DDP's main_grad, Megatron-LM's rule: with --bf16 fp32 unless
    # --grad-reduce-in-bf16; with --fp16 fp16 unless --accumulate-allreduce-grads-in-fp32
    if args.bf16:
        grad_bytes = 2 if getattr(args, "grad_reduce_in_bf16", False) else 4
    elif args.fp16:
        grad_bytes = 4 if getattr(args, "accumulate_allreduce_grads_in_fp32", False) else 2
    else:
        grad_bytes = 4
    state = 8 if args.optimizer == "adam" else 4             # Adam m, v (fp32); SGD momentum
    opt_per_param = state + (4 if mixed else 0)               # + the fp32 main copy of a 16-bit param
    dp = args.data_parallel_size * args.context_parallel_size
    edp = args.world_size // (args.expert_model_parallel_size * args.expert_tensor_parallel_size
                              * args.pipeline_model_parallel_size)
    def held(sharded):   # parameters' elements this rank keeps: all, or its data-parallel shard
        return nonexp / dp + exp / edp if sharded else nonexp + exp

    if getattr(args, "use_megatron_fsdp", False):
        # Megatron-FSDP's buffers (megatron-core param_and_grad_buffer.py): the fp32 main weights
        # and the optimizer state are sharded from "optim" on, the gradients from "optim_grads",
        # the model's weights with "optim_grads_params" (ZeRO-3)
        from megatron_moe.compat.megatron_fsdp import main_grad_bytes

        grad_bytes = main_grad_bytes(args, grad_bytes, p_bytes)
        strategy = args.data_parallel_sharding_strategy
        weights = strategy == "optim_grads_params"
        grads = strategy in ("optim_grads", "optim_grads_params")
        out = dict(params=p_bytes * held(weights), grads=grad_bytes * held(grads),
                   optimizer=opt_per_param * held(strategy != "no_shard"))
        # what is unsharded while computing: a layer's weights gathered for its forward/backward
        # and the next one's prefetched (ZeRO-3), a layer's full gradients until they are
        # reduce-scattered (ZeRO-2/3); an estimate, not measured by tests/test_theoretical_memory.py
        dense, moe, experts = layer_params(args)
        tp, ep, etp = (args.tensor_model_parallel_size, args.expert_model_parallel_size,
                       args.expert_tensor_parallel_size)
        unit = max(dense[0] / tp + dense[1], moe[0] / tp + moe[1] + experts / (ep * etp))
        out["gathered"] = 2 * p_bytes * unit * weights + grad_bytes * unit * grads
    else:
        out = dict(params=p_bytes * (nonexp + exp), grads=grad_bytes * (nonexp + exp),
                   optimizer=opt_per_param * held(args.use_distributed_optimizer), gathered=0)
    return dict(out, nonexpert_params=nonexp, expert_params=exp)


def _local(args):
    """megatron-core's local (no Transformer Engine) layers - what runs on CPU: unfused attention
    with an fp32 softmax, norms that keep fp32 copies, SwiGLU saving its SiLU output too."""
    return (args.attention_backend in ("local", "unfused")
            or getattr(args, "transformer_impl", None) == "local")


def _flash(args):
    if getattr(args, "transformer_impl", None) == "local":
        # torch SDPA (--attention-backend flash, auto with CUDA) keeps no score matrix;
        # megatron-core's local attention does unless it is recomputed
        from megatron_moe.models.attention import use_sdpa

        return use_sdpa(args) or args.recompute_granularity == "selective"
    return (args.use_flash_attn or args.attention_backend in ("flash", "fused", "auto")
            or args.recompute_granularity == "selective")


def _norm_bytes(args, h, ab):
    # TE norms save the input (+ a per-token rstd); the local RMSNorm/LayerNorm two fp32 copies
    return 2 * 4 * h if _local(args) else h * ab


def _qk_norm_bytes(args, heads, kv, ab):
    """Per token: the per-head Q and K norms (--qk-layernorm). TE saves the input (+ a per-row
    rstd); megatron-core's local norm on the [s, b, heads, kv] view keeps three fp32 tensors of
    the input's size and a per-row fp32 rstd (measured, tests/test_qwen3.py)."""
    if _local(args):
        return 3 * 4 * heads * kv + 4 * heads
    return heads * kv * ab + 4 * heads


def layer_activation_bytes(args, moe: bool):
    """Bytes one layer keeps for backward per micro-batch on one rank (Korthikanti et al. 2022,
    Table 2, generalised: GQA, SwiGLU, dropout masks only when dropout > 0, MoE top-k copies)."""
    s = args.seq_length / args.context_parallel_size
    b, h, a = args.micro_batch_size, args.hidden_size, args.num_attention_heads
    kv = args.kv_channels or h // a
    g = args.num_query_groups if (args.group_query_attention and args.num_query_groups) else a
    tp = args.tensor_model_parallel_size
    ab = 2 if (args.bf16 or args.fp16) else 4
    gate = 2 if gated_mlp(args) else 1
    mask_h = h if args.hidden_dropout > 0 else 0
    # per token: the part every TP rank holds without SP, and the part TP splits
    rep = 2 * _norm_bytes(args, h, ab) + h * ab + 2 * mask_h   # 2 norms, QKV input, 2 dropout masks
    if _mla(args):
        # latents (down-projection outputs, their norms' inputs, up-projection inputs), the RoPE
        # part of k, then Q, K (q/k head dim), V (v head dim) and the projection input (v head dim)
        qh = args.qk_head_dim + args.qk_pos_emb_head_dim
        q_lora, kv_lora = args.q_lora_rank or 0, args.kv_lora_rank
        lat = (q_lora + kv_lora) * ab + args.qk_pos_emb_head_dim * ab
        if getattr(args, "qk_layernorm", False):
            lat += (_norm_bytes(args, q_lora, ab) if q_lora else 0) + _norm_bytes(args, kv_lora, ab)
        rep += lat
        shard = 2 * a * qh * ab + 2 * a * args.v_head_dim * ab
    else:
        shard = (a + 2 * g) * kv * ab + a * kv * ab       # Q, K, V; projection input
        if getattr(args, "qk_layernorm", False):          # the Q and K norms' saved tensors
            shard += _qk_norm_bytes(args, a + g, kv, ab)
    if not _flash(args):                                  # unfused softmax(QK^T) [+ dropout] kept
        soft = (4 + ab) if _local(args) else ab           # local: fp32 softmax + its 16-bit copy
        shard += a * s * (soft + (ab + 1 if args.attention_dropout > 0 else 0))
    silu = 1 if (_local(args) and gated_mlp(args)) else 0  # unfused GLU keeps act(x) too
    if moe and args.num_experts:
        k, E = args.moe_router_topk, args.num_experts
        fm = args.moe_ffn_hidden_size or args.ffn_hidden_size
        rep += h * ab + 2 * E * 4                         # router input, fp32 logits and probs
        # k copies per token: permuted input, fc1 output (activation input), fc2 input
        etp = args.expert_tensor_parallel_size
        shard_e = k * (h * ab + fm * (gate + 1 + silu) * ab / etp)
        sh = args.moe_shared_expert_intermediate_size or 0
        shard += sh * (gate + 1 + silu) * ab
    else:
        f = args.ffn_hidden_size
        rep += h * ab                                     # fc1 input
        shard += f * (gate + 1 + silu) * ab
        shard_e = 0
    sp = args.sequence_parallel or tp == 1
    per_token = (rep / tp if sp else rep) + shard / tp + shard_e
    return s * b * per_token


def activation_bytes(args, stage, num_microbatches):
    pp = args.pipeline_model_parallel_size
    pattern = stage_pattern(args, stage)
    s = args.seq_length / args.context_parallel_size
    b, h, tp = args.micro_batch_size, args.hidden_size, args.tensor_model_parallel_size
    ab = 2 if (args.bf16 or args.fp16) else 4
    full = [layer_activation_bytes(args, bool(m)) for m in pattern]
    keep = list(full)
    if args.recompute_granularity == "full":
        n = args.recompute_num_layers or 1
        inp = s * b * h * ab / (tp if args.sequence_parallel else 1)
        if args.recompute_method == "block":          # the first n layers keep only their input
            keep = [inp if i < n else x for i, x in enumerate(full)]
            peak = max(full[:n], default=0)
        else:                                          # uniform: one input per chunk of n layers
            keep = [inp if i % n == 0 else 0 for i in range(len(full))]
            peak = max((sum(full[i:i + n]) for i in range(0, len(full), n)), default=0)
    else:
        peak = 0
    act = sum(keep)
    mtp = getattr(args, "mtp_num_layers", None) or 0
    if mtp and stage == pp - 1:
        # per MTP layer: the embedding of the shifted tokens and the hidden state (normed: the
        # norms' inputs), their concatenation (eh_proj input), a transformer layer, its final
        # norm, and the MTP logits (fp32 for the loss) - megatron-core's MultiTokenPredictionLayer
        last = layer_activation_bytes(args, bool(_moe_pattern(args)[-1]))
        sp = args.sequence_parallel or tp == 1
        per_token = (2 * _norm_bytes(args, h, ab) + 3 * h * ab) / (tp if sp else 1) \
            + _norm_bytes(args, h, ab) / (tp if sp else 1) + args.padded_vocab_size / tp * 4
        act += mtp * (last + s * b * per_token)
    if stage == 0:
        act += s * b * h * (ab + (1 if args.hidden_dropout > 0 else 0)) + 8 * s * b
    # 1F1B: stage i holds min(pp - i, m) micro-batches; interleaving adds (pp-1)/(pp*vp)
    vp = args.virtual_pipeline_model_parallel_size
    if pp > 1:
        inflight = min(pp - stage, num_microbatches)
        if vp:
            inflight = math.ceil((1 + (pp - 1) / (pp * vp)) * inflight)
        act *= inflight
    act += peak                                       # one recomputed chunk during its backward
    if stage == pp - 1:                               # logits (fp32 for the loss) + final norm out
        act += s * b * (args.padded_vocab_size / tp * 4 + _norm_bytes(args, h, ab) + h * ab)
    return act


def estimate(args, num_microbatches=None):
    """Per-GPU bytes on the most loaded pipeline stage: dict(params, grads, optimizer,
    activations, total, stage, ...)."""
    if num_microbatches is None:
        num_microbatches = (getattr(args, "num_microbatches", None)
                            or max(1, args.global_batch_size
                                   // (args.micro_batch_size * args.data_parallel_size)))
    best = None
    for stage in range(args.pipeline_model_parallel_size):
        r = weight_and_optimizer_bytes(args, stage)
        r["activations"] = activation_bytes(args, stage, num_microbatches)
        r["total"] = (r["params"] + r["grads"] + r["optimizer"] + r["gathered"]
                      + r["activations"])
        r["stage"] = stage
        if best is None or r["total"] > best["total"]:
            best = r
    return best


def fits(total_bytes, gpu_gb):
    return total_bytes <= FIT_FRACTION * gpu_gb * GB - FIT_RESERVE_GB * GB


def report(args, ignored=(), out=print):
    r = estimate(args)
    tp, pp, ep, etp = (args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
                       args.expert_model_parallel_size, args.expert_tensor_parallel_size)
    sharding = (f"Megatron-FSDP {args.data_parallel_sharding_strategy}"
                if getattr(args, "use_megatron_fsdp", False) else
                f"distributed optimizer {'on' if args.use_distributed_optimizer else 'off'}")
    out(f"world {args.world_size}: TP={tp} PP={pp} EP={ep} ETP={etp} CP={args.context_parallel_size} "
        f"DP={args.data_parallel_size} expert-DP={args.world_size // (ep * etp * pp)}, "
        f"{'bf16' if args.bf16 else 'fp16' if args.fp16 else 'fp32'}, {sharding}, "
        f"recompute {args.recompute_granularity or 'none'}"
        f"{' (' + str(args.recompute_method) + ')' if args.recompute_granularity == 'full' else ''}")
    out(f"most loaded rank: pipeline stage {r['stage']}: {r['nonexpert_params'] / 1e9:.3f}B non-expert "
        f"+ {r['expert_params'] / 1e9:.3f}B expert parameters")
    for k in ("params", "grads", "optimizer", "gathered", "activations", "total"):
        if k != "gathered" or r[k]:   # Megatron-FSDP's unsharded layers while computing
            out(f"  {k:<12} {r[k] / GB:9.2f} GB")
    if ignored:
        out(f"ignored (not modelled here): {' '.join(ignored)}")
    for note in getattr(args, "memory_notes", []):
        out(f"note: {note}")
    from megatron_moe.flops import num_floating_point_operations  # the log line's count too

    r["flops_per_iteration"] = num_floating_point_operations(args, args.global_batch_size)
    out(f"model FLOPs per iteration: {r['flops_per_iteration'] / 1e12:.3f} TFLOP (global batch "
        f"{args.global_batch_size} x sequence {args.seq_length}, forward + backward)")
    w = (r["params"] + r["grads"] + r["optimizer"] + r["gathered"]) / MB
    a = r["activations"] / MB
    out(f"Theoretical memory footprints: weight and optimizer={w:.2f} MB, activation={a:.2f} MB, "
        f"total={w + a:.2f} MB")
    if args.gpu_memory_gb:
        ok = fits(r["total"], args.gpu_memory_gb)
        out(f"{'fits' if ok else 'DOES NOT FIT'} a {args.gpu_memory_gb:g} GB GPU (budget "
            f"{FIT_FRACTION:.0%} of it minus {FIT_RESERVE_GB:g} GB for the CUDA context, "
            f"communication buffers and fragmentation)")
    return r


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if "-h" in argv or "--help" in argv:
        _help_parser().print_help()
        return 0
    args, ignored = parse(argv)
    r = report(args, ignored)
    if args.gpu_memory_gb and not fits(r["total"], args.gpu_memory_gb):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
