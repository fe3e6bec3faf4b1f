"""--deterministic-mode, as Megatron-LM's ``megatron/training/determinism.py`` (core_v0.19.0):
the environment that NCCL, cuBLAS and Transformer Engine read at their first use, then
``torch.use_deterministic_algorithms(True)``; megatron-core's own ``deterministic_mode`` is set on
the TransformerConfig (models/builder.py). On a CPU the torch switch is what acts; the variables
are set all the same (they are read only by CUDA libraries)."""

from __future__ import annotations

import torch

ENV_DEFAULTS = {"NCCL_ALGO": "Ring", "NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0",
                "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
ACCEPTED_NCCL_ALGO = frozenset({"Ring", "CollnetDirect", "CollnetChain", "^NVLS"})
ACCEPTED_VALUES = {"NVTE_ALLOW_NONDETERMINISTIC_ALGO": frozenset({"0"}),
                   "CUBLAS_WORKSPACE_CONFIG": frozenset({":4096:8", ":16:8"})}


def check_environment(env) -> None:
    """ValueError (one line) for a variable set to a non-deterministic value."""
    algo = env.get("NCCL_ALGO")
    if algo is not None:
        tokens = [t.strip() for t in algo.split(",") if t.strip()]
        if not tokens or any(t not in ACCEPTED_NCCL_ALGO for t in tokens):
            raise ValueError(f"--deterministic-mode: NCCL_ALGO={algo!r} is not deterministic; "
                             f"use one of {sorted(ACCEPTED_NCCL_ALGO)}")
    for name, accepted in ACCEPTED_VALUES.items():
        value = env.get(name)
        if value is not None and value not in accepted:
            raise ValueError(f"--deterministic-mode: {name}={value!r} is not deterministic; "
                             f"use one of {sorted(accepted)}")


def apply(env) -> None:
    """Before the first kernel and communicator: set the defaults a caller has not set, then
    make torch raise on (or pick the deterministic variant of) non-deterministic algorithms."""
    check_environment(env)
    for name, value in ENV_DEFAULTS.items():
        env.setdefault(name, value)
    torch.use_deterministic_algorithms(True)
