"""Core attention with unequal query/key and value head dims, for megatron-core's MLA on CPU.

megatron-core's Multi-Latent Attention builds its core attention with ``k_channels`` (the q/k
head dim, ``qk_head_dim + qk_pos_emb_head_dim``), ``v_channels`` (``v_head_dim``) and the YaRN
``softmax_scale`` (``mscale**2 / sqrt(q_head_dim)``). Transformer Engine's ``TEDotProductAttention``
takes those; megatron-core's local ``DotProductAttention`` (0.16.1 to 0.19.x) does not: it has no
``k_channels``/``v_channels`` parameters, and it sizes its output as ``kv_channels x heads``.

``UnequalHeadDotProductAttention`` is that local attention, taught the two head dims. The math
(baddbmm of Q K^T with the scale, megatron-core's mask/softmax/dropout, bmm with V) is the parent's;
only the construction differs: the keywords are accepted, the default scale is 1/sqrt(q/k head
dim), and the output size is ``v_channels x heads per partition``. Used in place of
``DotProductAttention`` wherever a spec asks for it (``customize_spec``); a spec that already has
TE's attention (GPU with TE) is left alone.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel.layers import ColumnParallelLinear
from megatron.core.transformer.dot_product_attention import DotProductAttention

__all__ = ["UnequalHeadDotProductAttention", "LayerNormColumnParallelLinear", "customize_spec"]


class UnequalHeadDotProductAttention(DotProductAttention):
    """megatron-core's DotProductAttention with ``k_channels`` / ``v_channels`` (TE's interface)."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type,
                 attention_dropout: Optional[float] = None, softmax_scale: Optional[float] = None,
                 k_channels: Optional[int] = None, v_channels: Optional[int] = None,
                 cp_comm_type: Optional[str] = None, pg_collection=None):
        super().__init__(config=config, layer_number=layer_number, attn_mask_type=attn_mask_type,
                         attention_type=attention_type, attention_dropout=attention_dropout,
                         softmax_scale=softmax_scale, cp_comm_type=cp_comm_type,
                         pg_collection=pg_collection)
        self.k_channels = k_channels or config.kv_channels
        self.v_channels = v_channels or config.kv_channels
        if softmax_scale is None:
            # the parent took 1/sqrt(kv_channels); the scores are q.k over the q/k head dim
            self.softmax_scale = 1.0 / math.sqrt(self.k_channels)
            if self.config.apply_query_key_layer_scaling:
                self.softmax_scale /= max(1, layer_number)
        # the context is [sq, b, heads per partition x v head dim]
        self.hidden_size_per_attention_head = self.v_channels
        self.hidden_size_per_partition = self.v_channels * self.num_attention_heads_per_partition

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None, **unused):
        if query.shape[-1] != self.k_channels or key.shape[-1] != self.k_channels \
                or value.shape[-1] != self.v_channels:
            raise ValueError(f"head dims q {query.shape[-1]}, k {key.shape[-1]}, v {value.shape[-1]}"
                             f" != k_channels {self.k_channels}, v_channels {self.v_channels}")
        return super().forward(query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                               attention_bias=attention_bias, packed_seq_params=packed_seq_params)


def customize_spec(args, spec):
    """model.gpt_layer_spec hook: MLA layers get the unequal-head core attention instead of
    megatron-core's local DotProductAttention (TE's, on GPU, already takes the head dims), and no
    query norm without a query LoRA (compat/mla.py)."""
    if not getattr(args, "multi_latent_attention", False):
        return spec
    import dataclasses

    from megatron_moe.compat.mla import drop_unused_q_norm, fix_te_stand_ins, local_fused_q_norm

    fix_te_stand_ins()
    local_fused_q_norm(LayerNormColumnParallelLinear)
    for layer in getattr(spec, "layer_specs", None) or [spec]:
        attn = getattr(getattr(layer, "submodules", None), "self_attention", None)
        sub = getattr(attn, "submodules", None)
        if sub is None or not hasattr(sub, "linear_kv_down_proj"):
            continue  # not an MLA layer
        new = drop_unused_q_norm(sub, args.q_lora_rank)
        if getattr(new, "core_attention", None) is DotProductAttention:
            new = dataclasses.replace(new, core_attention=UnequalHeadDotProductAttention)
        # fresh objects: megatron-core shares one layer spec between layers
        layer.submodules = dataclasses.replace(
            layer.submodules, self_attention=dataclasses.replace(attn, submodules=new))
    return spec



class LayerNormColumnParallelLinear(ColumnParallelLinear):
    """A norm over the input, then megatron-core's ColumnParallelLinear: the local stand-in for
    Transformer Engine's ``TELayerNormColumnParallelLinear`` (its ``layer_norm_weight`` /
    ``layer_norm_bias`` names), which megatron-core >= 0.19 uses for MLA's query projection when
    ``--qk-layernorm`` is on without a query LoRA (DeepSeek-V2-Lite) and which its local backend
    lacks (compat/mla.py hands it to MLA's norm resolver). The norm is the model's
    (--normalization, --norm-epsilon), per token, so it runs before the linear's gather of a
    sequence-parallel input; its weights are then sequence-parallel params (grads summed over TP).
    """

    def __init__(self, input_size, output_size, *, config, **kwargs):
        kwargs.pop("name", None)   # megatron-core >= 0.19 names modules; the linear takes no name
        super().__init__(input_size, output_size, config=config, **kwargs)
        self.rms = config.normalization == "RMSNorm"
        self.eps = config.layernorm_epsilon
        dtype = config.params_dtype
        self.layer_norm_weight = torch.nn.Parameter(torch.ones(input_size, dtype=dtype))
        self.layer_norm_bias = (None if self.rms else
                                torch.nn.Parameter(torch.zeros(input_size, dtype=dtype)))
        for p in (self.layer_norm_weight, self.layer_norm_bias):
            if p is not None:
                setattr(p, "sequence_parallel", config.sequence_parallel)

    def forward(self, input_, *args, **kwargs):
        shape = (input_.shape[-1],)
        if self.rms:
            normed = F.rms_norm(input_, shape, self.layer_norm_weight, self.eps)
        else:
            normed = F.layer_norm(input_, shape, self.layer_norm_weight, self.layer_norm_bias,
                                  self.eps)
        return super().forward(normed, *args, **kwargs)
