"""Chunked dispatch -> expert -> combine with comm/compute overlap (ScheMoE OptSche, FasterMoE).

:func:`chunked_moe_exchange` splits the dispatched rows into chunks and runs, on the host, the
OptSche order of ScheMoE (Theorem 1)::

    C1^1..C1^r (each followed by issuing A1^i)            # compress, dispatch all-to-all (async)
    (D1^i E^i C2^i, issue A2^i) for i = 1..r              # wait, decompress, expert, compress, combine
    D2^1..D2^r                                            # wait, decompress

The communication "stream" is FIFO ``A1^1..A1^r A2^1..A2^r`` (Eqs. 13-14). Algorithms with an
asynchronous form (flat, pipe) overlap communication with the expert compute of other chunks;
``hierarchical`` (two dependent phases) runs synchronously at its slot. The backward is left to
the autograd engine (the note's accepted option): every exchange's backward is the reverse
exchange, issued when its gradient is ready and waited for when the input gradient is needed.

``order="fastermoe"``: FasterMoE's smart schedule, group-wise ring exchange. Ranks are split into
``degree`` groups of contiguous ranks (use the nodes: ``degree = P / ranks_per_node``); in step j
group i sends to group (i - j) mod n and receives from (i + j) mod n, experts run on the rows of
that step, and the results return; step 0 is the intra-group exchange, step n-1 the ring
neighbour. Same two-resource FIFO as above (S_0..S_{n-1}, then R_0..R_{n-1}).

Both give exactly the unchunked exchange's rows to the expert function (in smaller pieces) and
put the results back in place, so output and gradients equal the unchunked path whenever
``expert_fn`` is row-wise per (source, local expert) block (up to GEMM summation order).

The discrete-event model of the note (two resources, per-chunk chains C1 A1 D1 E C2 A2 D2) is
:func:`simulate`; :func:`optsche_order`, :func:`stage_major_order`, :func:`brute_force_best`
reproduce and check the optimality claim.
"""

from __future__ import annotations

import itertools
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from megatron_moe.comm.alltoall import start_all_to_all

__all__ = ["chunked_moe_exchange", "optsche_order", "stage_major_order", "sequential_order",
           "simulate", "brute_force_best", "valid_compute_orders", "CHAIN"]


# ---------------------------------------------------------------------------------------------
# autograd pieces: issue / collect of one exchange

class _Box:
    __slots__ = ("spec", "fwd", "bwd")

    def __init__(self, spec):
        self.spec, self.fwd, self.bwd = spec, None, None


class _Issue(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, box):
        ctx.box = box
        out_s, in_s, group, algo, rpn, comp = box.spec
        box.fwd = start_all_to_all(x, out_s, in_s, group, algo, rpn, comp, async_op=True)
        return x.new_empty(0)  # token: orders Collect after Issue in the graph

    @staticmethod
    def backward(ctx, _token_grad):
        g = ctx.box.bwd.wait()
        ctx.box.bwd = None
        return g, None


class _Collect(torch.autograd.Function):
    @staticmethod
    def forward(ctx, token, box):
        ctx.box = box
        out = box.fwd.wait()
        box.fwd = None
        return out

    @staticmethod
    def backward(ctx, g):
        out_s, in_s, group, algo, rpn, comp = ctx.box.spec
        # the reverse exchange, issued now and waited for in _Issue.backward
        ctx.box.bwd = start_all_to_all(g.contiguous(), in_s, out_s, group, algo, rpn, comp,
                                       async_op=True)
        return g.new_empty(0), None


class _Exchange:
    """One issued exchange in forward; ``collect()`` waits (autograd-aware)."""

    def __init__(self, x, spec):
        self.box = _Box(spec)
        self.token = _Issue.apply(x, self.box)

    def collect(self):
        return _Collect.apply(self.token, self.box)


# ---------------------------------------------------------------------------------------------
# chunk definitions


