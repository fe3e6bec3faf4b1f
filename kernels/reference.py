"""Pure-PyTorch reference of every kernel: the specification the fast CPU path and the Triton
kernels are tested against.  Written for clarity, not speed (per-expert loops, dense masks).
Layout conventions: see ``kernels/layout.py``."""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple, Union

import torch

from .layout import RoutingLayout, check_capacity, check_experts_per_rank, check_topk


def _layout_from_dense(mask: torch.Tensor, pidx: torch.Tensor, topk, capacity, pad,
                       experts_per_rank) -> RoutingLayout:
    """mask [T, E] bool, pidx [T, E] int64 prob index of each pair (-1 for none)."""
    T, E = mask.shape
    rows, probs_idx, per_expert = [], [], []
    ar = torch.arange(T, device=mask.device)
    for e in range(E):
        routed = ar[mask[:, e]]  # ascending token order = the stable order
        if capacity is not None:
            routed = routed[:capacity]
        r_pidx = pidx[routed, e]
        if pad:
            need = min(capacity, T) - routed.numel()
            fill = ar[~mask[:, e]][:need]
            routed = torch.cat([routed, fill])
            fill_p = fill * E + e if topk is None else torch.full_like(fill, -1)
            r_pidx = torch.cat([r_pidx, fill_p])
        rows.append(routed)
        probs_idx.append(r_pidx)
        per_expert.append(routed.numel())
    return RoutingLayout(
        row_map=torch.cat(rows) if rows else ar[:0],
        prob_index=torch.cat(probs_idx) if probs_idx else ar[:0],
        tokens_per_expert=torch.tensor(per_expert, dtype=torch.long, device=mask.device),
        routed_per_expert=mask.sum(0).long(),
        num_tokens=T, num_experts=E, topk=topk, capacity=capacity, pad_to_capacity=pad,
        experts_per_rank=experts_per_rank,
    )


def routing_layout(topk_idx: torch.Tensor, num_experts: int, capacity: Optional[int] = None,
                   pad_to_capacity: bool = False,
                   experts_per_rank: Optional[int] = None) -> RoutingLayout:
    check_topk(topk_idx, num_experts)
    check_capacity(capacity, pad_to_capacity)
    check_experts_per_rank(num_experts, experts_per_rank)
    T, k = topk_idx.shape
    idx = topk_idx.long()
    mask = torch.zeros(T, num_experts, dtype=torch.bool, device=idx.device)
    pidx = torch.full((T, num_experts), -1, dtype=torch.long, device=idx.device)
    t = torch.arange(T, device=idx.device).unsqueeze(1).expand(T, k)
    mask[t, idx] = True
    pidx[t, idx] = t * k + torch.arange(k, device=idx.device)
    return _layout_from_dense(mask, pidx, k, capacity, pad_to_capacity, experts_per_rank)


def routing_layout_from_map(routing_map: torch.Tensor, capacity: Optional[int] = None,
                            pad_to_capacity: bool = False,
                            experts_per_rank: Optional[int] = None) -> RoutingLayout:
    check_capacity(capacity, pad_to_capacity)
    T, E = routing_map.shape
    check_experts_per_rank(E, experts_per_rank)
    mask = routing_map.bool()
    pidx = (torch.arange(T, device=mask.device).unsqueeze(1) * E
            + torch.arange(E, device=mask.device))
    return _layout_from_dense(mask, pidx, None, capacity, pad_to_capacity, experts_per_rank)


def gather_rows(x: torch.Tensor, row_map: torch.Tensor) -> torch.Tensor:
    return x[row_map]


def opmath_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype of torch's CPU scatter_add/index_add: fp32 for 16-bit floats."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def combine(x: torch.Tensor, row_map: torch.Tensor, num_tokens: int,
            row_probs: Optional[torch.Tensor] = None) -> torch.Tensor:
    """out[t] = sum over rows r with row_map[r] == t, in row order, of x[r] * row_probs[r].

    Exactly megatron-core's unpermute on CPU: the product is rounded to promote(x, probs); the sum
    starts from 0 and accumulates in that dtype's opmath (fp32 for bf16/fp16, as torch's CPU
    scatter_add/index_add do) with one rounding at the end; the result is cast to x.dtype."""
    acc_dtype = x.dtype if row_probs is None else torch.promote_types(x.dtype, row_probs.dtype)
    op = opmath_dtype(acc_dtype)
    out = torch.zeros((num_tokens,) + tuple(x.shape[1:]), dtype=op, device=x.device)
    for r in range(row_map.numel()):
        v = x[r].to(acc_dtype)
        if row_probs is not None:
            # both cast first: a 0-dim prob would otherwise not promote the product
            v = v * row_probs[r].to(acc_dtype)
        out[row_map[r]] += v.to(op)
    return out.to(acc_dtype).to(x.dtype)


def permute_tokens(tokens: torch.Tensor, layout: RoutingLayout,
                   probs: Optional[torch.Tensor] = None):
    out = gather_rows(tokens, layout.row_map)
    return out, (layout.probs_per_row(probs) if probs is not None else None)


def unpermute_tokens(expert_out: torch.Tensor, layout: RoutingLayout,
                     probs: Optional[torch.Tensor] = None) -> torch.Tensor:
    rp = layout.probs_per_row(probs) if probs is not None else None
    return combine(expert_out, layout.row_map, layout.num_tokens, rp)


def hierarchical_order(nodes: int, local: int, inverse: bool = False) -> List[int]:
    """Block order of the output: output block i is input block order[i].
    Forward: input blocks (node, local) -> output blocks (local, node)."""
    if inverse:
        return [l * nodes + n for n in range(nodes) for l in range(local)]
    return [n * local + l for l in range(local) for n in range(nodes)]


def hierarchical_layout(x: torch.Tensor, split_sizes: Union[Sequence[int], torch.Tensor],
                        nodes: int, local: int, inverse: bool = False):
    is_t = torch.is_tensor(split_sizes)
    sizes = [int(s) for s in (split_sizes.tolist() if is_t else split_sizes)]
    order = hierarchical_order(nodes, local, inverse)
    chunks = torch.split(x, sizes, dim=0)
    y = torch.cat([chunks[i] for i in order], dim=0) if chunks else x
    new = [sizes[i] for i in order]
    if torch.is_tensor(split_sizes):
        new = torch.tensor(new, dtype=split_sizes.dtype, device=split_sizes.device)
    return y, new


def mcore_permute(tokens, routing_map, probs=None, num_out_tokens=None, drop_and_pad=False):
    """megatron-core ``permute(fused=False)`` semantics in layout terms."""
    E = routing_map.shape[1]
    if drop_and_pad and num_out_tokens is not None:
        lay = routing_layout_from_map(routing_map, capacity=int(num_out_tokens) // E,
                                      pad_to_capacity=True)
    else:
        lay = routing_layout_from_map(routing_map)
    out, pp = permute_tokens(tokens, lay, probs)
    return out, pp, lay.row_map


def mcore_unpermute(permuted_tokens, sorted_indices, restore_shape, probs=None,
                    routing_map=None, drop_and_pad=False):
    rp = None
    if probs is not None:
        T, E = routing_map.shape
        if drop_and_pad:
            cap = sorted_indices.numel() // E
            expert = torch.arange(sorted_indices.numel(), device=sorted_indices.device) // cap
        else:
            expert = torch.repeat_interleave(torch.arange(E, device=routing_map.device),
                                             routing_map.bool().sum(0))
        rp = probs.reshape(-1)[sorted_indices * E + expert]
    return combine(permuted_tokens, sorted_indices, restore_shape[0], rp)
