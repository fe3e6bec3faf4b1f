"""megatron-core's torch_dist writer internals that checkpointing.py reaches into (per release).

* ``prestart_writer``: megatron-core creates the writer's results queue on the first save with
  ``multiprocessing.get_context("spawn").Manager()``: a fresh interpreter that re-imports the
  launch script (torch, megatron-core) before the first shard is written. That one-time start
  was most of the first save's cost (2-15 s against 0.3-0.5 s for later saves). Starting it in a
  background thread at setup hides it behind model building.
* ``install_test_write_delay``: tests only (``MEGATRON_MOE_TEST_SAVE_DELAY``): the writer sleeps
  before writing every shard file except rank 0's first, so a kill can land while some shards
  of a checkpoint are on disk and others are not.
"""

from __future__ import annotations

import os
import threading
import time

_prestart_thread = None


def _filesystem_async():
    try:
        from megatron.core.dist_checkpointing.strategies import filesystem_async
    except ImportError:
        return None
    return filesystem_async


def prestart_writer():
    """Create megatron-core's (cached) writer results queue in a background thread."""
    global _prestart_thread
    module = _filesystem_async()
    if module is None or not hasattr(module, "_get_write_results_queue") or _prestart_thread:
        return
    _prestart_thread = threading.Thread(target=module._get_write_results_queue,
                                        name="ckpt-writer-prestart", daemon=True)
    _prestart_thread.start()


def wait_writer_ready():
    """Before a save: the prestart (if any) has finished, so two threads never race to create
    the queue."""
    if _prestart_thread is not None:
        _prestart_thread.join()


def install_test_write_delay(seconds: float) -> bool:
    module = _filesystem_async()
    writer = getattr(module, "FileSystemWriterAsync", None) if module else None
    if writer is None or getattr(writer, "_test_delay_installed", False):
        return False
    original = writer.write_preloaded_data  # staticmethod, looked up on the class per save

    def delayed(*args, **kwargs):
        first = kwargs.get("local_proc_idx", 0) == 0 and os.environ.get("RANK", "0") == "0"
        if not first:
            time.sleep(seconds)
        return original(*args, **kwargs)

    writer.write_preloaded_data = staticmethod(delayed)
    writer._test_delay_installed = True
    return True



def distributed_optimizer_state_loadable() -> bool:
    """Whether megatron-core can load the distributed optimizer's Adam state here.

    Without Transformer Engine or apex it falls back to torch.optim.Adam, and its load path
    fails on 0.16.1 and 0.19.x alike: ``DistributedOptimizer.state_dict()`` asserts a 'step'
    that torch Adam lacks before its first step, and with that primed, the fully reshardable
    load copies a 'step' key the checkpoint's tensors never hold (KeyError), and the chained
    optimizers' steps then disagree. Weights and the LR schedule still load."""
    try:
        from megatron.core.optimizer import distrib_optimizer
    except ImportError:
        return False
    return bool(getattr(distrib_optimizer, "HAVE_APEX_OR_TE", True))
