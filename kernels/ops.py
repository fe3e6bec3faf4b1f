"""Public ops: autograd Functions over three interchangeable backends.

* ``triton``: the GPU path (``kernels/triton_kernels.py``); also runs on CPU tensors under
  ``TRITON_INTERPRET=1`` (tests).
* ``torch``: the fast CPU path - row maps from one stable sort, ``index_select`` with ``out=``,
  the k copies of a token combined level by level with dense adds (no scatter_add over an
  expanded int64 index, no dense [T, E] transposes), large outputs taken from a small caching pool
  (see ``_CpuBufferPool``).
* ``reference``: ``kernels/reference.py`` (slow, the specification).

Selection (``get_backend``): ``MOE_KERNELS_BACKEND`` env or ``set_backend()``; ``auto`` (default)
picks ``triton`` for CUDA tensors when Triton imports and ``torch`` otherwise.  All backends give
identical permutations/row maps; the ``torch`` and ``reference`` backends give bit-identical
floating outputs to megatron-core's ``permute``/``unpermute`` (fused=False).  The Triton combine
accumulates in fp32 and matches to rounding.
"""

from __future__ import annotations

import contextlib
import math
import os
import threading
from typing import List, Optional, Sequence, Tuple, Union

import torch

from . import reference as ref
from .layout import RoutingLayout, check_capacity, check_experts_per_rank, check_topk

_BACKENDS = ("auto", "triton", "torch", "reference")
_backend = os.environ.get("MOE_KERNELS_BACKEND", "auto").lower()
if _backend not in _BACKENDS:
    raise ValueError(f"MOE_KERNELS_BACKEND={_backend!r}: expected one of {_BACKENDS}")


def set_backend(name: str) -> None:
    """Force a backend for every op: 'auto' | 'triton' | 'torch' | 'reference'."""
    global _backend
    name = name.lower()
    if name not in _BACKENDS:
        raise ValueError(f"kernels.set_backend({name!r}): expected one of {_BACKENDS}")
    _backend = name


@contextlib.contextmanager
def use_backend(name: str):
    prev = _backend
    set_backend(name)
    try:
        yield
    finally:
        set_backend(prev)


def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except Exception:
        return False
    return True


def get_backend(t: Optional[torch.Tensor] = None) -> str:
    """The backend an op on tensor ``t`` will use."""
    if _backend != "auto":
        return _backend
    if t is not None and t.is_cuda and _triton_available():
        return "triton"
    return "torch"


def _tk():
    # imported lazily: TRITON_INTERPRET must be set before the kernels are decorated
    from . import triton_kernels

    return triton_kernels


# --------------------------------------------------------------------------- CPU buffer pool
class _CpuBufferPool:
    """Reuses large CPU output buffers across calls.

    Fresh multi-MB CPU allocations are mmap'd by the allocator and every page faults on first
    touch; for a memory-bound gather that costs several times the copy itself.  CUDA has a caching
    allocator; CPU does not, so the fast path keeps a few byte buffers and hands out views of one
    whose storage nobody else references (storage use count back to the pool's own).  A buffer
    held by the caller, a view of it, or the autograd graph is never handed out again.
    ``MOE_KERNELS_CPU_POOL=0`` or ``set_cpu_pool(False)`` disables it; ``empty_cache()`` frees it.
    """

    MIN_BYTES = 1 << 20

    def __init__(self, max_bytes: int):
        self.enabled = os.environ.get("MOE_KERNELS_CPU_POOL", "1") != "0"
        self.max_bytes = max_bytes
        self._bufs: List[Tuple[torch.Tensor, int]] = []
        self._lock = threading.Lock()

    @staticmethod
    def _uses(buf: torch.Tensor) -> int:
        return torch._C._storage_Use_Count(buf.untyped_storage()._cdata)

    def empty(self, shape, dtype: torch.dtype, device) -> torch.Tensor:
        shape = tuple(int(s) for s in shape)
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        if (not self.enabled or torch.device(device).type != "cpu" or nbytes < self.MIN_BYTES
                or not hasattr(torch._C, "_storage_Use_Count")):
            return torch.empty(shape, dtype=dtype, device=device)
        with self._lock:
            best = None
            for buf, base in self._bufs:
                if buf.numel() >= nbytes and self._uses(buf) == base:
                    if best is None or buf.numel() < best.numel():
                        best = buf
            if best is None:
                total = sum(b.numel() for b, _ in self._bufs)
                # evict free buffers, largest first, to stay under the cap
                for buf, base in sorted(self._bufs, key=lambda p: -p[0].numel()):
                    if total + nbytes <= self.max_bytes:
                        break
                    if self._uses(buf) == base:
                        self._bufs = [p for p in self._bufs if p[0] is not buf]
                        total -= buf.numel()
                if total + nbytes > self.max_bytes:
                    return torch.empty(shape, dtype=dtype, device=device)
                # on the caller's device (always the CPU here): strict device mode trusts it
                best = torch.empty(nbytes, dtype=torch.uint8, device=device)
                self._bufs.append((best, self._uses(best)))
            # set_ (not a view): autograd treats views made inside a custom Function as
            # non-modifiable in place, which would break callers that update the output in place
            return torch.empty(0, dtype=dtype, device=device).set_(best.untyped_storage(), 0, shape)

    def clear(self) -> None:
        with self._lock:
            self._bufs = []


