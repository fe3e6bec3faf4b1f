"""Module-level rank functions for tests (spawned processes must be able to import them)."""

import torch
import torch.distributed as dist


def allreduce_rank(rank, world_size):
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return float(t)


def hang_rank(rank, world_size):
    if rank == 0:
        import time

        time.sleep(3600)
    return rank


def fail_rank(rank, world_size):
    if rank == 1:
        raise ValueError("boom on rank 1")
    dist.barrier()
    return rank


