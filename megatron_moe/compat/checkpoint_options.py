"""Megatron's checkpoint housekeeping flags on the installed megatron-core (0.16.1 .. 0.19.x).

* ``--dist-ckpt-strictness``: ``dist_checkpointing.load(strict=StrictHandling(...))`` (both).
* ``--verify-integrity``: ``save/load(verify_integrity=True)``, megatron-core's per-file hash
  manifest: 0.19 only (refused at parse time on 0.16.1, arguments.py).
* ``--async-ckpt-use-cpu-shm``: the torch_dist save strategy's ``cpu_shm_mode``: 0.19 only; it
  stages GPU tensors, so on a CPU (host tensors) it has nothing to do and is accepted.
* ``--use-persistent-ckpt-worker``: ``AsyncCallsQueue(persistent=True)`` (both; on a GPU, see
  ``async_queue``).
"""

from __future__ import annotations

import inspect

from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

from megatron_moe.compat.versions import megatron_core_version

MCORE_VERSION = str(megatron_core_version())
HAS_INTEGRITY_MANIFEST = "verify_integrity" in inspect.signature(dist_checkpointing.save).parameters
HAS_CPU_SHM = "cpu_shm_mode" in inspect.signature(TorchDistSaveShardedStrategy.__init__).parameters


def load_kwargs(args) -> dict:
    from megatron.core.dist_checkpointing.validation import StrictHandling

    out = {"strict": StrictHandling(getattr(args, "dist_ckpt_strictness", "assume_ok_unexpected"))}
    if getattr(args, "verify_integrity", False):
        out["verify_integrity"] = True
    return out


def loaded_state(result):
    """``load`` returns (state, missing, unexpected) under the return_* strictness modes."""
    return result[0] if isinstance(result, tuple) else result


def save_kwargs(args) -> dict:
    return {"verify_integrity": True} if getattr(args, "verify_integrity", False) else {}


def save_strategy(args):
    kwargs = {"backend": "torch_dist", "version": 1}   # what get_default_save_sharded_strategy builds
    if getattr(args, "async_ckpt_use_cpu_shm", False) and HAS_CPU_SHM:
        kwargs["cpu_shm_mode"] = True
    return TorchDistSaveShardedStrategy(**kwargs)


def async_queue(args):
    """megatron-core's persistent worker binds a CUDA device (``torch.cuda.set_device`` in its
    spawned process); on a CPU the flag keeps megatron-core's per-save writer process instead:
    the files written are the same, only the process is not reused."""
    import torch
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

    persistent = bool(getattr(args, "use_persistent_ckpt_worker", False)) and torch.cuda.is_available()
    return AsyncCallsQueue(persistent=persistent)