def _default_pool_bytes() -> int:
    try:
        import psutil

        return int(psutil.virtual_memory().total // 8)
    except Exception:
        return 2 << 30


_POOL = _CpuBufferPool(int(os.environ.get("MOE_KERNELS_CPU_POOL_BYTES", _default_pool_bytes())))


def set_cpu_pool(enabled: bool) -> None:
    """Enable/disable the CPU output-buffer pool (``empty_cache()`` frees its buffers)."""
    _POOL.enabled = bool(enabled)


def empty_cache() -> None:
    """Free the CPU buffer pool."""
    _POOL.clear()


# --------------------------------------------------------------------------- fast torch path
def _layout_torch_dense_pad(mask: torch.Tensor, capacity: int, choice: Optional[torch.Tensor],
                            k: int = 0):
    """Pad mode: megatron-core's descending stable argsort of each 0/1 column (routed tokens
    first in token order, then unrouted ones).  ``choice`` [T, E]: top-k slot of each pair
    (top-k form; padding rows get prob index -1), None for the routing-map form (padding rows
    read probs[t, e], as megatron-core does)."""
    T, E = mask.shape
    cap = min(capacity, T)
    m_t = mask.to(torch.int8).t().contiguous()
    sel = m_t.argsort(dim=-1, descending=True, stable=True)[:, :cap]  # [E, cap]
    e = torch.arange(E, device=mask.device).unsqueeze(1).expand(E, cap)
    if choice is None:
        pidx = sel * E + e
    else:
        routed = m_t.gather(1, sel).bool()
        pidx = torch.where(routed, sel * k + choice[sel, e], torch.full_like(sel, -1))
    tpe = torch.full((E,), cap, dtype=torch.long, device=mask.device)
    return sel.reshape(-1), pidx.reshape(-1), tpe


def _drop(order_e_sorted: torch.Tensor, counts: torch.Tensor, capacity: int):
    """keep mask for pairs sorted by expert: rank inside its expert < capacity."""
    starts = torch.cumsum(counts, 0) - counts
    rank = torch.arange(order_e_sorted.numel(), device=counts.device) - starts[order_e_sorted]
    return rank < capacity


def _layout_torch_topk(idx: torch.Tensor, E: int, capacity, pad, epr) -> RoutingLayout:
    T, k = idx.shape
    e_flat = idx.reshape(-1).long()
    counts = torch.bincount(e_flat, minlength=E)
    if pad:
        mask = torch.zeros(T, E, dtype=torch.bool, device=idx.device)
        choice = torch.zeros(T, E, dtype=torch.long, device=idx.device)
        t = torch.arange(T, device=idx.device).unsqueeze(1).expand(T, k)
        mask[t, e_flat.view(T, k)] = True
        choice[t, e_flat.view(T, k)] = torch.arange(k, device=idx.device).expand(T, k)
        row_map, pidx, tpe = _layout_torch_dense_pad(mask, capacity, choice, k)
    else:
        sorted_e, order = torch.sort(e_flat, stable=True)
        tpe = counts
        if capacity is not None:
            keep = _drop(sorted_e, counts, capacity)
            order = order[keep]
            tpe = counts.clamp(max=capacity)
        row_map = torch.div(order, k, rounding_mode="floor")
        pidx = order
    return RoutingLayout(row_map, pidx, tpe, counts, T, E, k, capacity, pad, epr)


def _layout_torch_map(mask: torch.Tensor, capacity, pad, epr) -> RoutingLayout:
    T, E = mask.shape
    counts = mask.sum(0).long()
    if pad:
        row_map, pidx, tpe = _layout_torch_dense_pad(mask, capacity, None)
    else:
        nz = mask.t().nonzero()  # (expert, token) pairs, expert-major, tokens ascending
        e, row_map = nz[:, 0], nz[:, 1]
        tpe = counts
        if capacity is not None:
            keep = _drop(e, counts, capacity)
            e, row_map = e[keep], row_map[keep]
            tpe = counts.clamp(max=capacity)
        pidx = row_map * E + e
    return RoutingLayout(row_map, pidx, tpe, counts, T, E, None, capacity, pad, epr)


def _combine_plan(row_map: torch.Tensor, num_tokens: int):
    """Split rows into levels: level j holds the j-th copy (in row order) of each token, so
    within a level every token occurs once and levels applied in order reproduce the row-order
    summation of a scatter-add.  Returns [(rows, tokens or None when the level is all tokens)]."""
    N = row_map.numel()
    if N == 0:
        return []
    tok_sorted, order = torch.sort(row_map, stable=True)
    counts = torch.bincount(row_map, minlength=num_tokens)
    starts = torch.cumsum(counts, 0) - counts
    level = torch.arange(N, device=row_map.device) - starts[tok_sorted]
    plan = []
    for j in range(int(counts.max())):
        sel = level == j
        rows = order[sel]
        toks = tok_sorted[sel]
        plan.append((rows, None if rows.numel() == num_tokens else toks))
    return plan


def _gather_torch(x: torch.Tensor, row_map: torch.Tensor) -> torch.Tensor:
    out = _POOL.empty((row_map.numel(),) + tuple(x.shape[1:]), x.dtype, x.device)
    return torch.index_select(x, 0, row_map, out=out)


def _bcast(p: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return p.view((-1,) + (1,) * (x.dim() - 1))


# Working set of one chunk of the CPU combine: L3-sized.  Smaller chunks fit L2 but multiply the
# number of ops, and every op is an OpenMP parallel region whose barrier stalls badly when the
# cores are shared with other processes.
_CHUNK_BYTES = int(os.environ.get("MOE_KERNELS_CPU_CHUNK_BYTES", 8 << 20))
# Intra-op threads for the chunk loops (0 = leave torch's setting).  The loops are memory-bound,
# so one thread moves nearly as many bytes as several, and it avoids the per-op OpenMP barrier
# that stalls for a scheduler time slice whenever a core is busy with another process.
_CHUNK_THREADS = int(os.environ.get("MOE_KERNELS_CPU_THREADS", 1))


@contextlib.contextmanager
def _chunk_threads():
    prev = torch.get_num_threads()
    n = _CHUNK_THREADS
    if n <= 0 or n == prev:
        yield
        return
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(prev)


def _combine_torch(x: torch.Tensor, row_map: torch.Tensor, num_tokens: int,
                   row_probs: Optional[torch.Tensor], plan=None) -> torch.Tensor:
    """Same arithmetic as ``reference.combine`` (products rounded to the promoted dtype, opmath
    accumulation - fp32 for 16-bit floats - row order per token), computed level by level (see
    ``_combine_plan``) over cache-sized chunks of tokens, so the gather, upcast, prob multiply and
    add of a chunk stay in cache instead of each streaming the whole tensor through memory."""
    acc = x.dtype if row_probs is None else torch.promote_types(x.dtype, row_probs.dtype)
    op = ref.opmath_dtype(acc)
    feat = tuple(x.shape[1:])
    shape = (num_tokens,) + feat
    if op == x.dtype and plan is None:
        # fp32/fp64: opmath is the dtype itself, so index_add_'s sequential row-order sum is the
        # reference arithmetic exactly; no plan (sort + bincount + levels): at training-size
        # shapes (hundreds of tokens) that bookkeeping cost more than the sum
        src = x if row_probs is None else x * _bcast(row_probs.to(acc), x)
        out = _POOL.empty(shape, x.dtype, x.device)
        return out.zero_().index_add_(0, row_map, src)
    if plan is None:
        plan = _combine_plan(row_map, num_tokens)
    if row_probs is None and 1 <= len(plan) <= 2:
        # what megatron-core's dispatchers call (no probs) with at most 2 copies per token (top-1,
        # top-2, or dropped): 0 + a + b rounded per step equals opmath's one rounding for two
        # terms, so a 16-bit index_add_ (one pass, like megatron-core's scatter_add) is exact
        out = _POOL.empty(shape, x.dtype, x.device)
        return out.zero_().index_add_(0, row_map, x)
    out = _POOL.empty(shape, op, x.device)
    op_size = torch.empty((), dtype=op).element_size()
    row_bytes = max(1, math.prod(feat)) * (x.element_size() + 2 * op_size)
    C = max(1, min(num_tokens, _CHUNK_BYTES // row_bytes))
    starts = list(range(0, num_tokens, C))
    bounds_t = torch.tensor(starts + [num_tokens], dtype=row_map.dtype, device=row_map.device)
    levels = []
    for rows, toks in plan:
        p = row_probs.index_select(0, rows).to(acc) if row_probs is not None else None
        if toks is None:
            levels.append((rows, None, None, p))
        else:
            b = torch.searchsorted(toks, bounds_t).tolist()
            levels.append((rows, toks, b, p))
    tmp = torch.empty((C,) + feat, dtype=x.dtype, device=x.device)
    tmp_acc = torch.empty((C,) + feat, dtype=acc, device=x.device) if acc != x.dtype else None
    tmp_op = torch.empty((C,) + feat, dtype=op, device=x.device) if op != acc else None
    with _chunk_threads():
        _combine_chunks(x, out, starts, C, num_tokens, levels, tmp, tmp_acc, tmp_op)
    if op == x.dtype:
        return out
    res = _POOL.empty(shape, x.dtype, x.device)
    return res.copy_(out if acc == op else out.to(acc))


def _combine_chunks(x, out, starts, C, num_tokens, levels, tmp, tmp_acc, tmp_op):
    op = out.dtype
    for ci, c0 in enumerate(starts):
        c1 = min(num_tokens, c0 + C)
        o = out[c0:c1]
        o.zero_()
        for rows, toks, b, p in levels:
            if toks is None:
                a, z = c0, c1
            else:
                a, z = b[ci], b[ci + 1]
                if a == z:
                    continue
            n = z - a
            g = torch.index_select(x, 0, rows[a:z], out=tmp[:n])
            if p is not None:
                pj = _bcast(p[a:z], g)
                if tmp_acc is not None:  # upcast first: mixed-dtype mul is not vectorized
                    g = tmp_acc[:n].copy_(g)
                g.mul_(pj)
            if tmp_op is not None:
                g = tmp_op[:n].copy_(g)
            elif g.dtype != op:
                g = g.to(op)
            if toks is None:
                o.add_(g)
            else:
                sub = toks[a:z] - c0
                o.index_copy_(0, sub, o.index_select(0, sub).add_(g))


def _combine_backward_torch(grad: torch.Tensor, row_map: torch.Tensor, x: torch.Tensor,
                            p: torch.Tensor, need_gx: bool, need_gp: bool):
    """grad_x[r] = (grad[row_map[r]] * p[r]) in the promoted dtype, cast to x.dtype (bit-identical
    to autograd through megatron-core's unpermute); grad_p[r] = <grad[row_map[r]], x[r]>.  One
    gather per chunk of rows serves both."""
    acc = torch.promote_types(x.dtype, p.dtype)
    N = row_map.numel()
    feat = tuple(x.shape[1:])
    gx = _POOL.empty((N,) + feat, x.dtype, x.device) if need_gx else None
    gp = torch.empty(N, dtype=acc, device=x.device) if need_gp else None
    esz = torch.empty((), dtype=acc).element_size()
    C = max(1, min(N, _CHUNK_BYTES // (max(1, math.prod(feat)) * (grad.element_size() + 2 * esz))))
    tmp = torch.empty((C,) + feat, dtype=grad.dtype, device=x.device)
    tmp_acc = torch.empty((C,) + feat, dtype=acc, device=x.device) if acc != grad.dtype else None
    tmp_x = torch.empty((C,) + feat, dtype=acc, device=x.device) if need_gp else None
    pa = p.to(acc)
    with _chunk_threads():
        for r0 in range(0, N, C):
            _combine_backward_chunk(grad, row_map, x, pa, gx, gp, r0, min(N, r0 + C), tmp,
                                    tmp_acc, tmp_x)
    return gx, gp


def _combine_backward_chunk(grad, row_map, x, pa, gx, gp, r0, r1, tmp, tmp_acc, tmp_x):
    n = r1 - r0
    g = torch.index_select(grad, 0, row_map[r0:r1], out=tmp[:n])
    if tmp_acc is not None:
        g = tmp_acc[:n].copy_(g)
    if gp is not None:
        xa = tmp_x[:n].copy_(x[r0:r1])
        torch.sum(xa.mul_(g).reshape(n, -1), dim=1, out=gp[r0:r1])
    if gx is not None:
        gx[r0:r1].copy_(g.mul_(_bcast(pa[r0:r1], g)))


# --------------------------------------------------------------------------- backend dispatch
def _gather(x, row_map, backend):
    if backend == "triton":
        return _tk().gather_rows(x, row_map)
    if backend == "reference":
        return ref.gather_rows(x, row_map)
    return _gather_torch(x, row_map)


def _combine(x, row_map, num_tokens, row_probs, backend):
    if backend == "triton":
        return _tk().combine(x, row_map, num_tokens, row_probs)
    if backend == "reference":
        return ref.combine(x, row_map, num_tokens, row_probs)
    return _combine_torch(x, row_map, num_tokens, row_probs)


class _GatherRows(torch.autograd.Function):
    """y[r] = x[row_map[r]]; backward: grad_x[t] = sum of grad_y rows mapped to t."""

    @staticmethod
    def forward(ctx, x, row_map, num_src, backend):
        ctx.save_for_backward(row_map)
        ctx.num_src, ctx.backend = num_src, backend
        return _gather(x, row_map, backend)

    @staticmethod
    def backward(ctx, grad):
        (row_map,) = ctx.saved_tensors
        gx = _combine(grad.contiguous(), row_map, ctx.num_src, None, ctx.backend)
        return gx, None, None, None


class _Combine(torch.autograd.Function):
    """out[t] = sum over rows r -> t of x[r] * p[r] (row order, promoted dtype, cast to x.dtype).
    backward: grad_x[r] = grad[row_map[r]] * p[r], grad_p[r] = <grad[row_map[r]], x[r]>."""

    @staticmethod
    def forward(ctx, x, row_probs, row_map, num_tokens, backend):
        ctx.backend = backend
        ctx.has_p = row_probs is not None
        ctx.save_for_backward(x, row_probs if row_probs is not None else x.new_empty(0), row_map)
        return _combine(x, row_map, num_tokens, row_probs, backend)

    @staticmethod
    def backward(ctx, grad):
        x, p, row_map = ctx.saved_tensors
        grad = grad.contiguous()
        if not ctx.has_p:
            gx = _gather(grad, row_map, ctx.backend) if ctx.needs_input_grad[0] else None
            return gx, None, None, None, None
        acc = torch.promote_types(x.dtype, p.dtype)
        gx = gp = None
        need_gx, need_gp = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if ctx.backend == "triton":
            tk = _tk()
            if need_gx:
                gx = tk.gather_rows(grad, row_map, scale=p, acc_dtype=acc).to(x.dtype)
            if need_gp:
                gp = tk.row_dot(grad, row_map, x).to(p.dtype)
        elif ctx.backend == "reference":
            ga = grad[row_map].to(acc)
            if need_gx:
                gx = (ga * _bcast(p.to(acc), ga)).to(x.dtype)
            if need_gp:
                gp = (ga * x.to(acc)).reshape(x.shape[0], math.prod(x.shape[1:])).sum(-1)
                gp = gp.to(p.dtype)
        else:
            gx, gp = _combine_backward_torch(grad, row_map, x, p, need_gx, need_gp)
            gp = gp.to(p.dtype) if gp is not None else None
        return gx, gp, None, None, None


# --------------------------------------------------------------------------- public API
def routing_layout(topk_idx: torch.Tensor, num_experts: int, capacity: Optional[int] = None,
                   pad_to_capacity: bool = False,
                   experts_per_rank: Optional[int] = None) -> RoutingLayout:
    """Layout of the (token, choice) pairs of router top-k indices ``[T, k]`` sorted by expert,
    stable in token order.  ``capacity``: per-expert cap, earliest tokens kept ("position" drop
    policy); ``pad_to_capacity``: every expert gets exactly ``min(capacity, T)`` rows;
    ``experts_per_rank``: enables ``layout.tokens_per_rank`` (rank-major expert placement).
    See ``kernels/layout.py`` for the exact conventions."""
    b = get_backend(topk_idx)
    check_topk(topk_idx, num_experts, on_device=b == "triton")
    check_capacity(capacity, pad_to_capacity)
    check_experts_per_rank(num_experts, experts_per_rank)
    if b == "triton":
        return _tk().routing_layout(topk_idx, None, num_experts, capacity, pad_to_capacity,
                                    experts_per_rank)
    if b == "reference":
        return ref.routing_layout(topk_idx, num_experts, capacity, pad_to_capacity,
                                  experts_per_rank)
    return _layout_torch_topk(topk_idx, num_experts, capacity, pad_to_capacity, experts_per_rank)


def routing_layout_from_map(routing_map: torch.Tensor, capacity: Optional[int] = None,
                            pad_to_capacity: bool = False,
                            experts_per_rank: Optional[int] = None,
                            num_rows: Optional[int] = None) -> RoutingLayout:
    """Same as ``routing_layout`` for megatron-core's bool routing map ``[T, E]``
    (probs are then dense ``[T, E]``).  ``num_rows``: the number of routed pairs when the caller
    knows it on the host (megatron-core's ``num_out_tokens``); the Triton path then sizes its
    output without reading it back from the device (checked on the device, asynchronously)."""
    if routing_map.dim() != 2:
        raise ValueError(f"routing_map must be [tokens, experts], got {tuple(routing_map.shape)}")
    check_capacity(capacity, pad_to_capacity)
    check_experts_per_rank(routing_map.shape[1], experts_per_rank)
    mask = routing_map.bool()
    b = get_backend(routing_map)
    if b == "triton":
        return _tk().routing_layout(None, mask, mask.shape[1], capacity, pad_to_capacity,
                                    experts_per_rank, num_rows=num_rows)
    if b == "reference":
        return ref.routing_layout_from_map(mask, capacity, pad_to_capacity, experts_per_rank)
    return _layout_torch_map(mask, capacity, pad_to_capacity, experts_per_rank)


def _check_rows(x: torch.Tensor, what: str, n: int, where: str) -> None:
    if x.dim() < 1 or x.shape[0] != n:
        raise ValueError(f"{where}: {what} has {x.shape[0] if x.dim() else 0} rows, expected {n}")


def permute_tokens(tokens: torch.Tensor, layout: RoutingLayout,
                   probs: Optional[torch.Tensor] = None):
    """Gather ``tokens [T, h]`` into the layout's expert-sorted rows (top-k duplication).
    Returns ``(permuted [N, h], permuted_probs [N] or None)``; differentiable in both."""
    _check_rows(tokens, "tokens", layout.num_tokens, "kernels.permute_tokens")
    b = get_backend(tokens)
    out = _GatherRows.apply(tokens.contiguous(), layout.row_map, layout.num_tokens, b)
    return out, (layout.probs_per_row(probs) if probs is not None else None)


def unpermute_tokens(expert_out: torch.Tensor, layout: RoutingLayout,
                     probs: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Scatter ``expert_out [N, h]`` back to token order, weighting each copy by its prob
    (``probs``: ``[T, k]`` top-k form / ``[T, E]`` map form, or None for a plain sum) and summing
    the copies of each token.  Differentiable in ``expert_out`` and ``probs``."""
    _check_rows(expert_out, "expert_out", layout.num_rows, "kernels.unpermute_tokens")
    b = get_backend(expert_out)
    rp = layout.probs_per_row(probs) if probs is not None else None
    return _Combine.apply(expert_out.contiguous(), rp, layout.row_map, layout.num_tokens, b)


def permute(tokens: torch.Tensor, routing_map: torch.Tensor, probs: Optional[torch.Tensor] = None,
            num_out_tokens: Optional[int] = None, drop_and_pad: bool = False, *,
            fused: Optional[bool] = None):
    """Drop-in for megatron-core ``moe_utils.permute(..., fused=False)``: returns
    ``(permuted_input, permuted_probs, sorted_indices)``, bit-identical to it.  ``fused`` is
    accepted and ignored so this can replace megatron-core's function in its dispatchers."""
    if tokens.dim() != 2:
        raise ValueError(f"kernels.permute: tokens must be [num_tokens, hidden], "
                         f"got {tuple(tokens.shape)}")
    if routing_map.shape[0] != tokens.shape[0]:
        raise ValueError(f"kernels.permute: routing_map has {routing_map.shape[0]} rows, tokens "
                         f"{tokens.shape[0]}")
    E = routing_map.shape[1]
    if drop_and_pad and num_out_tokens is not None:
        layout = routing_layout_from_map(routing_map, capacity=int(num_out_tokens) // E,
                                         pad_to_capacity=True)
    else:  # megatron-core's unfused permute ignores num_out_tokens; the Triton path sizes its
        # output with it (a host int, or a CPU tensor after megatron-core's D2H point) instead of
        # reading the routed-pair count back from the GPU
        hint = None
        if num_out_tokens is not None and not (torch.is_tensor(num_out_tokens)
                                               and num_out_tokens.device.type != "cpu"):
            hint = int(num_out_tokens)
        layout = routing_layout_from_map(routing_map, num_rows=hint)
    out, pp = permute_tokens(tokens, layout, probs)
    return out, pp, layout.row_map


def unpermute(permuted_tokens: torch.Tensor, sorted_indices: torch.Tensor,
              restore_shape: torch.Size, probs: Optional[torch.Tensor] = None,
              routing_map: Optional[torch.Tensor] = None,
              drop_and_pad: bool = False, *, fused: Optional[bool] = None) -> torch.Tensor:
    """Drop-in for megatron-core ``moe_utils.unpermute(..., fused=False)``, bit-identical
    (``fused`` accepted and ignored, see ``permute``)."""
    rp = None
    b = get_backend(permuted_tokens)
    if probs is not None:
        if routing_map is None:
            raise ValueError("kernels.unpermute: routing_map must be given with probs")
        T, E = routing_map.shape
        N = sorted_indices.numel()
        if drop_and_pad:
            if N % E:
                raise ValueError(f"kernels.unpermute(drop_and_pad=True): {N} rows is not a "
                                 f"multiple of num_experts={E}")
            expert = torch.div(torch.arange(N, device=sorted_indices.device), N // E,
                               rounding_mode="floor")
        else:
            counts = routing_map.bool().sum(0)
            if b == "triton":   # GPU path: check on the device, never read the count back
                torch._assert_async(counts.sum() == N,
                                    "kernels.unpermute: routing_map's routed pairs != rows")
            elif int(counts.sum()) != N:
                raise ValueError(f"kernels.unpermute: routing_map has {int(counts.sum())} routed "
                                 f"pairs but sorted_indices has {N} rows")
            # output_size: repeat_interleave would otherwise read sum(counts) back from the GPU
            expert = torch.repeat_interleave(torch.arange(E, device=routing_map.device), counts,
                                             output_size=N)
        rp = probs.reshape(-1).index_select(0, sorted_indices * E + expert)
    _check_rows(permuted_tokens, "permuted_tokens", sorted_indices.numel(), "kernels.unpermute")
    return _Combine.apply(permuted_tokens.contiguous(), rp, sorted_indices, int(restore_shape[0]),
                          b).view(restore_shape)


def hierarchical_layout(x: torch.Tensor, split_sizes: Union[Sequence[int], torch.Tensor],
                        nodes: int, local: int, inverse: bool = False):
    """Stride swap between the two phases of a 2D (hierarchical) all-to-all.

    ``x`` is ``[sum(split_sizes), ...]``: ``world = nodes * local`` contiguous row blocks, block
    ``b`` holding ``split_sizes[b]`` rows (sizes may differ, may be 0).  Forward
    (``inverse=False``): blocks are in (node, local) order, ``b = node * local + local_rank``,
    and are reordered to (local, node) order, output block ``local_rank * nodes + node``; so the
    blocks bound for the same local rank on every node become one contiguous run.  ``inverse=True``
    undoes it: input in (local, node) order with ``split_sizes`` in that order, output in
    (node, local) order.  Returns ``(y, new_splits)`` with ``new_splits`` the block sizes in the
    output order (a list for a list input, a tensor for a tensor input).  Differentiable in ``x``
    (backward is the opposite transform).
    """
    if nodes <= 0 or local <= 0:
        raise ValueError(f"kernels.hierarchical_layout: nodes={nodes}, local={local} must be > 0")
    is_t = torch.is_tensor(split_sizes)
    sizes = [int(s) for s in (split_sizes.tolist() if is_t else split_sizes)]
    if len(sizes) != nodes * local:
        raise ValueError(f"kernels.hierarchical_layout: {len(sizes)} split sizes for "
                         f"nodes*local={nodes * local} blocks")
    if any(s < 0 for s in sizes) or sum(sizes) != x.shape[0]:
        raise ValueError(f"kernels.hierarchical_layout: split sizes {sizes} must be >= 0 and sum "
                         f"to x.shape[0]={x.shape[0]}")
    order = ref.hierarchical_order(nodes, local, inverse)
    new = [sizes[i] for i in order]
    b = get_backend(x)
    if b == "reference":
        y, _ = ref.hierarchical_layout(x, sizes, nodes, local, inverse)
    else:
        # row map: output row -> input row (block start in input + offset inside block)
        src_start = [0] * len(sizes)
        acc = 0
        for i, s in enumerate(sizes):
            src_start[i] = acc
            acc += s
        starts = torch.tensor([src_start[i] for i in order], dtype=torch.long)
        lens = torch.tensor(new, dtype=torch.long)
        dst_start = torch.cumsum(lens, 0) - lens
        row_map = (torch.repeat_interleave(starts - dst_start, lens)
                   + torch.arange(x.shape[0])).to(x.device)
        y = _GatherRows.apply(x.contiguous(), row_map, x.shape[0], b)
    if is_t:
        new = torch.tensor(new, dtype=split_sizes.dtype, device=split_sizes.device)
    return y, new
