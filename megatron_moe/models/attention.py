"""Core attention for megatron-core's local path: unequal q/k and v head dims (MLA), and torch SDPA.

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

``SDPADotProductAttention`` is the same module computing with
``torch.nn.functional.scaled_dot_product_attention`` (flash / cuDNN / memory-efficient kernels on
CUDA, the math kernel on CPU): no [b, heads, sq, sk] score matrix is materialised by us, where the
parent's baddbmm + masked_fill + softmax + bmm are four passes over it. Chosen by Megatron's own
flags: ``--transformer-impl local`` with ``--attention-backend flash`` (or ``auto`` when CUDA is
available or with ``--context-parallel-size`` > 1, which only this attention runs: all-gather
context parallelism); ``local``/``unfused`` (and ``auto`` on CPU without CP) keep megatron-core's
math.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import math
from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.tensor_parallel.layers import ColumnParallelLinear
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType

__all__ = ["UnequalHeadDotProductAttention", "SDPADotProductAttention", "use_sdpa",
           "cp_chunk_order", "cp_query_positions",
           "LayerNormColumnParallelLinear", "customize_spec"]


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

    def check_head_dims(self, query, key, value):
        if query.shape[-1] != self.k_channels or key.shape[-1] != self.k_channels \
                or value.shape[-1] != self.v_channels:
            raise ValueError(f"head dims q {query.shape[-1]}, k {key.shape[-1]}, v {value.shape[-1]}"
                             f" != k_channels {self.k_channels}, v_channels {self.v_channels}")

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None, **unused):
        self.check_head_dims(query, key, value)
        return super().forward(query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                               attention_bias=attention_bias, packed_seq_params=packed_seq_params)


class SDPADotProductAttention(UnequalHeadDotProductAttention):
    """The same core attention (construction, parameters, checkpoint keys) computed by
    ``torch.nn.functional.scaled_dot_product_attention``, with megatron-core's local semantics:

    * masks: the layer's sliding window (``--window-size``, which megatron-core's local softmax
      applies in place of any mask it is given), else causal when no mask is passed (queries and
      keys aligned at the start, as megatron's: ``sq == sk`` or one query), else the mask passed
      (True = masked, [b|1, 1, sq, sk], e.g. BERT's padding mask);
    * a query row with every key masked (BERT's padding queries): megatron-core fills masked
      scores with -10000, so its softmax is uniform and the row's output the mean of V; SDPA
      kernels give 0 or NaN there, so SDPA sees such rows unmasked and their output is then
      replaced by that mean;
    * sinks (``--softmax-type learnable|off-by-one``: ``softmax_offset``, one logit per head in
      every softmax denominator): one extra key whose score is the sink, through SDPA's additive
      mask, with a zero value;
    * GQA: SDPA's ``enable_gqa`` when no mask is needed (flash kernels take it); with a mask the
      keys and values are repeated per head, as megatron-core does, since the masked kernels
      (memory-efficient, cuDNN) may not take grouped heads and SDPA would fall back to its math;
    * scale: the parent's ``softmax_scale`` (MLA's mscale, ``apply_query_key_layer_scaling``'s
      division by the layer number undone by its softmax's multiplication, so the net scale);
      SDPA's fused kernels accumulate the softmax in fp32 (``--attention-softmax-in-fp32``);
    * dropout: ``attention_dropout`` in training, in the model-parallel RNG region as megatron's.

    The explicit masks (window, sinks, padding) are [sq, sk] per batch/head at most; only the
    unmasked causal path reaches the flash kernel. Packed sequences and attention biases are
    refused as megatron-core's local attention refuses them.

    Context parallelism (``--context-parallel-size`` cp > 1), by all-gather (the Llama 3 paper's
    all-gather CP; Transformer Engine's ``--cp-comm-type all_gather``), whatever
    ``--cp-comm-type`` says (same result; the memory is all-gather's: the whole sequence's K and V
    on every CP rank): each CP rank holds the sequence chunks r and 2*cp-1-r of 2*cp
    (megatron-core's ``get_batch_on_this_cp_rank``); K and V are all-gathered over the CP group and
    put back in sequence order, and the local queries attend with the mask of their true positions
    (causal, or the window; a dataloader mask arrives already cut to the local query rows). Plain
    causal attention needs no mask: each local chunk attends to the keys up to its end with a
    bottom-right causal alignment (``_cp_causal``: flash kernels on CUDA); a window, sinks or a
    dataloader mask make it explicit ([2 * s / cp, s]), without the flash kernel.
    """

    # K/V all-gathers over the context-parallel group, counted (the equivalence tests prove the
    # CP path ran)
    cp_gathers = 0
    cp_causal_chunks = 0   # chunks computed by _cp_causal (no explicit mask)

    def __init__(self, config, layer_number, attn_mask_type, attention_type,
                 attention_dropout: Optional[float] = None, softmax_scale: Optional[float] = None,
                 k_channels: Optional[int] = None, v_channels: Optional[int] = None,
                 cp_comm_type: Optional[str] = None, pg_collection=None):
        cp = config.context_parallel_size
        # megatron-core's local attention asserts one CP rank at construction (its math has no
        # CP); this subclass does the CP itself, so the parent sees a copy with cp = 1
        base = config
        if cp > 1:
            base = copy.copy(config)
            base.context_parallel_size = 1
        super().__init__(base, layer_number, attn_mask_type, attention_type,
                         attention_dropout=attention_dropout, softmax_scale=softmax_scale,
                         k_channels=k_channels, v_channels=v_channels,
                         cp_comm_type=cp_comm_type, pg_collection=pg_collection)
        self.config = config
        self.cp_group = None
        if cp > 1:
            from megatron.core import parallel_state

            self.cp_group = (getattr(pg_collection, "cp", None)
                             or parallel_state.get_context_parallel_group())

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None, **unused):
        if packed_seq_params is not None:
            raise ValueError("packed sequences (packed_seq_params) are not supported by the local "
                             "attention; use --transformer-impl transformer_engine")
        if attention_bias is not None:
            raise ValueError("attention_bias is not supported by the local attention")
        self.check_head_dims(query, key, value)
        sq, b, heads, _ = query.shape
        cp = self.cp_group is not None and self.cp_group.size() > 1
        if cp:
            key, value = self._gather_cp(key), self._gather_cp(value)
        sk = key.shape[0]
        offset = self.softmax_offset
        # [s, b, heads, d] -> [b, heads, s, d]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        groups = heads // key.shape[2]
        dropout_p = self.attention_dropout.p if self.training else 0.0
        region = (tensor_parallel.get_cuda_rng_tracker().fork()
                  if dropout_p > 0 and not self.config.sequence_parallel
                  else contextlib.nullcontext())
        # the net scale: the parent divides softmax_scale by the layer number under
        # apply_query_key_layer_scaling and its softmax multiplies it back
        scale = self.softmax_scale * (self.scale_mask_softmax.scale or 1.0)
        if cp and self._plain_causal(attention_mask):
            with region:
                out = self._cp_causal(q, k, v, groups, dropout_p, scale)
            return out.permute(2, 0, 1, 3).reshape(sq, b, self.hidden_size_per_partition)
        keep, is_causal = (self._cp_keep_mask if cp else self._keep_mask)(
            attention_mask, sq, sk, query.device)
        if groups > 1 and (keep is not None or offset is not None):
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
            groups = 1
        dead = None
        if offset is not None:
            if keep is None:   # causal or unmasked: the sink column needs an explicit mask
                keep = (torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril()
                        if is_causal else torch.ones(sq, sk, dtype=torch.bool, device=q.device))
                is_causal = False
            mask = self._sink_mask(keep, offset, heads, q.dtype)
            k = torch.cat([k, k.new_zeros(k.shape[:2] + (1, k.shape[3]))], dim=2)
            v = torch.cat([v, v.new_zeros(v.shape[:2] + (1, v.shape[3]))], dim=2)
        elif keep is not None:
            dead = ~keep.any(dim=-1, keepdim=True)
            mask = keep | dead
        else:
            mask = None
        with region:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p,
                                                 is_causal=is_causal, scale=scale,
                                                 enable_gqa=groups > 1)
        if dead is not None:
            out = self._uniform_rows(out, v, dead)
        # [b, heads, sq, dv] -> [sq, b, heads x dv]
        return out.permute(2, 0, 1, 3).reshape(sq, b, self.hidden_size_per_partition)

    def _keep_mask(self, attention_mask, sq, sk, device):
        """(keep, is_causal): a bool mask True where a query sees a key ([sq, sk] or
        [b|1, 1, sq, sk]) or None, and whether SDPA's own causal mask is the mask."""
        window = self.scale_mask_softmax.window_size
        if window is not None:
            # megatron-core's get_sliding_window_causal_mask, as the keys kept
            ones = torch.ones(sq, sk, dtype=torch.bool, device=device)
            return ones.triu(sk - sq - window[0]).tril(sk - sq + window[1]), False
        if self.attn_mask_type == AttnMaskType.causal and attention_mask is None and sq > 1:
            if sq != sk:
                raise ValueError(f"causal attention needs as many queries as keys "
                                 f"(got {sq} and {sk})")
            return None, True
        if attention_mask is None:
            return None, False
        return ~attention_mask, False

    def _gather_cp(self, t):
        """[s / cp, b, groups, d] of this CP rank -> [s, b, groups, d] of the whole sequence in
        sequence order. megatron-core's sequence-parallel gather is autograd-aware as needed here:
        forward all-gathers the first dim, backward reduce-scatters it (every rank's queries add
        to the gradient of every rank's keys and values; each rank keeps the sum for its own
        chunks), on NCCL and on gloo."""
        from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

        cp = self.cp_group.size()
        chunk = t.shape[0] // 2
        full = gather_from_sequence_parallel_region(t.contiguous(), tensor_parallel_output_grad=True,
                                                    group=self.cp_group)
        SDPADotProductAttention.cp_gathers += 1
        order = cp_chunk_order(cp, t.device)
        return full.view(2 * cp, chunk, *t.shape[1:]).index_select(0, order).view(
            2 * cp * chunk, *t.shape[1:])

    def _plain_causal(self, attention_mask) -> bool:
        """Causal attention with nothing else (no window, sinks or dataloader mask)."""
        return (self.attn_mask_type == AttnMaskType.causal and attention_mask is None
                and self.scale_mask_softmax.window_size is None and self.softmax_offset is None)

    def _cp_causal(self, q, k, v, groups, dropout_p, scale):
        """Plain causal attention under CP without an [sq, sk] mask: each of this rank's two
        chunks (sequence chunks r and 2cp-1-r) attends to the keys up to its own end, causally
        aligned at the bottom right (torch's ``causal_lower_right``, which SDPA runs with its
        flash or memory-efficient kernel on CUDA; on a CPU it becomes a mask). Those kernels
        take no grouped heads here, so GQA's keys and values are repeated per head."""
        from torch.nn.attention.bias import causal_lower_right

        if groups > 1:
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        cp, rank = self.cp_group.size(), self.cp_group.rank()
        chunk = q.shape[2] // 2
        outs = []
        for i, c in enumerate((rank, 2 * cp - 1 - rank)):
            end = (c + 1) * chunk
            outs.append(F.scaled_dot_product_attention(
                q[:, :, i * chunk:(i + 1) * chunk], k[:, :, :end], v[:, :, :end],
                attn_mask=causal_lower_right(chunk, end), dropout_p=dropout_p, scale=scale))
        SDPADotProductAttention.cp_causal_chunks += 2
        return torch.cat(outs, dim=2)

    def _cp_keep_mask(self, attention_mask, sq, sk, device):
        """(keep, is_causal) of the local queries over the whole sequence's keys: the causal (or
        window) mask of the queries' true positions, or the dataloader's mask (its query rows
        already this rank's)."""
        window = self.scale_mask_softmax.window_size
        pos = cp_query_positions(self.cp_group.size(), self.cp_group.rank(), sq, device)
        rel = torch.arange(sk, device=device).view(1, sk) - pos.view(sq, 1)   # key - query
        if window is not None:
            return (rel >= -window[0]) & (rel <= window[1]), False
        if attention_mask is not None:
            if attention_mask.shape[-1] != sk:
                raise ValueError(f"context parallelism: the attention mask has "
                                 f"{attention_mask.shape[-1]} keys, the sequence {sk}")
            return ~attention_mask, False
        if self.attn_mask_type == AttnMaskType.causal:
            return rel <= 0, False
        return None, False

    @staticmethod
    def _uniform_rows(out, v, dead):
        """megatron-core's softmax over a fully masked row is uniform (its masked scores are all
        -10000): the output there is the mean of V."""
        return torch.where(dead, v.mean(dim=2, keepdim=True), out)

    @staticmethod
    def _sink_mask(keep, offset, heads, dtype):
        """SDPA's additive mask with the sink column: [., heads, sq, sk + 1], 0 where kept,
        -inf where masked, the head's sink logit in the last column."""
        while keep.dim() < 4:
            keep = keep.unsqueeze(0)
        base = torch.zeros(keep.shape, dtype=dtype, device=keep.device)
        base = base.masked_fill(~keep, float("-inf")).expand(keep.shape[0], heads, *keep.shape[2:])
        sink = offset.to(dtype).view(1, heads, 1, 1).expand(keep.shape[0], heads, keep.shape[2], 1)
        return torch.cat([base, sink], dim=-1)


@functools.lru_cache(maxsize=None)
def cp_chunk_order(cp: int, device) -> torch.Tensor:
    """Index of each sequence chunk (of 2 * cp) in the all-gather of the CP ranks' chunks
    (rank r holds chunks r and 2 * cp - 1 - r: megatron-core's ``get_batch_on_this_cp_rank``).
    Built once per (cp, device): every layer's K and V gathers read it, and building it is a
    host-to-device copy on CUDA."""
    return torch.tensor([2 * j if j < cp else 2 * (2 * cp - 1 - j) + 1 for j in range(2 * cp)],
                        dtype=torch.long, device=device)


def cp_query_positions(cp: int, rank: int, sq: int, device) -> torch.Tensor:
    """Sequence positions of CP rank ``rank``'s ``sq`` local tokens (its chunks r and 2cp-1-r)."""
    chunk = sq // 2
    local = torch.arange(chunk, device=device)
    return torch.cat([rank * chunk + local, (2 * cp - 1 - rank) * chunk + local])


def use_sdpa(args) -> bool:
    """--transformer-impl local with --attention-backend flash, or auto when CUDA is available or
    with --context-parallel-size > 1 (only this attention has context parallelism on the local
    path): the core attention is SDPADotProductAttention (TE's attention has its own kernels)."""
    if getattr(args, "transformer_impl", None) != "local":
        return False
    backend = getattr(args, "attention_backend", "auto")
    return backend == "flash" or (backend == "auto" and (
        torch.cuda.is_available() or getattr(args, "context_parallel_size", 1) > 1))


def customize_spec(args, spec):
    """model.gpt_layer_spec hook: megatron-core's local DotProductAttention becomes
    SDPADotProductAttention when ``use_sdpa(args)``; otherwise MLA layers get the unequal-head
    core attention (TE's, on GPU, already takes the head dims). MLA layers get no query norm
    without a query LoRA (compat/mla.py)."""
    mla = getattr(args, "multi_latent_attention", False)
    sdpa = use_sdpa(args)
    if not (mla or sdpa):
        return spec
    import dataclasses

    from megatron_moe.compat.mla import drop_unused_q_norm, fix_te_stand_ins, local_fused_q_norm

    if mla:
        fix_te_stand_ins()
        local_fused_q_norm(LayerNormColumnParallelLinear)
    core = SDPADotProductAttention if sdpa else UnequalHeadDotProductAttention
    for layer in getattr(spec, "layer_specs", None) or [spec]:
        attn = getattr(getattr(layer, "submodules", None), "self_attention", None)
        sub = getattr(attn, "submodules", None)
        if sub is None:
            continue
        is_mla = hasattr(sub, "linear_kv_down_proj")
        if not (is_mla or sdpa):
            continue
        new = drop_unused_q_norm(sub, args.q_lora_rank) if is_mla else sub
        if getattr(new, "core_attention", None) is DotProductAttention:
            new = dataclasses.replace(new, core_attention=core)
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
