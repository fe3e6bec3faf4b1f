"""torchtitan 0.3.0 (the performance section's peer, megatron_moe/gpucheck/perf.py) on a torch
older than the one it was released against.

torchtitan 0.3.0 imports ``torch.distributed.fsdp.DataParallelMeshDims`` at module import
(``torchtitan/distributed/fsdp.py`` and ``full_dtensor.py``, reached from every model package
through its ``parallelize.py``). torch 2.13 has the class (FSDP2's ``dp_mesh_dims=``, for
parameters that are already DTensors on a multi-axis mesh); torch 2.11, the GPU machine's, does
not, so ``import torchtitan.models.qwen3`` fails there. No torchtitan release fits instead: 0.2.x
model packages import its data stack (``datasets``: pyarrow and pandas would not fit the kit's
carry) and 0.1.0 has no MoE model.

torchtitan builds a ``DataParallelMeshDims`` only when FSDP's data-parallel mesh has more than one
rank or expert parallelism is on (``full_dtensor.resolve_fsdp_mesh`` returns ``None`` for a size-1
mesh under its default ``spmd_types`` backend, ``resolve_sparse_fsdp_mesh`` ``(None, None)``
without EP) and passes ``dp_mesh_dims=`` to ``fully_shard`` only when it is not ``None``. The row
runs at world size 1, so on such a torch the name only has to exist: ``bridge_fsdp_mesh_dims``
registers a stand-in that refuses to be built, so a configuration that would need the real class
fails naming torch instead of running something else.
"""

from __future__ import annotations


class _MissingDataParallelMeshDims:
    """Stands for ``torch.distributed.fsdp.DataParallelMeshDims`` where torch lacks it."""

    def __init__(self, *args, **kwargs):
        import torch

        raise RuntimeError(
            f"torch {torch.__version__} has no torch.distributed.fsdp.DataParallelMeshDims: "
            "torchtitan's multi-rank FSDP (dp_mesh_dims=) needs a newer torch; "
            "megatron_moe.compat.torchtitan bridges only its world-size-1 import")


def bridge_fsdp_mesh_dims() -> bool:
    """Make ``from torch.distributed.fsdp import DataParallelMeshDims`` work before torchtitan is
    imported; True when the stand-in was registered (torch lacks the class), False when torch has
    it (nothing done)."""
    import torch.distributed.fsdp as fsdp

    current = getattr(fsdp, "DataParallelMeshDims", None)
    if current is not None:
        return current is _MissingDataParallelMeshDims
    fsdp.DataParallelMeshDims = _MissingDataParallelMeshDims
    return True
