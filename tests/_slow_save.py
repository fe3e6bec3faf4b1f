"""Slow checkpoint saves for the kill tests (tests/test_crash_safety.py, tests/test_slurm.py).

Those tests launch real training jobs (torchrun, srun) and kill them mid-save, so the slowdown
must act inside processes the test does not run itself. ``env(seconds, pythonpath)`` gives the
job an environment whose PYTHONPATH starts with ``_slow_save_site/``: its ``sitecustomize.py``
runs at every interpreter start of the job and, with ``MEGATRON_MOE_TEST_SAVE_DELAY`` set, calls
``install`` here. Nothing under megatron_moe/ reads that variable.

Each save then sleeps ``seconds`` at three places, so that polling can kill the job at a chosen
moment: before writing every shard file except rank 0's first (some shards of a checkpoint on
disk, others not), before the ``.tmp`` directory is renamed into place (complete, not renamed),
and between the rename and the tracker update (renamed, the tracker still names the previous one).
The patches are applied when their module is first imported (an import hook), so processes that
never save (the torchrun launcher) import nothing for it.
"""

from __future__ import annotations

import importlib.abc
import os
import sys
import time

DELAY_ENV = "MEGATRON_MOE_TEST_SAVE_DELAY"
SITE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_slow_save_site")


def env(seconds: float, pythonpath: str) -> dict:
    """Environment entries that slow every save of a launched job by ``seconds`` (see above)."""
    return {DELAY_ENV: str(seconds), "PYTHONPATH": os.pathsep.join([SITE, pythonpath])}


def _slow_shard_writes(module, seconds):
    """megatron-core's torch_dist writer sleeps before each shard file but rank 0's first."""
    writer = getattr(module, "FileSystemWriterAsync", None)
    if writer is None:
        return
    original = writer.write_preloaded_data  # a staticmethod, looked up on the class per save

    def delayed(*args, **kwargs):
        from megatron_moe.runtime.launcher import launcher_env  # torchrun's RANK or srun's PROCID

        if not (kwargs.get("local_proc_idx", 0) == 0 and launcher_env().rank == 0):
            time.sleep(seconds)
        return original(*args, **kwargs)

    writer.write_preloaded_data = staticmethod(delayed)


def _slow_commit(module, seconds):
    """Sleep before the rename into place and before the tracker update."""
    for name in ("_rename_into_place", "_write_tracker"):
        def delayed(*args, _original=getattr(module, name)):
            time.sleep(seconds)
            return _original(*args)
        setattr(module, name, delayed)


class _PatchAfterExec(importlib.abc.Loader):
    """Runs the real loader, then the patch; everything else is the real loader's."""

    def __init__(self, loader, patch):
        self.loader, self.patch = loader, patch

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        self.loader.exec_module(module)
        self.patch(module)

    def __getattr__(self, name):
        return getattr(self.loader, name)


class _PatchOnImport(importlib.abc.MetaPathFinder):
    def __init__(self, patches):
        self.patches = patches  # module name -> patch(module)

    def find_spec(self, name, path=None, target=None):
        patch = self.patches.get(name)
        if patch is None:
            return None
        for finder in sys.meta_path:
            if finder is not self and hasattr(finder, "find_spec"):
                spec = finder.find_spec(name, path, target)
                if spec is not None:
                    spec.loader = _PatchAfterExec(spec.loader, patch)
                    return spec
        return None


def install(seconds: float):
    sys.meta_path.insert(0, _PatchOnImport({
        "megatron.core.dist_checkpointing.strategies.filesystem_async":
            lambda m: _slow_shard_writes(m, seconds),
        "megatron_moe.training.checkpointing": lambda m: _slow_commit(m, seconds),
    }))
