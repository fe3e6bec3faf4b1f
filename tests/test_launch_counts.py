"""Launches that do not grow with the number of experts (docs/gpu.md).

One megatron-core MoE layer (alltoall dispatcher, top-2, SwiGLU) runs forward + backward on CPU under
a TorchDispatchMode that counts every aten op (each op is a kernel launch or at least a dispatcher
trip on a GPU). With grouped experts (GroupedSequentialMLP: two grouped_mm) and the dispatcher's
chunk sort ours (megatron_moe/moe/dispatcher.py ``sort_chunks_by_idxs``: one device-built row index,
one index_select per tensor, rebound into megatron-core's token_dispatcher as in training) the whole
layer's op count is the same for 4 and 64 local experts (at expert parallel size 1 the dispatcher's
chunk order is the identity, which ours leaves in place: no op). Three contrasts grow with the experts:
megatron-core's expert loop (SequentialMLP), the grouped path with torch.stack's per-expert backward,
and megatron-core's own chunk sort (a ``torch.cat`` of one chunk per local expert whose backward
slices per chunk).
"""

import pytest
import torch

from megatron_moe.runtime.local_ranks import run_distributed
from tests._launch_cases import count_layer_ops


def _counts(grouped, mutate=None):
    return {E: run_distributed(count_layer_ops, 1, E, grouped, mutate, timeout_s=240)[0]
            for E in (4, 64)}


@pytest.mark.parametrize("path", ["grouped", "loop", "grouped-torch-stack",
                                  "grouped-mcore-chunk-sort"])
def test_moe_layer_ops_do_not_grow_with_experts(path):
    mutate = {"grouped-torch-stack": "stack", "grouped-mcore-chunk-sort": "mcore_chunk_sort"}
    c = _counts(grouped=path != "loop", mutate=mutate.get(path))
    total = {E: r["total"] for E, r in c.items()}
    layer = {E: r["total"] - r["chunk_sort"] for E, r in c.items()}
    sort = {E: r["chunk_sort"] for E, r in c.items()}
    if path == "grouped-mcore-chunk-sort":
        assert all(s > 0 for s in sort.values())   # the dispatcher's sort was seen
    else:   # ours: one source rank, so megatron-core's order is the identity and nothing moves
        assert all(s == 0 for s in sort.values()), sort
    if path == "grouped":
        assert all(r["grouped_calls"] == 1 for r in c.values())   # the grouped path ran
        assert total[4] == total[64], {E: r["ops"] for E, r in c.items()}
    elif path == "loop":
        assert all(r["grouped_calls"] == 0 for r in c.values())
        assert layer[64] > layer[4] + 60 * 10, layer       # many ops per expert
    elif path == "grouped-torch-stack":
        assert layer[64] == layer[4] + 2 * 60, layer       # one select per expert per weight
    else:   # megatron-core's chunk sort: the rest of the layer flat, the sort 3 ops per chunk more
        assert layer[4] == layer[64], layer
        assert sort[64] == sort[4] + 3 * 60, sort


@pytest.mark.parametrize("ranks, local", [(1, 1), (2, 2), (4, 3), (3, 16)])
def test_chunk_sort_equals_megatron_cores_bit_for_bit(ranks, local):
    """Ours against megatron-core's moe_utils.sort_chunks_by_idxs, forward and backward, with the
    dispatcher's own two orders (by local expert, and back), empty chunks included."""
    from megatron.core.transformer.moe.moe_utils import sort_chunks_by_idxs as mcore

    from megatron_moe.moe.dispatcher import sort_chunks_by_idxs as ours

    g = torch.Generator().manual_seed(ranks * 100 + local)
    chunks = torch.arange(ranks * local)
    sizes = torch.randint(0, 5, (ranks, local), generator=g)
    sizes[0, 0] = 0
    orders = [(sizes.ravel(), chunks.reshape(-1, local).T.ravel()),    # sort_input_by_local_experts
              (sizes.T.ravel(), chunks.reshape(local, -1).T.ravel())]  # restore_output_...
    for split_sizes, order in orders:
        x = torch.randn(int(sizes.sum()), 5, generator=g, requires_grad=True)
        p = torch.rand(int(sizes.sum()), generator=g, requires_grad=True)
        w = torch.randn(x.shape, generator=g)
        got = []
        for fn in (mcore, ours):
            out, probs = fn(x, split_sizes, order, probs=p)
            got.append([out, probs, *torch.autograd.grad((out * w).sum() + (probs * probs).sum(),
                                                         [x, p])])
        assert all(torch.equal(a, b) for a, b in zip(*got))
        if len(order) > 1 and not torch.equal(order, torch.arange(len(order))):
            assert not torch.equal(got[0][0], x)   # the order mattered


def test_chunk_sort_ops_do_not_grow_with_chunks_and_backward_gathers():
    """Ours on a real reordering (4 ranks x L local experts): the same ops for 16 and 64 local
    experts, forward and backward; the backward is a gather (index_select with the inverse
    permutation), no index_add (autograd's atomic scatter for index_select)."""
    import collections

    from torch.utils._python_dispatch import TorchDispatchMode

    from megatron_moe.moe.dispatcher import sort_chunks_by_idxs as ours

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops[func.overloadpacket.__name__] += 1
            return func(*args, **(kwargs or {}))

    counts = {}
    for local in (16, 64):
        ranks = 4
        sizes = torch.randint(0, 5, (ranks, local), generator=torch.Generator().manual_seed(local))
        order = torch.arange(ranks * local).reshape(-1, local).T.ravel()
        x = torch.randn(int(sizes.sum()), 8, requires_grad=True)
        p = torch.rand(int(sizes.sum()), requires_grad=True)
        with Count() as c:
            out, probs = ours(x, sizes.ravel(), order, probs=p)
            torch.autograd.grad(out.sum() + probs.sum(), [x, p])
        counts[local] = c.ops
    assert counts[16] == counts[64], counts
    assert "index_add" not in counts[16] and counts[16]["index_select"] >= 4, counts[16]
