"""The MoE data path's other collectives: the per-expert count all-gather of the balanced layer and
the point-to-point expert traffic of the balance placements (Trans, Agg, replica moves, sum-back).

Thin on purpose: one place where the data path meets ``torch.distributed``, so every call takes
the payload's device (NCCL refuses host tensors) and the strict-device mode (comm/strict.py) sees
every call. Peers are ranks *within* ``group``, as in the rest of comm/.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_moe.comm import link

__all__ = ["all_gather_rows", "isend", "irecv"]


def all_gather_rows(t: torch.Tensor, group) -> torch.Tensor:
    """``cat`` over the group (in group-rank order) of every member's ``t``; stays on ``t``'s device."""
    t = t.contiguous()
    world = dist.get_world_size(group)
    if world == 1:
        return t
    parts = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(parts, t, group=group)
    return torch.cat(parts)


def isend(t: torch.Tensor, peer: int, group, tag: int = 0):
    """Asynchronous send of ``t`` to group rank ``peer``; returns the work handle. With an emulated
    link (comm/link.py) the send leaves when its window on the link ends."""
    if link.active():
        return link.send(t, dist.get_global_rank(group, peer), group, tag)
    return dist.isend(t, dist.get_global_rank(group, peer), group, tag=tag)


def irecv(t: torch.Tensor, peer: int, group, tag: int = 0):
    """Asynchronous receive into ``t`` (allocate it on the payload's device) from group rank ``peer``."""
    if link.active():        # nothing delayed here (the sender's link is); the wait is timed
        return link.recv(t, dist.get_global_rank(group, peer), group, tag)
    return dist.irecv(t, dist.get_global_rank(group, peer), group, tag=tag)
