"""Triton kernels (the GPU path).  They run on CPU tensors under ``TRITON_INTERPRET=1``, which
must be set before this module is imported (``kernels.ops`` imports it lazily).

Kernels:
* ``_layout_count_kernel`` / ``_layout_scatter_kernel``: routing -> layout.  Pass 1 counts the
  pairs of each expert per block of tokens; a tiny [blocks, E] cumsum on the host gives each
  block's start inside its expert; pass 2 ranks each pair inside its block with a cumsum over
  tokens and writes ``row_map``/``prob_index`` at ``expert_base + rank`` (stable by construction),
  dropping ranks >= capacity and, in pad mode, filling with the expert's unrouted tokens.
* ``_gather_rows_kernel``: permute (and the hierarchical block reorder, and grad of combine).
* ``_combine_kernel``: unpermute + prob weighting + sum of the copies, one program per
  (token, hidden block), reading each token's rows in row order from a CSR (rows sorted by
  token, per-token bounds).

Host synchronisations (docs/kernels.md, tests/test_kernels_sync.py): none on the permute/unpermute
path when the output size is known on the host - the top-k form without capacity (T * k rows), pad
mode (E * min(C, T) rows), or a caller-supplied ``num_rows`` (megatron-core passes
``num_out_tokens``).  Otherwise ``routing_layout`` reads the row count once (``int(tpe.sum())``):
the output's allocation needs it.
* ``_row_dot_kernel``: grad of the probs, <grad_out[row_map[r]], x[r]>.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import triton
import triton.language as tl

from .layout import RoutingLayout

INTERPRETED = bool(triton.knobs.runtime.interpret) if hasattr(triton, "knobs") else False


@triton.jit
def _pairs(idx_ptr, mask_ptr, t, e, T, E, K: tl.constexpr, IS_TOPK: tl.constexpr,
           BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr):
    """M[t, e] = 1 if token t routes to expert e; J[t, e] = its choice slot (top-k form)."""
    tv = t < T
    ev = e < E
    t64 = t.to(tl.int64)
    if IS_TOPK:
        M = tl.zeros((BLOCK_T, BLOCK_E), dtype=tl.int32)
        J = tl.zeros((BLOCK_T, BLOCK_E), dtype=tl.int32)
        for j in tl.static_range(K):
            ij = tl.load(idx_ptr + t64 * K + j, mask=tv, other=-1).to(tl.int32)
            hit = (ij[:, None] == e[None, :]) & ev[None, :]
            M += hit.to(tl.int32)
            J = tl.where(hit, j, J)
    else:
        m = tl.load(mask_ptr + t64[:, None] * E + e[None, :], mask=tv[:, None] & ev[None, :],
                    other=0)
        M = (m != 0).to(tl.int32)
        J = tl.zeros((BLOCK_T, BLOCK_E), dtype=tl.int32)
    return M, J


@triton.jit
def _layout_count_kernel(idx_ptr, mask_ptr, counts_ptr, T, E, K: tl.constexpr,
                         IS_TOPK: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr):
    pid = tl.program_id(0)
    t = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    e = tl.arange(0, BLOCK_E)
    M, J = _pairs(idx_ptr, mask_ptr, t, e, T, E, K, IS_TOPK, BLOCK_T, BLOCK_E)
    tl.store(counts_ptr + pid * E + e, tl.sum(M, axis=0), mask=e < E)


@triton.jit
def _layout_scatter_kernel(idx_ptr, mask_ptr, prefix_ptr, base_ptr, kept_ptr, row_ptr, pidx_ptr,
                           T, E, cap, K: tl.constexpr, IS_TOPK: tl.constexpr,
                           HAS_CAP: tl.constexpr, PAD: tl.constexpr, BLOCK_T: tl.constexpr,
                           BLOCK_E: tl.constexpr):
    pid = tl.program_id(0)
    t = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    e = tl.arange(0, BLOCK_E)
    ev = e < E
    valid = (t < T)[:, None] & ev[None, :]
    M, J = _pairs(idx_ptr, mask_ptr, t, e, T, E, K, IS_TOPK, BLOCK_T, BLOCK_E)
    pre = tl.load(prefix_ptr + pid * E + e, mask=ev, other=0)
    base = tl.load(base_ptr + e, mask=ev, other=0).to(tl.int64)
    rank = pre[None, :] + tl.cumsum(M, axis=0) - 1
    keep = (M > 0) & valid
    if HAS_CAP:
        keep = keep & (rank < cap)
    t2 = tl.zeros((BLOCK_T, BLOCK_E), dtype=tl.int64) + t.to(tl.int64)[:, None]
    e2 = tl.zeros((BLOCK_T, BLOCK_E), dtype=tl.int64) + e.to(tl.int64)[None, :]
    if IS_TOPK:
        pidx = t2 * K + J.to(tl.int64)
    else:
        pidx = t2 * E + e2
    dest = base[None, :] + rank.to(tl.int64)
    tl.store(row_ptr + dest, t2, mask=keep)
    tl.store(pidx_ptr + dest, pidx, mask=keep)
    if PAD:
        # unrouted tokens of each expert, ascending, fill the rows after its kept tokens
        Z = (1 - M) * valid.to(tl.int32)
        zrank = (pid * BLOCK_T - pre)[None, :] + tl.cumsum(Z, axis=0) - 1
        kept = tl.load(kept_ptr + e, mask=ev, other=0)
        pos = kept[None, :] + zrank
        keep_p = (Z > 0) & (pos < cap)
        dest_p = base[None, :] + pos.to(tl.int64)
        if IS_TOPK:
            pidx_p = tl.zeros((BLOCK_T, BLOCK_E), dtype=tl.int64) - 1
        else:
            pidx_p = t2 * E + e2
        tl.store(row_ptr + dest_p, t2, mask=keep_p)
        tl.store(pidx_ptr + dest_p, pidx_p, mask=keep_p)


@triton.jit
def _gather_rows_kernel(x_ptr, row_ptr, scale_ptr, out_ptr, H, HAS_SCALE: tl.constexpr,
                        BLOCK_H: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hm = offs < H
    src = tl.load(row_ptr + r).to(tl.int64)
    v = tl.load(x_ptr + src * H + offs, mask=hm, other=0)
    if HAS_SCALE:
        s = tl.load(scale_ptr + r)
        v = v.to(out_ptr.dtype.element_ty) * s.to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + r * H + offs, v.to(out_ptr.dtype.element_ty), mask=hm)


@triton.jit
def _combine_kernel(x_ptr, order_ptr, bounds_ptr, p_ptr, out_ptr, H, HAS_P: tl.constexpr,
                    ACC_F64: tl.constexpr, BLOCK_H: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hm = offs < H
    if ACC_F64:
        acc = tl.zeros((BLOCK_H,), dtype=tl.float64)
    else:
        acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    # the token's rows, in row order: order[bounds[t]:bounds[t + 1]] (CSR by token, built on the
    # device without knowing the largest number of copies, so no host round trip)
    start = tl.load(bounds_ptr + t)
    end = tl.load(bounds_ptr + t + 1)
    for j in range(start, end):
        r = tl.load(order_ptr + j).to(tl.int64)
        v = tl.load(x_ptr + r * H + offs, mask=hm, other=0).to(acc.dtype)
        if HAS_P:
            p = tl.load(p_ptr + r).to(acc.dtype)
            v = v * p
        acc += v
    tl.store(out_ptr + t * H + offs, acc.to(out_ptr.dtype.element_ty), mask=hm)


@triton.jit
def _row_dot_kernel(g_ptr, row_ptr, x_ptr, out_ptr, H, ACC_F64: tl.constexpr,
                    BLOCK_H: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    src = tl.load(row_ptr + r).to(tl.int64)
    if ACC_F64:
        acc = tl.zeros((BLOCK_H,), dtype=tl.float64)
    else:
        acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for h0 in range(0, H, BLOCK_H):
        offs = h0 + tl.arange(0, BLOCK_H)
        hm = offs < H
        g = tl.load(g_ptr + src * H + offs, mask=hm, other=0).to(acc.dtype)
        x = tl.load(x_ptr + r * H + offs, mask=hm, other=0).to(acc.dtype)
        acc += g * x
    tl.store(out_ptr + r, tl.sum(acc, axis=0))


# --------------------------------------------------------------------------- host wrappers
def _2d(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(x.shape[0], math.prod(x.shape[1:])).contiguous()


def _block_h(H: int) -> int:
    return max(16, min(1024, triton.next_power_of_2(max(H, 1))))


def routing_layout(topk_idx: Optional[torch.Tensor], mask: Optional[torch.Tensor], E: int,
                   capacity: Optional[int], pad: bool, epr: Optional[int],
                   num_rows: Optional[int] = None) -> RoutingLayout:
    is_topk = topk_idx is not None
    src = topk_idx.contiguous() if is_topk else mask.contiguous().view(torch.uint8)
    T = src.shape[0]
    K = src.shape[1] if is_topk else 1
    dev = src.device
    BLOCK_E = max(16, triton.next_power_of_2(E))
    BLOCK_T = max(16, min(128, triton.next_power_of_2(max(1, 4096 // BLOCK_E))))
    nb = max(1, triton.cdiv(T, BLOCK_T))
    idx_arg = src if is_topk else torch.empty(1, dtype=torch.long, device=dev)
    mask_arg = src if not is_topk else torch.empty(1, dtype=torch.uint8, device=dev)
    counts = torch.zeros(nb, E, dtype=torch.int32, device=dev)
    if T:
        _layout_count_kernel[(nb,)](idx_arg, mask_arg, counts, T, E, K=K, IS_TOPK=is_topk,
                                    BLOCK_T=BLOCK_T, BLOCK_E=BLOCK_E)
    prefix = (torch.cumsum(counts, 0) - counts).to(torch.int32).contiguous()
    routed = counts.sum(0).long()
    if pad:
        cap = min(int(capacity), T)
        kept = routed.clamp(max=cap)
        tpe = torch.full((E,), cap, dtype=torch.long, device=dev)
    else:
        cap = int(capacity) if capacity is not None else 0
        kept = routed.clamp(max=cap) if capacity is not None else routed
        tpe = kept
    base = (torch.cumsum(tpe, 0) - tpe).contiguous()
    # the output size, from the host when it is known there (no device->host round trip)
    if pad:
        n_rows = cap * E
    elif is_topk and capacity is None:
        n_rows = T * K
    elif num_rows is not None:
        n_rows = int(num_rows)
        torch._assert_async(tpe.sum() == n_rows, "routing_layout: num_rows != routed pairs")
    else:
        n_rows = int(tpe.sum())   # data-dependent (map form or dropping): the one sync left
    row_map = torch.empty(n_rows, dtype=torch.long, device=dev)
    pidx = torch.empty(n_rows, dtype=torch.long, device=dev)
    if T and n_rows:
        _layout_scatter_kernel[(nb,)](idx_arg, mask_arg, prefix, base,
                                      kept.to(torch.int32).contiguous(), row_map, pidx, T, E, cap,
                                      K=K, IS_TOPK=is_topk, HAS_CAP=capacity is not None,
                                      PAD=pad, BLOCK_T=BLOCK_T, BLOCK_E=BLOCK_E)
    return RoutingLayout(row_map, pidx, tpe, routed, T, E, K if is_topk else None, capacity, pad,
                         epr)


def gather_rows(x: torch.Tensor, row_map: torch.Tensor, scale: Optional[torch.Tensor] = None,
                acc_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    N = row_map.numel()
    x2 = _2d(x)
    H = x2.shape[1]
    out_dtype = acc_dtype if (scale is not None and acc_dtype is not None) else x.dtype
    out = torch.empty((N,) + tuple(x.shape[1:]), dtype=out_dtype, device=x.device)
    if N and H:
        BH = _block_h(H)
        _gather_rows_kernel[(N, triton.cdiv(H, BH))](
            x2, row_map.contiguous(), scale.contiguous() if scale is not None else x2, out, H,
            HAS_SCALE=scale is not None, BLOCK_H=BH)
    return out


def token_csr(row_map: torch.Tensor, num_tokens: int):
    """Rows grouped by token, row order kept (stable sort), and each token's [start, end) in that
    order: all on the device, no sizes read back to the host."""
    order = torch.sort(row_map, stable=True)[1]
    tok_sorted = row_map.index_select(0, order)
    bounds = torch.searchsorted(tok_sorted, torch.arange(num_tokens + 1, device=row_map.device,
                                                         dtype=row_map.dtype))
    return order, bounds


def combine(x: torch.Tensor, row_map: torch.Tensor, num_tokens: int,
            row_probs: Optional[torch.Tensor]) -> torch.Tensor:
    x2 = _2d(x)
    H = x2.shape[1]
    out = torch.zeros((num_tokens,) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    if num_tokens and H and row_map.numel():
        acc = x.dtype if row_probs is None else torch.promote_types(x.dtype, row_probs.dtype)
        order, bounds = token_csr(row_map, num_tokens)
        BH = _block_h(H)
        _combine_kernel[(num_tokens, triton.cdiv(H, BH))](
            x2, order, bounds, row_probs.contiguous() if row_probs is not None else x2, out, H,
            HAS_P=row_probs is not None, ACC_F64=acc == torch.float64, BLOCK_H=BH)
    return out


def row_dot(g: torch.Tensor, row_map: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    N = row_map.numel()
    x2 = _2d(x)
    g2 = _2d(g)
    H = x2.shape[1]
    f64 = torch.float64 in (x.dtype, g.dtype)
    out = torch.zeros(N, dtype=torch.float64 if f64 else torch.float32, device=x.device)
    if N and H:
        _row_dot_kernel[(N,)](g2, row_map.contiguous(), x2, out, H, ACC_F64=f64,
                              BLOCK_H=min(_block_h(H), 256))
    return out
