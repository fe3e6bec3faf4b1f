"""megatron-core's full-iteration CUDA graph across releases (megatron_moe/training/cuda_graph.py).

core_v0.16 says "full iteration" with ``cuda_graph_impl="local"`` and the ``full_iteration``
scope; core_v0.19 with ``cuda_graph_impl="full_iteration"``. Its ``FullCudaGraphWrapper`` takes
``use_single_mempool`` from core_v0.19 on.
"""

from __future__ import annotations

import inspect

from megatron_moe.compat.versions import mcore_at_least


def full_iteration_config_fields() -> dict:
    """The TransformerConfig fields of a full-iteration CUDA graph in this release."""
    if mcore_at_least("0.19"):
        return dict(cuda_graph_impl="full_iteration")
    from megatron.core.transformer.enums import CudaGraphScope

    return dict(cuda_graph_impl="local", cuda_graph_scope=[CudaGraphScope.full_iteration])


def captures_whole_iterations(config) -> bool:
    """Whether a model config (or the parsed flags, same names; scopes as enums or strings) says
    "full-iteration CUDA graph" in either release's terms (no per-layer graphs: the modules run as
    in eager mode, inside one captured region)."""
    impl = getattr(config, "cuda_graph_impl", "none")
    if impl == "full_iteration":
        return True
    scopes = getattr(config, "cuda_graph_scope", None) or ()
    return impl == "local" and any(getattr(s, "name", s) == "full_iteration" for s in scopes)


def full_cuda_graph_wrapper(forward_backward, warmup_steps: int, single_mempool: bool):
    from megatron.core.full_cuda_graph import FullCudaGraphWrapper

    kwargs = dict(cuda_graph_warmup_steps=warmup_steps)
    if "use_single_mempool" in inspect.signature(FullCudaGraphWrapper.__init__).parameters:
        kwargs["use_single_mempool"] = single_mempool
    return FullCudaGraphWrapper(forward_backward, **kwargs)
