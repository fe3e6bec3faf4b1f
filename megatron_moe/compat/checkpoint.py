"""megatron-core's torch_dist checkpoint details that differ by release or that we reach into.

Common state (issue 12). Where a torch_dist checkpoint keeps its common (non-sharded) state:
megatron-core <= 0.18 writes it to ``common.pt`` beside the shards; 0.19 writes it into the torch
DCP checkpoint itself, as the byte object ``common_state/shard_0_1`` (``.metadata`` lists it), and no
``common.pt``. ``dist_checkpointing.load_common_state_dict`` of 0.19 reads either; that of 0.16 only
``common.pt`` (a 0.19 checkpoint does not load on 0.16: resume is forward only). Tools that inspect
a checkpoint without loading it use these helpers instead of assuming ``common.pt``.

The writer (issue 13, megatron_moe/training/checkpointing.py):

* ``prestart_writer``: megatron-core creates the writer's results queue on the first save with
  ``multiprocessing.get_context("spawn").Manager()``: a fresh interpreter that re-imports the
  launch script (torch, megatron-core) before the first shard is written. That one-time start
  was most of the first save's cost (2-15 s against 0.3-0.5 s for later saves). It is started
  at setup instead, with ``__main__``'s file hidden so the child imports nothing heavy, and with
  its server shielded from the scheduler's step-wide SIGTERM (issue 26, docs/checkpoints.md).
* ``async_save_kwargs`` / ``quiet_mcore_async_notice``: 0.19's async strategy argument.
* ``align_loaded_param_group_bounds``: 0.19 pairs loaded optimizer param groups with the current
  ones by their config, ``max_lr``/``min_lr`` included (below).
"""

import os
import sys
import threading

COMMON_PT = "common.pt"
COMMON_STATE_OBJECT = "common_state/"   # prefix of the DCP key (0.19+)


def common_state_in_dcp(dcp_metadata) -> bool:
    """True when torch DCP ``.metadata`` (``FileSystemReader(dir).read_metadata()``) lists the
    common state as an object of the checkpoint (megatron-core >= 0.19)."""
    return any(str(k).startswith(COMMON_STATE_OBJECT) for k in dcp_metadata.state_dict_metadata)


def read_common_state(ckpt_dir: str) -> dict:
    """The common state dict, from ``common.pt`` or from inside the DCP checkpoint."""
    if os.path.isfile(os.path.join(ckpt_dir, COMMON_PT)):
        import torch

        return torch.load(os.path.join(ckpt_dir, COMMON_PT), map_location="cpu", weights_only=False)
    from megatron.core import dist_checkpointing

    return dist_checkpointing.load_common_state_dict(ckpt_dir)


# --- the writer (issue 13) -------------------------------------------------------------------------
def _filesystem_async():
    try:
        from megatron.core.dist_checkpointing.strategies import filesystem_async
    except ImportError:
        return None
    return filesystem_async


def prestart_writer():
    """Create megatron-core's (cached) writer results queue now, in a bare interpreter.

    A spawn child re-imports the parent's ``__main__`` (the launch script: torch, megatron-core)
    unless ``__main__`` names no file or module; the Manager's server needs none of it. With the
    name hidden for that one start it takes ~0.1 s instead of 6.4 s (measured, same machine)."""
    module = _filesystem_async()
    # 0.16: _get_write_results_queue(); 0.19: get_write_results_queue(mp_mode="spawn"); both
    # return the module's cached _results_queue, which is set here first
    create = (getattr(module, "get_write_results_queue", None)
              or getattr(module, "_get_write_results_queue", None)) if module is not None else None
    if create is None or getattr(module, "_results_queue", "absent") is not None:
        return
    main = sys.modules.get("__main__")
    saved = {}
    if main is not None:
        for name in ("__file__", "__spec__"):
            if name in main.__dict__:
                saved[name] = main.__dict__[name]
        main.__dict__.pop("__file__", None)
        if "__spec__" in saved:
            main.__spec__ = None
    try:
        queue = _start_results_queue(module)
    finally:
        if main is not None:
            main.__dict__.update(saved)
    # The first put of write results makes the server unpickle torch DCP classes, importing torch
    # there (2-6 s inside the first save, profiled). A round trip of such an object in a
    # background thread does that now, behind model building; saves join the thread first so the
    # warm-up item is never taken for a result.
    global _warmup_thread

    def warm_up():
        try:
            from torch.distributed.checkpoint.metadata import MetadataIndex

            queue.put(MetadataIndex("megatron-moe-warmup"))
            queue.get()
        except Exception:   # only a warm-up: the first save pays the cost instead
            pass

    _warmup_thread = threading.Thread(target=warm_up, name="ckpt-writer-warmup", daemon=True)
    _warmup_thread.start()


