"""Pluggable all-to-all (flat | hierarchical | pipe | user-defined) with autograd and compression.

``all_to_all(input, output_split_sizes, input_split_sizes, group, algorithm="flat",
ranks_per_node=None, compression="none")`` returns what ``torch.distributed.all_to_all_single``
returns (dim-0 row blocks, uneven splits, any dtype/shape), differentiable: the backward is the
reverse exchange (splits swapped) with the same algorithm and compressor.

Algorithms see only 2-D ``uint8`` tensors ``[rows, bytes_per_row]`` (a byte view of the payload),
so every algorithm is bit-exact by construction and dtype-agnostic; a user algorithm registered
with :func:`register_algorithm` gets the same contract::

    fn(x_bytes, output_split_sizes: list[int], input_split_sizes: list[int], group,
       ranks_per_node: int) -> Tensor[sum(output_split_sizes), bytes_per_row] (uint8)

Ranks are node-major within ``group`` (``node = group_rank // ranks_per_node``). An explicit
``ranks_per_node`` counts members of ``group`` per node; ``None`` derives it from the process-wide
topology (``--ranks-per-node``/``--topology-file``/``LOCAL_WORLD_SIZE``) and the group's global
ranks, e.g. an EP group [0, 2, 4, 6] on 4-GPU nodes has 2 members per node.

* ``flat``: one ``all_to_all_single``.
* ``hierarchical`` (2DH, Tutel/DeepSpeed/MoESys): stride copy (node, local) -> (local, node),
  intra-node all-to-all, stride copy, inter-node all-to-all among ranks with the same local
  rank. Each rank sends N-1 inter-node messages of ~M*S/P bytes instead of P-M of S/P. Per-peer
  counts for the intra phase are exchanged first (one tiny intra-node all-to-all of N ints).
* ``pipe`` (ScheMoE Pipe-A2A): one phase of direct send/recv; intra-node peers on the parent
  communicator, inter-node peers on a second communicator over the same ranks, both batches in
  flight at once (two NCCL streams on GPU; concurrent async ops on gloo).
"""

from __future__ import annotations

import collections
import contextlib
import math
import time
from typing import Callable, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from megatron_moe.runtime import topology
from megatron_moe.comm import link
from megatron_moe.comm.compress import get_compression

__all__ = ["all_to_all", "all_to_all_async", "count_exchanges", "register_algorithm", "available_algorithms", "get_algorithm",
           "wire_stats", "formula_wire_stats", "count_wire_bytes", "start_all_to_all",
           "normalize_splits"]


# ---------------------------------------------------------------------------------------------
# helpers

def _group_size(group) -> int:
    return dist.get_world_size(group)


def _group_rank(group) -> int:
    return dist.get_rank(group)


