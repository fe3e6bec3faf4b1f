#!/usr/bin/env python
"""Compare megatron_moe/data/sampler.py with Megatron-LM's own samplers (no Megatron code copied).

    git -C Megatron-LM archive core_v0.16.1 megatron | tar -x -C /tmp/mlm-0.16.1
    python tools/compare_megatron_samplers.py --megatron-lm /tmp/mlm-0.16.1

Loads Megatron-LM's ``megatron/training/datasets/data_samplers.py`` from the checkout (its two
``megatron.training`` imports stubbed: the samplers use neither) and draws, for dataset sizes,
micro-batch sizes, data-parallel sizes, both data-sharding modes and every resume point of three
epochs, each rank's micro-batches from Megatron's sampler (re-iterated per epoch, as its
``cyclic_iter``) and from ours. Prints how many cases are identical, and checks that every
differing case is one where Megatron's ranks disagree on the number of micro-batches in an epoch
(docs/data.md). ``--dataloader-type single`` is compared over one pass.
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import os
import sys
import types

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def load_megatron_samplers(checkout):
    training = types.ModuleType("megatron.training")
    training.get_args = lambda: None
    handler = types.ModuleType("megatron.training.dist_signal_handler")
    handler.DistributedSignalHandler = object
    sys.modules.setdefault("megatron.training", training)
    sys.modules.setdefault("megatron.training.dist_signal_handler", handler)
    path = os.path.join(checkout, "megatron", "training", "datasets", "data_samplers.py")
    spec = importlib.util.spec_from_file_location("megatron_lm_data_samplers", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def megatron_cyclic(mlm, total, consumed, mbs, rank, dp, sharding, count):
    sampler = mlm.MegatronPretrainingRandomSampler(None, total, consumed, mbs, rank, dp, sharding)
    out = []
    while len(out) < count:   # cyclic_iter: the sampler is iterated again each epoch
        out.extend(itertools.islice(iter(sampler), count - len(out)))
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--megatron-lm", required=True, help="a Megatron-LM checkout")
    args = p.parse_args(argv)
    from megatron_moe.data.sampler import PretrainingSampler, RandomPretrainingSampler

    mlm = load_megatron_samplers(args.megatron_lm)
    cases = same = explained = single_cases = single_same = 0
    for total in (8, 10, 14, 22, 37, 64, 101):
        for mbs, dp in itertools.product((1, 2, 3), (1, 2, 4)):
            step = mbs * dp
            if total < step:
                continue
            for consumed in range(0, total - step + 1, step):
                for rank in range(dp):
                    single_cases += 1
                    single_same += (list(PretrainingSampler(total, consumed, mbs, rank, dp))
                                    == list(mlm.MegatronPretrainingSampler(total, consumed, mbs,
                                                                           rank, dp)))
            for sharding, consumed in itertools.product((True, False), range(0, 3 * total, step)):
                count = 3 * total // mbs + 2
                ours = [list(itertools.islice(iter(RandomPretrainingSampler(
                    total, consumed, mbs, r, dp, sharding)), count)) for r in range(dp)]
                theirs = [megatron_cyclic(mlm, total, consumed, mbs, r, dp, sharding, count)
                          for r in range(dp)]
                cases += 1
                if ours == theirs:
                    same += 1
                    continue
                counts = {sum(1 for _ in mlm.MegatronPretrainingRandomSampler(
                    None, total, consumed, mbs, r, dp, sharding)) for r in range(dp)}
                explained += len(counts) > 1
    print(f"single: {single_same}/{single_cases} identical")
    print(f"cyclic: {same}/{cases} identical; {explained}/{cases - same} differing cases are "
          f"ones where Megatron's ranks draw different numbers of micro-batches in an epoch")
    return 0 if single_same == single_cases and same + explained == cases else 1


if __name__ == "__main__":
    sys.exit(main())
