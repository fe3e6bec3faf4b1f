"""Multi-rank cases for tests/test_comm.py (run in spawned gloo processes).

One spawned run per world size checks several emulated topologies; each case returns plain
values (booleans, max errors, counters) for the parent test to assert on.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_moe import comm
from megatron_moe.runtime import topology
from megatron_moe.comm.compress import get_compression


def _split_matrix(world, seed, max_rows=5, zero_prob=0.25, min_rows=0):
    g = torch.Generator().manual_seed(seed)
    m = torch.randint(min_rows, max_rows + 1, (world, world), generator=g)
    m[torch.rand((world, world), generator=g) < zero_prob] = 0
    return m


def _ref_a2a(x, out_s, in_s, group=None):
    out = x.new_empty((sum(out_s),) + tuple(x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), out_s, in_s, group=group)
    return out


def _exactness(rank, world, rpn, seed, group=None):
    """Every algorithm vs all_to_all_single, forward and backward, bit for bit; byte counters."""
    grank = dist.get_rank(group) if group is not None else rank
    gworld = dist.get_world_size(group) if group is not None else world
    res = {}
    for t, (dtype, shape) in enumerate([(torch.float32, (3, 2)), (torch.bfloat16, (4,)),
                                        (torch.int64, ())]):
        S = _split_matrix(gworld, seed + t)
        in_s, out_s = S[grank].tolist(), S[:, grank].tolist()
        g = torch.Generator().manual_seed(1000 * seed + 10 * grank + t)
        x = (torch.randn((sum(in_s),) + shape, generator=g) * 10).to(dtype)
        ref = _ref_a2a(x, out_s, in_s, group)
        for algo in comm.available_algorithms():
            with comm.count_wire_bytes() as cnt:
                y = comm.all_to_all(x, out_s, in_s, group, algorithm=algo, ranks_per_node=rpn)
            res[f"fwd/{algo}/{dtype}"] = torch.equal(y, ref) and y.dtype == ref.dtype
            row_bytes = x[0:1].numel() * x.element_size() if x.dim() > 1 else x.element_size()
            if algo in ("flat", "pipe", "hierarchical"):
                want = comm.wire_stats(algo, S, row_bytes, rpn, rank=grank)
                res[f"bytes/{algo}/{dtype}"] = (cnt == want, cnt, want)
        if dtype.is_floating_point:
            w = torch.randn((sum(out_s),) + shape, generator=g).to(dtype)
            ref_grad = _ref_a2a(w, in_s, out_s, group)
            for algo in comm.available_algorithms():
                xx = x.clone().requires_grad_(True)
                y = comm.all_to_all(xx, torch.tensor(out_s), torch.tensor(in_s), group,
                                    algorithm=algo, ranks_per_node=rpn)
                (y * w).sum().backward()
                res[f"bwd/{algo}/{dtype}"] = torch.equal(xx.grad, ref_grad)
    # equal splits (None), as megatron-core's all_to_all_sp2hp calls it
    x = torch.arange(gworld * 2 * 3, dtype=torch.float32).reshape(gworld * 2, 3) + 100 * grank
    ref = _ref_a2a(x, [2] * gworld, [2] * gworld, group)
    for algo in comm.available_algorithms():
        res[f"none-splits/{algo}"] = torch.equal(
            comm.all_to_all(x, None, None, group, algorithm=algo, ranks_per_node=rpn), ref)
    return res


def _compression(rank, world, rpn, seed):
    """Compressed exchange == exchange of the locally round-tripped rows, fwd and bwd."""
    res = {}
    S = _split_matrix(world, seed, max_rows=4)
    in_s, out_s = S[rank].tolist(), S[:, rank].tolist()
    g = torch.Generator().manual_seed(77 + rank)
    x = torch.randn(sum(in_s), 8, generator=g) * 3
    w = torch.randn(sum(out_s), 8, generator=g)
    for name in ("fp16", "bf16", "int8"):
        c = get_compression(name)
        rt = c.decompress(c.compress(x), x.dtype, 8)
        want = _ref_a2a(rt, out_s, in_s)
        want_g = _ref_a2a(c.decompress(c.compress(w), w.dtype, 8), in_s, out_s)
        for algo in ("flat", "pipe", "hierarchical"):
            xx = x.clone().requires_grad_(True)
            y = comm.all_to_all(xx, out_s, in_s, None, algorithm=algo, ranks_per_node=rpn,
                                compression=name)
            (y * w).sum().backward()
            res[f"{name}/{algo}"] = (torch.equal(y, want), torch.equal(xx.grad, want_g))
    return res


def _expert_fn_factory(weights):
    """Per-local-expert linear map, applied block-wise by the 2-D splits."""
    def fn(rows, splits):
        K = len(weights)
        sizes = [s[k] for s in splits for k in range(K)]
        outs = []
        for b, part in enumerate(torch.split(rows, sizes)):
            outs.append(torch.tanh(part @ weights[b % K]))
        return torch.cat(outs) if outs else rows
    return fn


def _chunked(rank, world, rpn, seed):
    """chunked_moe_exchange == unchunked for every degree/order/algorithm (values and grads)."""
    K, H = 2, 4
    g = torch.Generator().manual_seed(seed)
    counts = torch.randint(0, 6, (world, world, K), generator=g)  # [src, dst, local expert]
    ins, outs = counts[rank].tolist(), counts[:, rank].tolist()
    gl = torch.Generator().manual_seed(seed * 31 + rank)
    x0 = torch.randn(sum(map(sum, ins)), H, generator=gl, dtype=torch.float64)
    W0 = [torch.randn(H, H, generator=g, dtype=torch.float64) for _ in range(K)]
    upstream = torch.randn(x0.shape, generator=gl, dtype=torch.float64)

    def run(degree, order, algo):
        x = x0.clone().requires_grad_(True)
        W = [w.clone().requires_grad_(True) for w in W0]
        y = comm.chunked_moe_exchange(x, ins, outs, _expert_fn_factory(W), None, degree,
                                      order=order, algorithm=algo, ranks_per_node=rpn)
        (y * upstream).sum().backward()
        return y.detach(), x.grad, [w.grad for w in W]

    # unchunked reference: plain all_to_all_single -> expert -> all_to_all_single
    x = x0.clone().requires_grad_(True)
    W = [w.clone().requires_grad_(True) for w in W0]
    in_rows, out_rows = [sum(r) for r in ins], [sum(r) for r in outs]
    recv = comm.all_to_all(x, out_rows, in_rows, None)
    y = comm.all_to_all(_expert_fn_factory(W)(recv, outs), in_rows, out_rows, None)
    (y * upstream).sum().backward()
    ref = (y.detach(), x.grad, [w.grad for w in W])
    res = {}
    nodes = world // rpn
    cases = [(1, "schemoe", "flat"), (2, "schemoe", "flat"), (3, "schemoe", "pipe"),
             (2, "schemoe", "hierarchical"), (nodes, "fastermoe", "flat"),
             (world, "fastermoe", "pipe")]
    for degree, order, algo in cases:
        got = run(degree, order, algo)
        err = max([(got[0] - ref[0]).abs().max().item(), (got[1] - ref[1]).abs().max().item()]
                  + [(a - b).abs().max().item() for a, b in zip(got[2], ref[2])])
        res[f"{order}/r{degree}/{algo}"] = err
    return res


def world_cases(rank, world, rpns, seed=0):
    import time
    torch.manual_seed(0)
    out = {"_t": {}}
    t0 = time.time()
    # collective creation for the whole world first, then lazy creation for the rest
    topology.init_hierarchy_groups(None, rpns[0])
    for rpn in rpns:
        out[f"exact/{rpn}"] = _exactness(rank, world, rpn, seed + rpn)
        out[f"compress/{rpn}"] = _compression(rank, world, rpn, seed + rpn)
        out["_t"][f"ec{rpn}"] = time.time() - t0
        out[f"chunked/{rpn}"] = _chunked(rank, world, rpn, seed + rpn)
        out["_t"][f"ch{rpn}"] = time.time() - t0
    # sub-groups as EP groups: [0,1],[2,3] (or [0,1,2],[3,4,5]); lazy hierarchy per sub-group
    half = world // 2
    subs = [dist.new_group(list(range(half))), dist.new_group(list(range(half, world)))]
    mine = subs[rank // half]
    sub_rpn = 1 if half % 2 else 2
    out["subgroup"] = _exactness(rank, world, sub_rpn, seed + 99, group=mine)
    # and the world-collective initialiser on strided groups [0,2,..],[1,3,..]
    strided = [dist.new_group(list(range(r, world, 2))) for r in range(2)]
    mine2 = strided[rank % 2]
    topology.init_hierarchy_groups(mine2, 1)
    out["strided"] = _exactness(rank, world, 1, seed + 7, group=mine2)
    out["_t"]["end"] = time.time() - t0
    return out


# ---------------------------------------------------------------------------------------------
# user extension points: a registered algorithm and a compressor subclass without its own name

class _HalfNoName(comm.Compressor):
    """Casts to fp16; deliberately no ``name`` attribute of its own."""

    def compress(self, x):
        return x.half()

    def wire_bytes_per_row(self, cols, dtype):
        return 2 * cols


def _sequential_a2a(x, out_s, in_s, group, ranks_per_node):
    """Reference-style user algorithm: one all_to_all_single, reporting its sends."""
    me = dist.get_rank(group)
    for j, rows in enumerate(in_s):
        if j != me:
            comm.record_wire_bytes(j // ranks_per_node == me // ranks_per_node, rows * x.shape[1])
    return _ref_a2a(x, out_s, in_s, group)


def register_user_plugins():
    comm.register_algorithm("user_seq_test", _sequential_a2a)
    comm.register_compression("user_half_test", _HalfNoName())


def user_plugins(rank, world, rpn=1):
    register_user_plugins()
    in_s = _split_matrix(world, seed=3, zero_prob=0.0, min_rows=1)[rank].tolist()
    out_s = _split_matrix(world, seed=3, zero_prob=0.0, min_rows=1)[:, rank].tolist()
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(sum(in_s), 6, generator=g, dtype=torch.float32)
    ref = _ref_a2a(x, out_s, in_s)
    with comm.count_wire_bytes() as counted:
        y = comm.all_to_all(x, out_s, in_s, algorithm="user_seq_test", ranks_per_node=rpn)
    expected = comm.wire_stats("flat", _split_matrix(world, seed=3, zero_prob=0.0, min_rows=1), 6 * 4, rpn, rank=rank)
    z = comm.all_to_all(x, out_s, in_s, algorithm="user_seq_test", ranks_per_node=rpn,
                        compression="user_half_test")
    return {"exact": torch.equal(y, ref), "counted": counted, "expected": expected,
            "compressed_as_fp16": torch.equal(z, ref.half().float()),
            "lossy": not torch.equal(z, ref),
            "name": get_compression("user_half_test").name}