def normalize_splits(splits, rows: int, world: int, what: str) -> List[int]:
    """None -> equal split (like all_to_all_single); tensor/sequence -> list of ints."""
    if splits is None:
        if rows % world:
            raise ValueError(f"all_to_all: {what}=None needs dim 0 ({rows}) divisible by the group "
                             f"size {world}")
        return [rows // world] * world
    out = [int(s) for s in (splits.tolist() if torch.is_tensor(splits) else splits)]
    if len(out) != world or any(s < 0 for s in out):
        raise ValueError(f"all_to_all: {what}={out} must have {world} non-negative entries")
    return out


def _resolve_rpn(ranks_per_node, group) -> int:
    """Explicit ``ranks_per_node`` counts within ``group``; None derives it from the topology."""
    if not ranks_per_node:
        return topology.ranks_per_node_in(group)
    rpn = int(ranks_per_node)
    topology.check_divisible(_group_size(group), rpn, "all-to-all group size")
    return rpn


def _offsets(sizes):
    acc, out = 0, []
    for s in sizes:
        out.append(acc)
        acc += s
    return out


def _layout(x, sizes, nodes, local):
    """(node, local) block order -> (local, node); kernels.hierarchical_layout when present."""
    try:
        import kernels

        fn = getattr(kernels, "hierarchical_layout", None)
    except ImportError:
        fn = None
    if fn is not None:
        y, _ = fn(x, list(sizes), nodes, local)
        return y
    chunks = torch.split(x, list(sizes), dim=0)
    return torch.cat([chunks[n * local + l] for l in range(local) for n in range(nodes)], dim=0)


# byte accounting of what the algorithms actually put on the wire (tests, bench)
_COUNTERS: List[dict] = []


@contextlib.contextmanager
def count_wire_bytes():
    """Count bytes/messages this rank sends, per link class, inside the block."""
    c = {"intra_bytes": 0, "inter_bytes": 0, "intra_msgs": 0, "inter_msgs": 0}
    _COUNTERS.append(c)
    try:
        yield c
    finally:
        _COUNTERS.remove(c)


def record_wire_bytes(intra: bool, nbytes: int) -> None:
    """Count one message of ``nbytes`` on an intra- (True) or inter-node link in every open
    ``count_wire_bytes`` block. A registered algorithm calls this for each send it issues."""
    if nbytes <= 0 or not _COUNTERS:
        return
    k = "intra" if intra else "inter"
    for c in _COUNTERS:
        c[k + "_bytes"] += int(nbytes)
        c[k + "_msgs"] += 1


_EXCHANGES: List[collections.Counter] = []


@contextlib.contextmanager
def count_exchanges():
    """Count the exchanges issued inside the block by ``(algorithm, compression)``; compression is
    the compressor that really ran (``"none"`` when it does not apply to the payload's dtype).
    Tests use it to prove that a layer really ran the configured algorithm and compressor."""
    c: collections.Counter = collections.Counter()
    _EXCHANGES.append(c)
    try:
        yield c
    finally:
        _EXCHANGES.remove(c)


# ---------------------------------------------------------------------------------------------
# algorithms (x: uint8 [rows, row_bytes], contiguous)

class _Done:
    def wait(self):
        return None


def _flat(x, out_splits, in_splits, group, rpn, async_op=False):
    me, rb = _group_rank(group), x.shape[1]
    for j, s in enumerate(in_splits):
        if j != me:
            record_wire_bytes(j // rpn == me // rpn, s * rb)
    out = x.new_empty((sum(out_splits), rb))
    work = dist.all_to_all_single(out, x, out_splits, in_splits, group=group, async_op=async_op)
    return (out, work) if async_op else out


def _hierarchical(x, out_splits, in_splits, group, rpn, async_op=False):
    P = _group_size(group)
    M, N = rpn, P // rpn
    me = _group_rank(group)
    n0, g0 = divmod(me, M)
    rb = x.shape[1]
    hg = topology.hierarchy_groups(group, M)
    # counts travel as tensors on the data's device (NCCL refuses host tensors); the host needs
    # them as lists for the split sizes, one device-to-host copy
    ins = torch.tensor(in_splits, dtype=torch.long, device=x.device).view(N, M)  # [dest node, dest local]
    # phase 0: stride copy so the N blocks for each local rank are contiguous
    x1 = _layout(x, in_splits, N, M)
    send1 = [sum(in_splits[n * M + h] for n in range(N)) for h in range(M)]
    # counts: local h learns, from each local g', the N block sizes it will forward
    cnt_recv = torch.empty((M, N), dtype=torch.long, device=x.device)
    dist.all_to_all_single(cnt_recv, ins.t().contiguous(), group=hg.intra)
    cnt_host = cnt_recv.tolist()                                     # [source local][dest node]
    recv1 = [sum(row) for row in cnt_host]
    for h, s in enumerate(send1):
        if h != g0:
            record_wire_bytes(True, s * rb)
    y1 = x.new_empty((sum(recv1), rb))
    dist.all_to_all_single(y1, x1, recv1, send1, group=hg.intra)
    # phase 2: (source local, dest node) -> (dest node, source local)
    x2 = _layout(y1, [c for row in cnt_host for c in row], M, N)
    send2 = [sum(cnt_host[g][n] for g in range(M)) for n in range(N)]
    recv2 = [sum(out_splits[n * M:(n + 1) * M]) for n in range(N)]
    for n, s in enumerate(send2):
        if n != n0:
            record_wire_bytes(False, s * rb)
    out = x.new_empty((sum(out_splits), rb))
    # phase 3: inter-node among same local rank; arrives in global source-rank order
    dist.all_to_all_single(out, x2, recv2, send2, group=hg.inter)
    return (out, _Done()) if async_op else out


_PIPE_SEQ = 0
_PIPE_TAG_BASE = 1 << 24


class _Works:
    def __init__(self, works):
        self.works = works

    def wait(self):
        for w in self.works:
            w.wait()


def _pipe(x, out_splits, in_splits, group, rpn, async_op=False):
    P = _group_size(group)
    me = _group_rank(group)
    rb = x.shape[1]
    hg = topology.hierarchy_groups(group, rpn)
    out = x.new_empty((sum(out_splits), rb))
    ioff, ooff = _offsets(in_splits), _offsets(out_splits)
    if in_splits[me]:  # self: local copy
        out[ooff[me]:ooff[me] + out_splits[me]].copy_(x[ioff[me]:ioff[me] + in_splits[me]])
    intra_ops, inter_ops = [], []
    # a fresh tag per exchange keeps overlapping pipe exchanges (chunked schedule) apart on gloo;
    # every rank issues exchanges in the same program order, so the tags agree; offset above the
    # balance placements' p2p tags (Trans/Agg/moves may be in flight on the same group)
    global _PIPE_SEQ
    _PIPE_SEQ += 1
    tag = _PIPE_TAG_BASE + _PIPE_SEQ % (1 << 20)
    for j in range(P):
        if j == me:
            continue
        intra = j // rpn == me // rpn
        pg = group if intra else hg.channel2
        peer = dist.get_global_rank(group, j)
        ops = intra_ops if intra else inter_ops
        # zero-size transfers are skipped on both sides (both know the size)
        if in_splits[j]:
            record_wire_bytes(intra, in_splits[j] * rb)
            ops.append(dist.P2POp(dist.isend, x[ioff[j]:ioff[j] + in_splits[j]], peer, group=pg,
                                  tag=tag))
        if out_splits[j]:
            ops.append(dist.P2POp(dist.irecv, out[ooff[j]:ooff[j] + out_splits[j]], peer, group=pg,
                                  tag=tag))
    works = []
    for ops in (intra_ops, inter_ops):  # two channels in flight together
        if ops:
            works.extend(dist.batch_isend_irecv(ops))
    handle = _Works(works)
    if async_op:
        return out, handle
    handle.wait()
    return out


class _Algorithm:
    def __init__(self, name, fn, supports_async):
        self.name, self.fn, self.supports_async = name, fn, supports_async


_ALGOS: Dict[str, _Algorithm] = {}


def register_algorithm(name: str, fn: Callable, supports_async: bool = False) -> None:
    """Register ``fn(x_bytes, output_split_sizes, input_split_sizes, group, ranks_per_node)``.

    With ``supports_async=True`` it must also accept ``async_op=True`` and then return
    ``(output, handle)`` with ``handle.wait()``; the chunked scheduler then overlaps it.
    """
    if not isinstance(name, str) or not name or not callable(fn):
        raise ValueError("register_algorithm(name, fn): name must be a string, fn callable")
    _ALGOS[name] = _Algorithm(name, fn, supports_async)


def get_algorithm(name) -> _Algorithm:
    try:
        return _ALGOS[name or "flat"]
    except KeyError:
        raise ValueError(f"--moe-a2a-algorithm={name!r}: unknown; registered: "
                         f"{sorted(_ALGOS)}") from None


def available_algorithms():
    return sorted(_ALGOS)


register_algorithm("flat", _flat, supports_async=True)
register_algorithm("hierarchical", _hierarchical, supports_async=False)
register_algorithm("pipe", _pipe, supports_async=True)


# ---------------------------------------------------------------------------------------------
# exchange (compress -> algorithm -> decompress) and its autograd wrapper

class _Pending:
    """An issued exchange; ``wait()`` returns the decompressed output."""

    def __init__(self, out_b, handle, wire_dtype, decompress, out_shape, link_bytes=0, started=None):
        self.out_b, self.handle, self.wire_dtype = out_b, handle, wire_dtype
        self.decompress, self.out_shape = decompress, out_shape
        # this rank's window on an emulated link (comm/link.py): an asynchronous exchange holds it
        # from its issue (reserved now), a blocking one (``started``: when its real exchange began,
        # the rank blocked since) from its completion (at wait)
        self.link_bytes, self.link_end, self.started = link_bytes, 0.0, started
        if link_bytes and handle is not None:
            self.link_end, self.link_bytes = link.reserve_exchange(link_bytes), 0

    def wait(self) -> torch.Tensor:
        since = time.perf_counter() if self.link_end else self.started
        if self.handle is not None:
            self.handle.wait()
            self.handle = None
        if self.link_end:
            link.wait_until(self.link_end, since)
            self.link_end = 0.0
        if self.link_bytes:
            link.exchange_window(self.link_bytes, since)
            self.link_bytes = 0
        y = self.out_b.view(self.wire_dtype)
        return self.decompress(y).reshape(self.out_shape)


def start_all_to_all(x, output_split_sizes, input_split_sizes, group, algorithm="flat",
                     ranks_per_node=None, compression="none", async_op=True) -> _Pending:
    """Compress and issue the exchange (asynchronously when the algorithm supports it)."""
    world = _group_size(group)
    algo = get_algorithm(algorithm)
    rows = x.shape[0]
    out_s = normalize_splits(output_split_sizes, rows, world, "output_split_sizes")
    in_s = normalize_splits(input_split_sizes, rows, world, "input_split_sizes")
    if sum(in_s) != rows:
        raise ValueError(f"all_to_all: input_split_sizes sum {sum(in_s)} != dim 0 {rows}")
    rpn = _resolve_rpn(ranks_per_node, group)
    comp = get_compression(compression)
    cols = math.prod(x.shape[1:])
    x2 = x.contiguous().reshape(rows, cols)
    use = comp is not get_compression("none") and comp.applies_to(x)
    w = comp.compress(x2).contiguous() if use else x2
    wb = w.view(torch.uint8)  # [rows, bytes per row]: algorithms move bytes, bit-exact
    out_shape = (sum(out_s),) + tuple(x.shape[1:])
    dtype = x.dtype
    decompress = (lambda y: comp.decompress(y, dtype, cols)) if use else (lambda y: y)
    for c in _EXCHANGES:
        c[(algo.name, compression if use else "none")] += 1
    started = time.perf_counter() if link.active() else None   # a blocking exchange's wait counts from here
    if async_op and algo.supports_async:
        out_b, handle = algo.fn(wb, out_s, in_s, group, rpn, async_op=True)
    else:
        out_b, handle = algo.fn(wb, out_s, in_s, group, rpn), None
    link_bytes = 0
    if link.active():      # the bytes this rank sends to / receives from other ranks, the larger
        me = _group_rank(group)
        link_bytes = wb.shape[1] * max(sum(s for j, s in enumerate(in_s) if j != me),
                                       sum(s for j, s in enumerate(out_s) if j != me))
    return _Pending(out_b, handle, w.dtype, decompress, out_shape, link_bytes, started)


def _exchange(x, out_s, in_s, group, algorithm, rpn, compression):
    return start_all_to_all(x, out_s, in_s, group, algorithm, rpn, compression,
                            async_op=False).wait()


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, out_s, in_s, group, algorithm, rpn, compression):
        ctx.args = (group, algorithm, rpn, compression)
        ctx.out_s, ctx.in_s = out_s, in_s
        return _exchange(x, out_s, in_s, group, algorithm, rpn, compression)

    @staticmethod
    def backward(ctx, g):
        group, algorithm, rpn, compression = ctx.args
        # reverse exchange: what I received goes back to where it came from
        gx = _exchange(g.contiguous(), ctx.in_s, ctx.out_s, group, algorithm, rpn, compression)
        return gx, None, None, None, None, None, None


class _Attached(torch.autograd.Function):
    """The output of an exchange issued (and waited) outside autograd, attached to its input: the
    backward is the reverse exchange (splits swapped) with the same algorithm and compressor."""

    @staticmethod
    def forward(ctx, x, holder, out_s, in_s, group, algorithm, rpn, compression):
        ctx.args = (group, algorithm, rpn, compression)
        ctx.out_s, ctx.in_s = out_s, in_s
        return holder[0]

    @staticmethod
    def backward(ctx, g):
        group, algorithm, rpn, compression = ctx.args
        gx = _exchange(g.contiguous(), ctx.in_s, ctx.out_s, group, algorithm, rpn, compression)
        return gx, None, None, None, None, None, None, None


class _PendingAutograd:
    def __init__(self, x, pending, args):
        self.x, self.pending, self.args = x, pending, args

    def wait(self) -> torch.Tensor:
        y = self.pending.wait()
        if torch.is_grad_enabled() and self.x.requires_grad:
            return _Attached.apply(self.x, [y], *self.args)
        return y


def all_to_all_async(input, output_split_sizes, input_split_sizes, group, algorithm: str = "flat",
                     ranks_per_node: Optional[int] = None, compression: str = "none"):
    """Issue a differentiable exchange (in flight while the caller works when the algorithm supports
    async); ``.wait()`` returns what :func:`all_to_all` returns, attached to the autograd graph."""
    if group is None:
        group = dist.group.WORLD
    world, rows = _group_size(group), input.shape[0]
    out_s = normalize_splits(output_split_sizes, rows, world, "output_split_sizes")
    in_s = normalize_splits(input_split_sizes, rows, world, "input_split_sizes")
    pending = start_all_to_all(input.detach(), out_s, in_s, group, algorithm, ranks_per_node,
                               compression, async_op=True)
    return _PendingAutograd(input, pending, (out_s, in_s, group, algorithm, ranks_per_node, compression))


def all_to_all(input, output_split_sizes=None, input_split_sizes=None, group=None,
               algorithm: str = "flat", ranks_per_node: Optional[int] = None,
               compression: str = "none") -> torch.Tensor:
    """Drop-in for ``all_to_all_single`` (returns the output), differentiable. See module doc."""
    if group is None:
        group = dist.group.WORLD
    world, rows = _group_size(group), input.shape[0]
    out_s = normalize_splits(output_split_sizes, rows, world, "output_split_sizes")
    in_s = normalize_splits(input_split_sizes, rows, world, "input_split_sizes")
    if torch.is_grad_enabled() and input.requires_grad:
        return _AllToAll.apply(input, out_s, in_s, group, algorithm, ranks_per_node, compression)
    return _exchange(input, out_s, in_s, group, algorithm, ranks_per_node, compression)


# ---------------------------------------------------------------------------------------------
# bytes on the wire (benchmark, simulator)

def wire_stats(algorithm: str, split_matrix, row_bytes: int, ranks_per_node: int,
               rank: Optional[int] = None) -> dict:
    """Bytes and messages on intra- and inter-node links for one all-to-all.

    ``split_matrix[i][j]``: rows rank i sends to rank j (i, j group ranks); ``row_bytes``: wire
    bytes per row (after compression, see ``Compressor.wire_bytes_per_row``). Sums over all
    senders, or only sender ``rank``. Self copies and empty transfers are not counted; the
    hierarchical algorithm's count exchange (N ints per peer) is metadata and not counted.
    """
    S = [[int(v) for v in row] for row in (split_matrix.tolist() if torch.is_tensor(split_matrix)
                                           else split_matrix)]
    P, M = len(S), int(ranks_per_node)
    topology.check_divisible(P, M)
    N = P // M
    res = {"intra_bytes": 0, "inter_bytes": 0, "intra_msgs": 0, "inter_msgs": 0}

    def add(intra, rows):
        if rows > 0:
            k = "intra" if intra else "inter"
            res[k + "_bytes"] += rows * row_bytes
            res[k + "_msgs"] += 1

    senders = range(P) if rank is None else [rank]
    name = algorithm if algorithm in ("flat", "pipe", "hierarchical") else None
    if name is None:
        raise ValueError(f"wire_stats: no byte model for algorithm {algorithm!r}")
    for i in senders:
        n0, g0 = divmod(i, M)
        if name in ("flat", "pipe"):
            for j in range(P):
                if j != i:
                    add(j // M == n0, S[i][j])
        else:
            for h in range(M):  # intra phase: everything bound for local rank h on any node
                if h != g0:
                    add(True, sum(S[i][n * M + h] for n in range(N)))
            for n in range(N):  # inter phase: what my node's ranks send to (n, g0)
                if n != n0:
                    add(False, sum(S[n0 * M + g][n * M + g0] for g in range(M)))
    return res


def formula_wire_stats(algorithm: str, S_bytes: float, P: int, M: int) -> dict:
    """The note's per-GPU formulas for a uniform all-to-all of S bytes per GPU (schemoe.md 5.3)."""
    N = P // M
    if algorithm in ("flat", "pipe"):
        return {"intra_bytes": (M - 1) * S_bytes / P, "inter_bytes": (P - M) * S_bytes / P,
                "intra_msgs": M - 1, "inter_msgs": P - M}
    if algorithm == "hierarchical":
        return {"intra_bytes": (M - 1) * N * S_bytes / P, "inter_bytes": (N - 1) * M * S_bytes / P,
                "intra_msgs": M - 1, "inter_msgs": N - 1}
    raise ValueError(f"formula_wire_stats: no formula for {algorithm!r}")
