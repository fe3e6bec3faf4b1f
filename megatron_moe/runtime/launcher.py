"""Where a process learns its rank: torchrun's variables, else Slurm's (srun, one task per rank).

Read by the parser (the world size every parallel size must divide, before any process group) and
by initialize.py (the process group itself), so both always agree. No torch import: tools parse
their flags (and print --help) without it.

* torchrun (also under srun + torchrun): ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``,
  ``MASTER_PORT``.
* ``srun python pretrain_gpt_moe.py`` (one task per rank): ``SLURM_PROCID``, ``SLURM_NTASKS``,
  ``SLURM_LOCALID``; the rendezvous is the first host of ``SLURM_JOB_NODELIST`` and a port derived
  from ``SLURM_JOB_ID`` (two jobs sharing a node get different ports), unless ``MASTER_ADDR`` /
  ``MASTER_PORT`` are exported.
* neither: one process (rank 0 of 1).
"""

from __future__ import annotations

import os
import re
from typing import NamedTuple

SLURM_PORT_BASE, SLURM_PORT_SPAN = 20000, 20000   # MASTER_PORT = base + job id % span


class LauncherEnv(NamedTuple):
    rank: int
    world_size: int
    local_rank: int
    source: str   # which variable gave the world size: "WORLD_SIZE", "SLURM_NTASKS" or "default"


def _int(name: str) -> int:
    value = os.environ[name]
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not an integer") from None


def launcher_env() -> LauncherEnv:
    """(rank, world_size, local_rank, source) from torchrun's variables, else Slurm's, else 1."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return LauncherEnv(_int("RANK"), _int("WORLD_SIZE"),
                           _int("LOCAL_RANK") if "LOCAL_RANK" in os.environ else 0, "WORLD_SIZE")
    if "SLURM_PROCID" in os.environ and "SLURM_NTASKS" in os.environ:   # srun, no torchrun
        return LauncherEnv(_int("SLURM_PROCID"), _int("SLURM_NTASKS"),
                           _int("SLURM_LOCALID") if "SLURM_LOCALID" in os.environ else 0,
                           "SLURM_NTASKS")
    if "WORLD_SIZE" in os.environ:
        return LauncherEnv(0, _int("WORLD_SIZE"), 0, "WORLD_SIZE")
    return LauncherEnv(0, 1, 0, "default")


def first_host(nodelist: str) -> str:
    """The first host of a Slurm hostlist ("gpu[003-004,007],cpu1" -> "gpu003"), what
    ``scontrol show hostnames | head -n 1`` prints, without needing scontrol on the node."""
    match = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if not match:
        raise ValueError(f"SLURM_JOB_NODELIST={nodelist!r} is not a Slurm host list")
    prefix, ranges = match.groups()
    if not ranges:
        return prefix
    return prefix + ranges.split(",")[0].split("-")[0]


def set_rendezvous_env():
    """MASTER_ADDR / MASTER_PORT for init_process_group's env:// rendezvous, unless set."""
    if launcher_env().source == "SLURM_NTASKS":
        nodelist = os.environ.get("SLURM_JOB_NODELIST") or os.environ.get("SLURM_NODELIST")
        if nodelist:
            os.environ.setdefault("MASTER_ADDR", first_host(nodelist))
        if "SLURM_JOB_ID" in os.environ:
            os.environ.setdefault("MASTER_PORT", str(
                SLURM_PORT_BASE + _int("SLURM_JOB_ID") % SLURM_PORT_SPAN))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "6000")