_warmup_thread = None


def _start_results_queue(module):
    """What megatron-core's ``get_write_results_queue`` does (``ctx.Manager().Queue()``, spawn
    context, cached in the module), with the Manager's server shielded: it ignores the step-wide
    SIGTERM a preemption sends to every process, which killed it before the save that signal
    asked for, and dies with this rank (megatron_moe/runtime/helper_processes.py)."""
    import multiprocessing
    from multiprocessing.managers import SyncManager

    from megatron_moe.runtime.helper_processes import shield

    manager = SyncManager(ctx=multiprocessing.get_context("spawn"))
    manager.start(initializer=shield, initargs=(os.getpid(),))
    module._results_queue = manager.Queue()   # the proxy keeps the manager (and its server) alive
    return module._results_queue


def wait_writer_ready():
    """Before a save: the writer queue's warm-up round trip has finished."""
    if _warmup_thread is not None:
        _warmup_thread.join()


def async_save_kwargs() -> dict:
    """``dist_checkpointing.save`` arguments for megatron-core's own async writer.

    0.19 added ``async_strategy`` (default "nvrx": NVIDIA Resiliency Extension, not a dependency
    here); "mcore" is the AsyncCallsQueue machinery 0.16.1 has."""
    import inspect

    from megatron.core import dist_checkpointing

    if "async_strategy" not in inspect.signature(dist_checkpointing.save).parameters:
        return {}
    try:
        import nvidia_resiliency_ext  # noqa: F401
        return {"async_strategy": "nvrx"}
    except ImportError:
        return {"async_strategy": "mcore"}


def quiet_mcore_async_notice():
    """0.19 logs "MCore's async save is deprecated ... use NVRx" once per process, sync saves
    included (its torch_dist writer is the async machinery run synchronously): known, dropped."""
    import logging

    logger = logging.getLogger("megatron.core.dist_checkpointing.strategies.torch")
    if not any(getattr(f, "_megatron_moe", False) for f in logger.filters):
        def drop(record):
            return not record.getMessage().startswith("MCore's async save is deprecated")

        drop._megatron_moe = True
        logger.addFilter(drop)


def align_loaded_param_group_bounds(optimizer_state, max_lr: float, min_lr: float):
    """Give the loaded optimizer state's default-schedule param groups this run's bounds.

    megatron-core 0.19 pairs each saved param group with a current one by a tuple of its config
    (``optimizer.py: param_group_identifier_keys``, ``max_lr`` and ``min_lr`` among them), so a
    resume with another --lr or --min-lr failed in ``optimizer.load_state_dict`` ("Could not find
    parameter group with key ...") before the scheduler flags were consulted, even with
    --override-opt_param-scheduler. 0.16 pairs them by the other keys and copies the saved
    bounds in.
    Either way load_checkpoint then sets the groups' bounds from the scheduler (the command
    line's or the checkpoint's, by the flags). Groups with their own LR (--decoupled-lr, MuP)
    keep theirs."""
    def walk(node):
        if isinstance(node, dict):
            for group in node.get("param_groups") or ():
                if isinstance(group, dict) and "max_lr" in group and \
                        group.get("default_config", True) and not group.get("is_decoupled_lr"):
                    group["max_lr"], group["min_lr"] = max_lr, min_lr
            children = node.values()
        elif isinstance(node, (list, tuple)):
            children = node
        else:
            return
        for child in children:
            walk(child)

    walk(optimizer_state)

