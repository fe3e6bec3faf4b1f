"""The modules a process imports once before it forks its workers (one list for both users): the
gloo test ranks' fork server (megatron_moe/runtime/local_ranks.py) and the GPU kit's CPU-mode
runner (megatron_moe/gpucheck/process.py), each sparing every child ~4 s of imports.

Listed in the order a training rank imports them, because the order is set by import-time
workarounds of megatron-core: ``megatron_moe`` first (its ``__init__`` keeps megatron-core's
import-time ``import wandb`` from loading wandb, and silences the TE/apex notices),
``megatron_moe.training.loop`` next (it registers megatron-core 0.19's triton stub before
megatron-core loads), then the megatron-core modules every training rank loads. None of them reads
the environment at import in a way the tests vary.

By name, not by import statements: multiprocessing's fork server takes names, and this is the one
place our own modules are imported by name (tests/test_package_imports.py allows it in compat/).
"""

from __future__ import annotations

import importlib

MODULES = ("megatron_moe", "megatron_moe.training.loop", "torch", "torch.distributed",
           "megatron.core", "megatron.core.models.gpt", "megatron.core.optimizer",
           "megatron.core.dist_checkpointing", "megatron.core.pipeline_parallel",
           "megatron.core.transformer.moe.moe_layer",
           "megatron.core.datasets.blended_megatron_dataset_builder")


def import_all() -> None:
    """Import ``MODULES`` in this process (an ImportError propagates: the fork server would skip
    the module silently, a runner should not)."""
    for name in MODULES:
        importlib.import_module(name)
