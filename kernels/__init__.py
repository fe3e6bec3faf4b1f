"""Fused token dispatch/combine kernels and the hierarchical all-to-all layout transform.

Top-k API::

    layout = kernels.routing_layout(topk_idx, num_experts, capacity=None, pad_to_capacity=False,
                                    experts_per_rank=None)
    x_perm, p_perm = kernels.permute_tokens(hidden, layout, probs)      # [N, h], [N]
    hidden_out = kernels.unpermute_tokens(expert_out, layout, probs)    # [T, h], weighted sum

megatron-core drop-ins (same signatures/results as ``moe_utils.permute/unpermute``, fused=False)::

    kernels.permute(tokens, routing_map, probs=None, num_out_tokens=None, drop_and_pad=False)
    kernels.unpermute(permuted_tokens, sorted_indices, restore_shape, probs=None,
                      routing_map=None, drop_and_pad=False)

Hierarchical all-to-all::

    y, new_splits = kernels.hierarchical_layout(x, split_sizes, nodes, local, inverse=False)

Backends: see ``kernels/ops.py`` (``set_backend``, ``MOE_KERNELS_BACKEND``=auto|triton|torch|
reference; auto = Triton on CUDA tensors, the fast torch path on CPU).  CPU knobs:
``MOE_KERNELS_CPU_POOL=0`` disables the output-buffer pool (``empty_cache()`` frees it;
``MOE_KERNELS_CPU_POOL_BYTES`` caps it), ``MOE_KERNELS_CPU_CHUNK_BYTES`` sets the combine's chunk.
Pooled outputs are ordinary tensors sharing a larger storage (``untyped_storage().nbytes()`` may
exceed the tensor's size).
"""

from .layout import RoutingLayout
from .ops import (
    empty_cache,
    get_backend,
    hierarchical_layout,
    permute,
    permute_tokens,
    routing_layout,
    routing_layout_from_map,
    set_backend,
    set_cpu_pool,
    unpermute,
    unpermute_tokens,
    use_backend,
)

__all__ = [
    "RoutingLayout", "empty_cache", "get_backend", "hierarchical_layout", "permute",
    "permute_tokens", "routing_layout", "routing_layout_from_map", "set_backend", "set_cpu_pool",
    "unpermute", "unpermute_tokens", "use_backend",
]
