"""Launches that do not grow with the number of experts (docs/gpu.md).

One megatron-core MoE layer (alltoall dispatcher, top-2, SwiGLU) runs forward + backward on CPU under
a TorchDispatchMode that counts every aten op (each op is a kernel launch or at least a dispatcher
trip on a GPU). With grouped experts (GroupedSequentialMLP: two grouped_mm) the layer's op count is
the same for 4 and 64 local experts; megatron-core's expert loop (SequentialMLP) grows with them
(the contrast), and so does the grouped path with torch.stack's per-expert backward (the mutation).

The one part that still grows is megatron-core's own chunk sort in its alltoall dispatcher
(``sort_chunks_by_idxs``: a ``torch.cat`` of one chunk per local expert, whose backward slices per
chunk); it is counted apart and listed in docs/gpu.md.
"""

import pytest

from megatron_moe.runtime.local_ranks import run_distributed
from tests._launch_cases import count_layer_ops


def _counts(grouped, mutate=None):
    return {E: run_distributed(count_layer_ops, 1, E, grouped, mutate, timeout_s=240)[0]
            for E in (4, 64)}


@pytest.mark.parametrize("path", ["grouped", "loop", "grouped-torch-stack"])
def test_moe_layer_ops_do_not_grow_with_experts(path):
    c = _counts(grouped=path != "loop", mutate="stack" if path == "grouped-torch-stack" else None)
    layer = {E: r["total"] - r["chunk_sort"] for E, r in c.items()}
    assert all(r["chunk_sort"] > 0 for r in c.values())   # the dispatcher's sort was seen
    if path == "grouped":
        assert all(r["grouped_calls"] == 1 for r in c.values())   # the grouped path ran
        assert layer[4] == layer[64], {E: r["ops"] for E, r in c.items()}
    elif path == "loop":
        assert all(r["grouped_calls"] == 0 for r in c.values())
        assert layer[64] > layer[4] + 60 * 10, layer       # many ops per expert
    else:
        assert layer[64] == layer[4] + 2 * 60, layer       # one select per expert per weight
