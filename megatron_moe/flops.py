"""Model FLOPs of a training iteration: the one count the log line's ``--log-throughput``
(TFLOP/s/GPU), tools/report_theoretical_memory.py and the GPU check's MFU share.

Megatron-LM's accounting (Narayanan et al. 2021, appendix "Floating-point operation counting"),
written here from the formula: every matrix product of m x n by n x k costs 2mnk; backward costs
twice forward (data and weight gradients), so an iteration is 3x the forward; attention scores and
the attention-weighted values are counted over the full sequence (as Megatron-LM does, no causal
halving); an MoE layer counts its top-k routed experts, its shared experts and the router; the
output logits count once per token. Model FLOPs, not hardware FLOPs: recomputation is not counted.
Generalised to GQA, SwiGLU, MoE layer patterns (``--moe-layer-freq``) and per-layer expert sizes
(``--moe-ffn-hidden-size``).
"""

from __future__ import annotations


def _moe_layers(args):
    L = args.num_layers
    if not getattr(args, "num_experts", None):
        return [False] * L
    f = getattr(args, "moe_layer_freq", 1)
    return [bool(x) for x in f] if isinstance(f, list) else [i % f == 0 for i in range(L)]


def gated_mlp(args) -> bool:
    """fc1 computes two halves (gate and up): --swiglu or --quick-geglu (gpt-oss)."""
    return bool(getattr(args, "swiglu", False) or getattr(args, "quick_geglu", False))


def forward_flops_per_token(args) -> dict:
    """Forward FLOPs per token by part: attention, mlp (dense or routed experts + shared + router),
    logits; summed over the layers."""
    h, a, s = args.hidden_size, args.num_attention_heads, args.seq_length
    kv = getattr(args, "kv_channels", None) or h // a
    g = (args.num_query_groups if getattr(args, "group_query_attention", False)
         and getattr(args, "num_query_groups", None) else a)
    gate = 2 if gated_mlp(args) else 1
    attn = 2 * (h * (a + 2 * g) * kv + a * kv * h) + 2 * 2 * a * kv * s
    f = args.ffn_hidden_size or 4 * h
    dense_mlp = 2 * (h * f * gate + f * h)
    moe_mlp = 0
    if getattr(args, "num_experts", None):
        fm = getattr(args, "moe_ffn_hidden_size", None) or f
        sh = getattr(args, "moe_shared_expert_intermediate_size", None) or 0
        moe_mlp = 2 * (args.moe_router_topk * (h * fm * gate + fm * h)
                       + (h * sh * gate + sh * h) + args.num_experts * h)
    pattern = _moe_layers(args)
    vocab = getattr(args, "padded_vocab_size", None) or args.vocab_size
    return dict(attention=len(pattern) * attn,
                mlp=sum(moe_mlp if m else dense_mlp for m in pattern),
                logits=2 * h * vocab)


def num_floating_point_operations(args, batch_size: int) -> float:
    """Model FLOPs of one training iteration over ``batch_size`` sequences (forward + backward)."""
    return 3.0 * batch_size * args.seq_length * sum(forward_flops_per_token(args).values())
