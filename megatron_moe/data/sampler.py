"""Deterministic, resumable batch sampling over a map-style dataset (``--dataloader-type``).

Megatron-LM's samplers live in megatron/training, which the megatron-core wheel does not ship, so
their rules are written here (the same index sequences, so a run moved from Megatron-LM reads the
same samples from the same megatron-core dataset):

* ``single`` (``PretrainingSampler``): samples in order; global batch g holds samples
  [g*G, (g+1)*G); data-parallel rank r reads its micro-batches from its slice.
* ``cyclic`` (``RandomPretrainingSampler``): Megatron's ``MegatronPretrainingRandomSampler``, one
  random permutation per epoch, seeded by the epoch number; epochs follow one another without end.
* ``external``: the datasets provider's objects are the iterators (no sampler; ``_iterator`` in
  training/loop.py).

Resuming at ``consumed_samples`` continues with exactly the samples an uninterrupted run draws.
"""

from __future__ import annotations

import itertools

import torch

from megatron_moe.runtime.helper_processes import shield_data_worker

DATALOADER_TYPES = ("single", "cyclic", "external")


def add_arguments(group):
    """Megatron-LM's data-loader flags (names, defaults and choices as in its arguments.py)."""
    group.add_argument("--dataloader-type", type=str, default=None, choices=list(DATALOADER_TYPES),
                       help="single: one pass in order (the default); cyclic: a random order "
                            "per epoch, repeating; external: the datasets provider returns the "
                            "iterators.")
    group.add_argument("--no-data-sharding", action="store_false", dest="data_sharding",
                       help="cyclic: shuffle the whole dataset each epoch and deal it out across "
                            "data-parallel ranks, instead of each rank shuffling its own shard.")


def validate_args(args):
    """Megatron's default (None -> single) and what the interleaved schedule cannot take."""
    if args.dataloader_type is None:
        args.dataloader_type = "single"
    if args.dataloader_type == "external" and \
            getattr(args, "virtual_pipeline_model_parallel_size", None) is not None:
        raise ValueError("--dataloader-type external with virtual pipeline stages: each model "
                         "chunk needs its own iterator here, and the provider returns one")


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


class RandomPretrainingSampler:
    """``--dataloader-type cyclic``: Megatron-LM's ``MegatronPretrainingRandomSampler``.

    An epoch is the largest multiple of micro-batch x data-parallel size that fits the dataset;
    epoch e draws ``torch.randperm`` with a generator seeded by e (``--seed`` enters through the
    dataset's own shuffle, as in Megatron). With data sharding (the default) rank r permutes only
    its own contiguous shard; with ``--no-data-sharding`` the whole dataset is permuted and dealt
    out rank by rank. Unlike Megatron's, the iterator runs on into the next epoch itself (Megatron
    re-creates it per epoch through ``cyclic_iter``), and without sharding every rank ends the
    epoch at its size: where the dataset leaves a remainder of a micro-batch or more past the
    epoch, Megatron's ranks draw different numbers of micro-batches and drift out of step (where
    they agree, the micro-batches are the same: docs/data.md).
    """

    def __init__(self, total_samples: int, consumed_samples: int, micro_batch_size: int,
                 data_parallel_rank: int, data_parallel_size: int, data_sharding: bool = True):
        self.micro_batch_size = micro_batch_size
        self.dp_rank = data_parallel_rank
        self.dp_size = data_parallel_size
        self.data_sharding = data_sharding
        self.total_samples = total_samples
        self.step = micro_batch_size * data_parallel_size   # samples consumed per micro-batch
        self.epoch_samples = total_samples - total_samples % self.step
        if self.epoch_samples <= 0:
            raise ValueError(f"--dataloader-type cyclic: the dataset ({total_samples} samples) is "
                             f"smaller than micro-batch x data-parallel size ({self.step})")
        if consumed_samples % self.step:
            raise ValueError(f"consumed_samples ({consumed_samples}) is not a multiple of "
                             f"micro-batch x data-parallel size ({self.step})")
        self.consumed_samples = consumed_samples

    def __len__(self):
        return self.total_samples

    def epoch_indices(self, epoch: int, offset: int) -> list:
        """This rank's sample indices of ``epoch`` from the epoch's ``offset``-th sample on."""
        generator = torch.Generator()
        generator.manual_seed(epoch)
        if self.data_sharding:
            shard = (self.total_samples // self.step) * self.micro_batch_size
            order = torch.randperm(shard, generator=generator)[offset // self.dp_size:]
            return (order + self.dp_rank * shard).tolist()
        whole = (self.total_samples // self.micro_batch_size) * self.micro_batch_size
        order = torch.randperm(whole, generator=generator)[offset:self.epoch_samples]
        return order[self.dp_rank::self.dp_size].tolist()

    def __iter__(self):
        epoch, offset = divmod(self.consumed_samples, self.epoch_samples)
        for epoch in itertools.count(epoch):
            indices = self.epoch_indices(epoch, offset)
            for first in range(0, len(indices) - self.micro_batch_size + 1, self.micro_batch_size):
                yield indices[first:first + self.micro_batch_size]
            offset = 0


def build_data_iterator(dataset, consumed_samples, micro_batch_size, dp_rank, dp_size,
                        num_workers=0, dataloader_type="single", data_sharding=True):
    """An iterator of collated micro-batches, starting after ``consumed_samples``."""
    if dataset is None:
        return None
    if dataloader_type == "cyclic":
        sampler = RandomPretrainingSampler(len(dataset), consumed_samples, micro_batch_size,
                                           dp_rank, dp_size, data_sharding)
    else:
        sampler = PretrainingSampler(len(dataset), consumed_samples % len(dataset),
                                     micro_batch_size, dp_rank, dp_size)
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