def _as_matrix(splits, world, what) -> Tuple[List[List[int]], bool]:
    v = splits.tolist() if torch.is_tensor(splits) else [
        (s.tolist() if torch.is_tensor(s) else s) for s in splits]
    two_d = len(v) > 0 and isinstance(v[0], (list, tuple))
    m = [[int(a) for a in row] for row in v] if two_d else [[int(a)] for a in v]
    if len(m) != world or len({len(r) for r in m}) != 1 or any(a < 0 for r in m for a in r):
        raise ValueError(f"chunked_moe_exchange: {what} must be [{world}] or [{world}][experts] "
                         f"non-negative ints, got {v}")
    return m, two_d


def _split_even(s: int, r: int, c: int) -> Tuple[int, int]:
    """(offset, length) of part c when s rows are cut into r near-equal parts (same on all ranks)."""
    base, extra = divmod(s, r)
    off = c * base + min(c, extra)
    return off, base + (1 if c < extra else 0)


def _chunk_plan(ins, outs, degree, order, me, world):
    """Per chunk: (send row ranges [(start, len)], send per-block sizes, recv per-block sizes,
    recv row ranges [(start, len)] in the unchunked receive buffer)."""
    K = len(ins[0])

    def starts(m):
        acc, out = 0, []
        for j in range(world):
            row = []
            for k in range(K):
                row.append(acc)
                acc += m[j][k]
            out.append(row)
        return out

    in_start, out_start = starts(ins), starts(outs)
    plans = []
    if order == "schemoe":
        for c in range(degree):
            ranges, send, recv, rranges = [], [], [], []
            for j in range(world):
                srow, rrow = [], []
                for k in range(K):
                    off, n = _split_even(ins[j][k], degree, c)
                    ranges.append((in_start[j][k] + off, n))
                    srow.append(n)
                    roff, rn = _split_even(outs[j][k], degree, c)
                    rranges.append((out_start[j][k] + roff, rn))
                    rrow.append(rn)
                send.append(srow)
                recv.append(rrow)
            plans.append((ranges, send, recv, rranges))
    elif order == "fastermoe":
        n = degree
        if world % n:
            raise ValueError(f"--moe-a2a-overlap-degree={n} (FasterMoE groups) must divide the "
                             f"group size {world}")
        gsz = world // n
        gi = me // gsz
        for step in range(n):
            to, frm = (gi - step) % n, (gi + step) % n
            ranges, send, recv, rranges = [], [], [], []
            for j in range(world):
                srow = [ins[j][k] if j // gsz == to else 0 for k in range(K)]
                rrow = [outs[j][k] if j // gsz == frm else 0 for k in range(K)]
                for k in range(K):
                    if srow[k]:
                        ranges.append((in_start[j][k], srow[k]))
                    if rrow[k]:
                        rranges.append((out_start[j][k], rrow[k]))
                send.append(srow)
                recv.append(rrow)
            plans.append((ranges, send, recv, rranges))
    else:
        raise ValueError(f"--moe-a2a-schedule={order!r}: expected 'schemoe' or 'fastermoe'")
    return plans


def chunked_moe_exchange(tokens: torch.Tensor, input_splits, output_splits,
                         expert_fn: Callable, group=None, degree: int = 1,
                         order: str = "schemoe", algorithm: str = "flat",
                         compression: str = "none",
                         ranks_per_node: Optional[int] = None,
                         pass_recv_index: bool = False) -> torch.Tensor:
    """Dispatch -> ``expert_fn`` -> combine in ``degree`` chunks, overlapped (see module doc).

    ``tokens``: ``[sum(input_splits), ...]`` rows grouped by destination rank (and, with 2-D
    splits, by local expert within each destination). ``input_splits``: ``[P]`` or
    ``[P][local_experts]`` rows this rank sends; ``output_splits``: the same shape, rows it
    receives from each source. ``expert_fn(rows, splits)`` gets the received rows of a chunk in
    source-rank-major (then local-expert) order and that chunk's splits in the same form as
    ``output_splits``, and returns one output row per input row. Returns the combined rows in
    ``tokens``' order. With ``pass_recv_index=True`` it is called as
    ``expert_fn(rows, splits, recv_index)``: the positions of the chunk's rows in the unchunked
    receive buffer (source-major, then local expert), e.g. to pick their routing probabilities.
    """
    if group is None:
        group = dist.group.WORLD
    world, me = dist.get_world_size(group), dist.get_rank(group)
    if int(degree) < 1:
        raise ValueError(f"--moe-a2a-overlap-degree={degree} must be >= 1")
    ins, two_d = _as_matrix(input_splits, world, "input_splits")
    outs, two_d_o = _as_matrix(output_splits, world, "output_splits")
    if two_d != two_d_o or len(ins[0]) != len(outs[0]):
        raise ValueError("chunked_moe_exchange: input_splits and output_splits differ in shape")
    if sum(map(sum, ins)) != tokens.shape[0]:
        raise ValueError(f"chunked_moe_exchange: input_splits sum {sum(map(sum, ins))} != "
                         f"tokens.shape[0] {tokens.shape[0]}")
    plans = _chunk_plan(ins, outs, int(degree), order, me, world)

    def fmt(m):
        return [list(r) for r in m] if two_d else [r[0] for r in m]

    # phase 1: C1^i + issue A1^i for every chunk (comm FIFO: A1^1..A1^r)
    def rows_of(ranges):
        ranges = [(s, n) for s, n in ranges if n]
        return torch.cat([torch.arange(s, s + n) for s, n in ranges]) if ranges else \
            torch.empty(0, dtype=torch.long)

    idxs, a1 = [], []
    for ranges, send, recv, _ in plans:
        idx = rows_of(ranges)
        idxs.append(idx)
        x = tokens.index_select(0, idx.to(tokens.device))
        spec = ([sum(r) for r in recv], [sum(r) for r in send], group, algorithm,
                ranks_per_node, compression)
        a1.append(_Exchange(x, spec))
    # phase 2: D1^i E^i C2^i + issue A2^i (FIFO behind all A1)
    a2 = []
    for (ranges, send, recv, rranges), ex in zip(plans, a1):
        got = ex.collect()
        if pass_recv_index:
            y = expert_fn(got, fmt(recv), rows_of(rranges).to(got.device))
        else:
            y = expert_fn(got, fmt(recv))
        if y.shape[0] != got.shape[0]:
            raise ValueError(f"chunked_moe_exchange: expert_fn returned {y.shape[0]} rows for "
                             f"{got.shape[0]}")
        spec = ([sum(r) for r in send], [sum(r) for r in recv], group, algorithm,
                ranks_per_node, compression)
        a2.append(_Exchange(y, spec))
    # phase 3: D2^i, then put rows back in tokens' order
    back = torch.cat([ex.collect() for ex in a2], dim=0)
    perm = torch.cat(idxs)
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel())
    return back.index_select(0, inv.to(back.device))


# ---------------------------------------------------------------------------------------------
# discrete-event model (two resources) and the OptSche order

CHAIN = ("C1", "A1", "D1", "E", "C2", "A2", "D2")
_COMM = {"A1", "A2"}
_PRED = {CHAIN[i]: CHAIN[i - 1] for i in range(1, len(CHAIN))}


def optsche_order(r: int):
    """Eq. (12) compute order and the FIFO communication order (Eqs. 13-14)."""
    comp = [("C1", i) for i in range(r)]
    for i in range(r):
        comp += [("D1", i), ("E", i), ("C2", i)]
    comp += [("D2", i) for i in range(r)]
    comm = [("A1", i) for i in range(r)] + [("A2", i) for i in range(r)]
    return comp, comm


def stage_major_order(r: int):
    comp = [(k, i) for k in ("C1", "D1", "E", "C2", "D2") for i in range(r)]
    return comp, [("A1", i) for i in range(r)] + [("A2", i) for i in range(r)]


def sequential_order(r: int):
    """No overlap: r=1-style execution, chunk after chunk."""
    return [(k, i) for i in range(r) for k in CHAIN]


def simulate(compute_order, comm_order, durations: Dict[str, float]):
    """Makespan and start times of a two-resource schedule; None if the orders deadlock.

    Each resource runs its list serially; a task starts at max(resource free, chain predecessor
    done). ``durations``: per-chunk times keyed by C, A, D, E (C1/C2 take C, etc.).
    """
    def dur(kind):
        return durations[kind[0]] if kind != "E" else durations["E"]

    end, start = {}, {}
    lists = [list(compute_order), list(comm_order)]
    ptr, free = [0, 0], [0.0, 0.0]
    total = len(lists[0]) + len(lists[1])
    while len(end) < total:
        progressed = False
        for res in (0, 1):
            while ptr[res] < len(lists[res]):
                kind, i = lists[res][ptr[res]]
                pred = _PRED.get(kind)
                if pred is not None and (pred, i) not in end:
                    break
                t0 = max(free[res], end[(pred, i)] if pred else 0.0)
                start[(kind, i)] = t0
                end[(kind, i)] = free[res] = t0 + dur(kind)
                ptr[res] += 1
                progressed = True
        if not progressed:
            return None
    return max(end.values()), start


def simulate_sequential(r: int, durations) -> float:
    return r * (2 * durations["C"] + 2 * durations["A"] + 2 * durations["D"] + durations["E"])


def valid_compute_orders(r: int):
    """Every interleaving of the r compute chains C1 D1 E C2 D2 (multinomial many)."""
    kinds = ("C1", "D1", "E", "C2", "D2")
    pos = [0] * r
    out = []

    def rec(prefix):
        if len(prefix) == 5 * r:
            out.append(list(prefix))
            return
        for i in range(r):
            if pos[i] < 5:
                prefix.append((kinds[pos[i]], i))
                pos[i] += 1
                rec(prefix)
                pos[i] -= 1
                prefix.pop()
    rec([])
    return out


def valid_comm_orders(r: int):
    """Orders of the 2r comm tasks with A1^i before A2^i."""
    tasks = [("A1", i) for i in range(r)] + [("A2", i) for i in range(r)]
    for p in itertools.permutations(tasks):
        if all(p.index(("A1", i)) < p.index(("A2", i)) for i in range(r)):
            yield list(p)


def brute_force_best(r: int, durations, all_comm_orders: bool = True, bound: float = None):
    """Minimum makespan over valid orders.

    ``all_comm_orders=True``: exhaustive over compute orders x comm orders (use for r=2).
    Otherwise a depth-first search over compute orders with FIFO communication, pruned with the
    lower bound ``compute free + remaining compute``; with ``bound`` (e.g. the OptSche makespan)
    it only looks for strictly shorter schedules, which is an exact check of optimality.
    Returns (best makespan or bound, best compute order or None).
    """
    if all_comm_orders:
        best, arg = float("inf"), None
        comms = list(valid_comm_orders(r))
        for comp in valid_compute_orders(r):
            for comm in comms:
                res = simulate(comp, comm, durations)
                if res is not None and res[0] < best:
                    best, arg = res[0], (comp, comm)
        return best, arg
    comm = [("A1", i) for i in range(r)] + [("A2", i) for i in range(r)]
    d = {k: (durations["E"] if k == "E" else durations[k[0]]) for k in CHAIN}
    kinds = ("C1", "D1", "E", "C2", "D2")
    best = [bound if bound is not None else float("inf"), None]
    total_comp = r * sum(d[k] for k in kinds)

    def advance(end, p, cfree):
        while p < len(comm):
            kind, i = comm[p]
            pk = (_PRED[kind], i)
            if pk not in end:
                break
            t0 = max(cfree, end[pk])
            end[(kind, i)] = cfree = t0 + d[kind]
            p += 1
        return p, cfree

    def rec(order, pos, end, free, p, cfree, done_comp):
        if free + (total_comp - done_comp) >= best[0] - 1e-9:
            return
        if len(order) == 5 * r:
            mk = max(end.values())
            if mk < best[0] - 1e-9:
                best[0], best[1] = mk, list(order)
            return
        for i in range(r):
            if pos[i] == 5:
                continue
            kind = kinds[pos[i]]
            pred = _PRED.get(kind)
            if pred is not None and (pred, i) not in end:
                continue
            t0 = max(free, end[(pred, i)] if pred else 0.0)
            e2 = dict(end)
            e2[(kind, i)] = t0 + d[kind]
            p2, c2 = advance(e2, p, cfree)
            pos[i] += 1
            order.append((kind, i))
            rec(order, pos, e2, t0 + d[kind], p2, c2, done_comp + d[kind])
            order.pop()
            pos[i] -= 1

    rec([], [0] * r, {}, 0.0, 0, 0.0, 0.0)
    return best[0], best[1]
