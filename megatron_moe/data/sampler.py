"""Deterministic, resumable batch sampling over a map-style dataset.

Megatron-LM's ``MegatronPretrainingSampler`` lives in megatron/training, which the megatron-core
wheel does not ship, so this is the same rule written here: samples are taken in order; global
batch g holds samples [g*G, (g+1)*G); data-parallel rank r reads its micro-batches from its slice.
Resuming at ``consumed_samples`` therefore continues with exactly the next sample.
"""

from __future__ import annotations

import torch

from megatron_moe.runtime.helper_processes import shield_data_worker


class PretrainingSampler:
    def __init__(self, total_samples: int, consumed_samples: int, micro_batch_size: int,
                 data_parallel_rank: int, data_parallel_size: int):
        if total_samples <= 0:
            raise ValueError(f"no samples to draw from (total_samples={total_samples})")
        if consumed_samples >= total_samples:
            raise ValueError(f"consumed_samples ({consumed_samples}) >= dataset size ({total_samples})")
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.dp_rank = data_parallel_rank
        self.dp_size = data_parallel_size

    def __len__(self):
        return self.total_samples

    def __iter__(self):
        step = self.micro_batch_size * self.dp_size
        start = self.dp_rank * self.micro_batch_size
        for first in range(self.consumed_samples, self.total_samples - step + 1, step):
            yield list(range(first + start, first + start + self.micro_batch_size))


def build_data_iterator(dataset, consumed_samples, micro_batch_size, dp_rank, dp_size,
                        num_workers=0):
    """An infinite-style iterator of collated micro-batches, starting after ``consumed_samples``."""
    if dataset is None:
        return None
    sampler = PretrainingSampler(len(dataset), consumed_samples % len(dataset), micro_batch_size,
                                 dp_rank, dp_size)
    # Own generator: creating a DataLoader iterator draws a seed, which must not consume the
    # global RNG (a resumed run restores it before building the iterator).
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler, num_workers=num_workers,
                                         generator=torch.Generator().manual_seed(0),
                                         pin_memory=torch.cuda.is_available(),
                                         persistent_workers=num_workers > 0,
                                         # workers outlast a scheduler's step-wide SIGTERM
                                         # until the rank stops (helper_processes.py)
                                         worker_init_fn=shield_data_worker if num_workers else None)
    return iter(loader)
