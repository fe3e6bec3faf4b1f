"""--dataloader-type (single / cyclic / external), --no-data-sharding and --skip-train.

The sampler cases run in-process (index arithmetic only); the training cases run the real
``pretrain()`` on 1-2 gloo ranks with the tiny model. Each property has a ``mutate`` case: the
monkeypatch named breaks the rule under test, and the same check must then fail.
"""

import re

import pytest
import torch

from megatron_moe.data.sampler import PretrainingSampler, RandomPretrainingSampler
from megatron_moe.runtime.local_ranks import run_distributed
from tests._ckpt_cases import TINY

# --- mutations (each breaks one rule of the cyclic sampler) ---------------------------------------


def _epoch_not_in_seed():
    real = RandomPretrainingSampler.epoch_indices
    RandomPretrainingSampler.epoch_indices = lambda self, epoch, offset: real(self, 0, offset)
    return lambda: setattr(RandomPretrainingSampler, "epoch_indices", real)


def _resume_offset_ignored():
    real = RandomPretrainingSampler.__init__

    def init(self, total, consumed, *a, **k):
        real(self, total, consumed, *a, **k)
        self.consumed_samples = consumed - consumed % self.epoch_samples   # restarts the epoch
    RandomPretrainingSampler.__init__ = init
    return lambda: setattr(RandomPretrainingSampler, "__init__", real)


def _rank_ignored():
    real = RandomPretrainingSampler.__init__

    def init(self, total, consumed, mbs, rank, *a, **k):
        real(self, total, consumed, mbs, 0, *a, **k)
    RandomPretrainingSampler.__init__ = init
    return lambda: setattr(RandomPretrainingSampler, "__init__", real)


MUTATIONS = {"epoch-not-in-seed": _epoch_not_in_seed, "resume-offset-ignored": _resume_offset_ignored,
             "rank-ignored": _rank_ignored}


def _mutated(mutate):
    """A context: the named mutation installed for its body (None: nothing)."""
    import contextlib

    @contextlib.contextmanager
    def ctx():
        undo = MUTATIONS[mutate]() if mutate else None
        try:
            yield
        finally:
            if undo:
                undo()
    return ctx()


def _check(mutate, check, *args):
    """``check(*args)`` passes, or under the named mutation fails."""
    with _mutated(mutate):
        if mutate:
            with pytest.raises(AssertionError):
                check(*args)
        else:
            check(*args)


def _draw(sampler, batches):
    it = iter(sampler)
    return [next(it) for _ in range(batches)]


# --- the sampler ----------------------------------------------------------------------------------

def check_permutation_per_epoch(total=22, mbs=2):
    """Each epoch (20 of 22 samples: a multiple of micro-batch x DP) is a permutation: every sample
    once, an order other than single's, another order in the next epoch, the same on a rebuild."""
    epoch = total - total % mbs
    flat = [i for b in _draw(RandomPretrainingSampler(total, 0, mbs, 0, 1), 3 * epoch // mbs)
            for i in b]
    epochs = [flat[k * epoch:(k + 1) * epoch] for k in range(3)]
    for order in epochs:
        assert sorted(order) == list(range(epoch)), order
    assert epochs[0] != list(range(epoch))   # not single's order
    single = [i for b in PretrainingSampler(total, 0, mbs, 0, 1) for i in b]
    assert single == list(range(epoch))
    assert epochs[0] != epochs[1] != epochs[2], epochs
    again = [i for b in _draw(RandomPretrainingSampler(total, 0, mbs, 0, 1), 3 * epoch // mbs)
             for i in b]
    assert again == flat   # deterministic


def check_resume(sharding, total=22, mbs=2, dp=2):
    """A sampler built at consumed_samples c draws what an uninterrupted one draws after c, at
    every resume point of three epochs (mid-epoch and on epoch boundaries)."""
    step = mbs * dp
    for rank in range(dp):
        full = _draw(RandomPretrainingSampler(total, 0, mbs, rank, dp, sharding), 15)
        for done in range(1, 15):
            resumed = _draw(RandomPretrainingSampler(total, done * step, mbs, rank, dp, sharding),
                            15 - done)
            assert resumed == full[done:], (rank, done)


def check_ranks_disjoint(sharding, total=22, mbs=2, dp=2):
    """In each epoch the data-parallel ranks read disjoint samples covering the epoch."""
    epoch = total - total % (mbs * dp)
    per_epoch = epoch // (mbs * dp)
    draws = [_draw(RandomPretrainingSampler(total, 0, mbs, r, dp, sharding), 2 * per_epoch)
             for r in range(dp)]
    for e in range(2):
        seen = [i for r in range(dp) for b in draws[r][e * per_epoch:(e + 1) * per_epoch] for i in b]
        assert len(seen) == len(set(seen)) == epoch, (e, seen)


@pytest.mark.parametrize("mutate", [None, "epoch-not-in-seed"])
def test_cyclic_draws_a_permutation_per_epoch(mutate):
    _check(mutate, check_permutation_per_epoch)


@pytest.mark.parametrize("sharding", [True, False], ids=["sharded", "no-data-sharding"])
@pytest.mark.parametrize("mutate", [None, "resume-offset-ignored"])
def test_cyclic_resumes_at_any_consumed_samples(sharding, mutate):
    _check(mutate, check_resume, sharding)


@pytest.mark.parametrize("sharding", [True, False], ids=["sharded", "no-data-sharding"])
@pytest.mark.parametrize("mutate", [None, "rank-ignored"])
def test_cyclic_ranks_read_disjoint_samples(sharding, mutate):
    _check(mutate, check_ranks_disjoint, sharding)


def test_sharding_modes_differ():
    """Sharded: rank 0 only ever reads its own contiguous shard; unsharded: from the whole set."""
    sharded = {i for b in _draw(RandomPretrainingSampler(22, 0, 2, 0, 2, True), 10) for i in b}
    whole = {i for b in _draw(RandomPretrainingSampler(22, 0, 2, 0, 2, False), 10) for i in b}
    assert sharded == set(range(10))
    assert whole - set(range(10))


def test_cyclic_through_data_loader_workers():
    """build_data_iterator with --num-workers 1 (the loader runs the sampler ahead of the
    workers): the micro-batches are the sampler's, in its order, into the third epoch."""
    from megatron_moe.data.sampler import build_data_iterator

    dataset = list(range(22))
    it = build_data_iterator(dataset, 8, 2, 1, 2, num_workers=1, dataloader_type="cyclic")
    got = [next(it).tolist() for _ in range(12)]
    assert got == _draw(RandomPretrainingSampler(22, 8, 2, 1, 2), 12)


def test_cyclic_refuses_a_dataset_smaller_than_one_step():
    with pytest.raises(ValueError, match="smaller than micro-batch x data-parallel size"):
        RandomPretrainingSampler(3, 0, 2, 0, 2)


# --- training: pretrain() with a small dataset (so epochs turn over) ------------------------------

SMALL_TRAIN = 20   # samples: 2.5 iterations of 8 per epoch


class _Recorded(torch.utils.data.Dataset):
    """The first SMALL_TRAIN samples of a dataset; the indices read are recorded."""

    def __init__(self, dataset):
        self.dataset, self.read = dataset, []

    def __len__(self):
        return SMALL_TRAIN

    def __getitem__(self, idx):
        self.read.append(int(idx))
        return self.dataset[idx]


def run_small(rank, world_size, steps):
    """pretrain() runs in turn on a SMALL_TRAIN-sample training set: each step (argv, mutation
    name or None) -> (losses, the training indices this rank read)."""
    import pretrain_gpt_moe
    from megatron.core import parallel_state
    from megatron.core.enums import ModelType

    from megatron_moe.training.loop import pretrain

    out = []
    for argv, mutate in steps:
        recorded = []

        def provider(num_samples):
            train, valid, test = pretrain_gpt_moe.train_valid_test_datasets_provider(num_samples)
            recorded.append(_Recorded(train))
            return recorded[-1], valid, test

        parallel_state.destroy_model_parallel()
        with _mutated(mutate):
            result = pretrain(provider, pretrain_gpt_moe.model_provider,
                              ModelType.encoder_or_decoder, pretrain_gpt_moe.forward_step,
                              argv=argv)
        out.append((result["history"]["lm_loss"], recorded[0].read))
    return out


@pytest.mark.parametrize("mutate", [None, "resume-offset-ignored"])
def test_cyclic_training_resumes_exactly_across_epochs(tmp_path, mutate):
    """6 iterations (48 samples: 2.4 epochs of 20) == 3, stop, resume, 3: bit-identical losses.
    The 2 ranks read disjoint samples, each epoch a permutation, other than single's order."""
    ckpt = str(tmp_path / "ckpt")
    base = TINY + ["--expert-model-parallel-size", "2", "--train-iters", "6",
                   "--dataloader-type", "cyclic"]
    ranks = run_distributed(run_small, 2, [
        (base, None),
        (base + ["--save", ckpt, "--exit-interval", "3"], None),
        (base + ["--load", ckpt], mutate),
        (TINY + ["--expert-model-parallel-size", "2", "--train-iters", "2"], None),   # single
    ], timeout_s=300)
    (full, full_read), (first, first_read), (second, second_read), (_, single_read) = ranks[0]
    if mutate:
        assert first + second != full
        return
    assert first + second == full, (first, second, full)
    assert first_read + second_read == full_read
    # each iteration: 2 micro-batches of 2 per rank; the epoch (20 samples) spans 2.5 iterations
    reads = [r[0][1] for r in ranks]
    assert [len(r) for r in reads] == [24, 24]
    assert single_read[:8] == [0, 1, 4, 5, 8, 9, 12, 13]   # rank 0's slices, in order
    assert reads[0][:8] != single_read[:8]
    for e in range(2):   # epoch e: 10 samples per rank, together a permutation of 0..19
        seen = reads[0][10 * e:10 * e + 10] + reads[1][10 * e:10 * e + 10]
        assert sorted(seen) == list(range(SMALL_TRAIN)), (e, seen)
    assert reads[0][:10] != reads[0][10:20]   # another order in the next epoch
    assert ranks[1][0][0] == full   # every rank logs the same, all-reduced loss


def test_cyclic_training_is_deterministic():
    argv = TINY + ["--train-iters", "3", "--dataloader-type", "cyclic", "--seed", "7"]
    (a, a_read), (b, b_read) = run_distributed(run_small, 1, [(argv, None), (argv, None)],
                                               timeout_s=300)[0]
    assert a == b and a_read == b_read


# --- --skip-train and --dataloader-type external --------------------------------------------------

def _flag_ignored():
    from megatron_moe import arguments

    real = arguments.validate_args

    def validate(args, *a, **k):
        real(args, *a, **k)
        args.skip_train = False
    arguments.validate_args = validate
    return lambda: setattr(arguments, "validate_args", real)


def _eval_line(text, prefix):
    match = re.search(r" validation loss at " + re.escape(prefix) + r" \| lm loss value: (\S+) ",
                      text)
    return match and match.group(1)


@pytest.mark.parametrize("mutate", [None, "flag-ignored"])
def test_skip_train_evaluates_the_loaded_model_without_training(tmp_path, mutate):
    """Trained 2 of 4 iterations and saved; --skip-train from there runs no iteration, writes no
    checkpoint, and evaluates validation and test sets on the loaded weights: its validation loss
    is the training run's own evaluation at iteration 2 (the same first validation samples)."""
    from tests._ckpt_cases import run_pretrain_steps

    ckpt = str(tmp_path / "ckpt")
    base = TINY + ["--eval-interval", "2", "--train-iters", "4"]
    trained, skipped = run_distributed(run_pretrain_steps, 1, [
        {"argv": base + ["--save", ckpt, "--exit-interval", "2"]},
        # iterations 3-4 would run, were the flag ignored
        {"argv": base + ["--load", ckpt, "--save", ckpt, "--skip-train"],
         "mutate": _flag_ignored if mutate else None},
    ], timeout_s=300)[0]
    assert trained["exit"] == 0 and skipped["exit"] == 0, skipped["text"]
    iteration_lines = re.findall(r"\] iteration +\d+/", skipped["text"])
    if mutate:
        assert iteration_lines
        return
    assert not iteration_lines, skipped["text"]
    assert "skipping training (--skip-train is on) ..." in skipped["text"]
    assert "enabling --no-load-optim when skipping training." in skipped["text"]
    assert sorted(p.name for p in tmp_path.joinpath("ckpt").glob("iter_*")) == ["iter_0000002"]
    assert _eval_line(skipped["text"], "iteration 2 on test set"), skipped["text"]
    at_training = _eval_line(trained["text"], "iteration 2")
    assert at_training is not None, trained["text"]
    assert _eval_line(skipped["text"], "iteration 2 on validation set") == at_training


def test_external_with_a_map_style_provider_is_one_line(tmp_path):
    from tests._ckpt_cases import run_pretrain_steps

    (out,) = run_distributed(run_pretrain_steps, 1, [
        {"argv": TINY + ["--train-iters", "1", "--dataloader-type", "external"]}], timeout_s=300)[0]
    assert out["exit"] == 1
    assert "error: --dataloader-type external: the datasets provider returned a " in out["text"]
    assert "Traceback" not in out["text"]


def _batches(dataset, micro_batch_size):
    """A plain generator of collated micro-batches: what an external provider hands over."""
    while True:
        for first in range(0, len(dataset) - micro_batch_size + 1, micro_batch_size):
            yield torch.utils.data.default_collate(
                [dataset[i] for i in range(first, first + micro_batch_size)])


def run_external(rank, world_size, argv, generators):
    """pretrain() with the GPT provider, its datasets turned into generators of batches
    (Megatron's external contract) when ``generators``."""
    import pretrain_gpt_moe
    from megatron.core.enums import ModelType

    from megatron_moe.training.loop import pretrain

    def provider(num_samples):
        datasets = pretrain_gpt_moe.train_valid_test_datasets_provider(num_samples)
        if not generators:
            return datasets
        return tuple(_batches(d, 2) if d is not None else None for d in datasets)

    return pretrain(provider, pretrain_gpt_moe.model_provider, ModelType.encoder_or_decoder,
                    pretrain_gpt_moe.forward_step, argv=argv)["history"]["lm_loss"]


def test_external_uses_the_providers_iterators():
    """One rank, micro-batch 2: the provider's generator in order == single's in-order sampler."""
    argv = TINY + ["--train-iters", "3"]
    external = run_distributed(run_external, 1, argv + ["--dataloader-type", "external"], True,
                               timeout_s=300)[0]
    single = run_distributed(run_external, 1, argv, False, timeout_s=300)[0]
    assert len(external) == 3
    assert external == single


def test_bad_dataloader_flags_fail_at_parse_time():
    import subprocess
    import sys

    from tests._ckpt_cases import ROOT

    for extra, needle in (
            (["--dataloader-type", "bogus"], "--dataloader-type"),
            (["--dataloader-type", "external", "--pipeline-model-parallel-size", "2",
              "--num-layers-per-virtual-pipeline-stage", "1", "--num-layers", "4"],
             "--dataloader-type external with virtual pipeline stages")):
        out = subprocess.run([sys.executable, "pretrain_gpt_moe.py"] + TINY + ["--train-iters", "1"]
                             + extra, cwd=ROOT, capture_output=True, text=True, timeout=120,
                             env={**__import__("os").environ, "WORLD_SIZE": "2"})
        assert out.returncode == 2, out.stderr
        assert needle in out.stderr, out.stderr
        assert "Traceback" not in out.stderr


def _eval_batches(rank, world, argv, mutate=None):
    """pretrain() with every evaluation forward recorded: the micro-batch's sample count."""
    import pretrain_gpt_moe

    from megatron_moe import arguments
    from tests._train_cases import _pretrain

    seen = []
    real_step, real_validate = pretrain_gpt_moe.forward_step, arguments.validate_args

    def forward_step(data_iterator, model):
        from megatron_moe.models.builder import unwrap

        if not unwrap(model).training:
            batch = next(data_iterator) if not isinstance(data_iterator, list) else None
            seen.append(int(batch["tokens"].shape[0]))
            return real_step(iter([batch]), model)
        return real_step(data_iterator, model)

    def training_batch(args, *a, **k):   # the mutation: evaluation keeps training's batch
        out = real_validate(args, *a, **k)
        args.eval_micro_batch_size, args.eval_global_batch_size = (args.micro_batch_size,
                                                                   args.global_batch_size)
        args.eval_num_microbatches = args.num_microbatches
        return out

    pretrain_gpt_moe.forward_step = forward_step
    if mutate:
        arguments.validate_args = training_batch
    try:
        _pretrain(argv)
    finally:
        pretrain_gpt_moe.forward_step, arguments.validate_args = real_step, real_validate
    return seen


@pytest.mark.parametrize("mutate", [None, "training_batch"])
def test_evaluation_has_its_own_batch(mutate):
    """--eval-micro-batch-size / --eval-global-batch-size (Megatron-LM): evaluation reads
    micro-batches of 1 sample, 4 samples per evaluation iteration over 2 data-parallel ranks (2
    micro-batches per rank), while training keeps 2 x 8; 4 evaluations (after iterations 1 and 2,
    then the validation and test sets once training ends) of 2 iterations each."""
    argv = TINY + ["--expert-model-parallel-size", "2", "--train-iters", "2", "--eval-interval",
                   "1", "--eval-iters", "2", "--eval-micro-batch-size", "1",
                   "--eval-global-batch-size", "4"]
    for seen in run_distributed(_eval_batches, 2, argv, mutate, timeout_s=300):
        if mutate:
            assert seen != [1] * (4 * 2 * 2), seen
        else:
            assert seen == [1] * (4 * 2 * 2), seen


def test_evaluation_batch_must_split_into_micro_batches(capsys):
    from megatron_moe.arguments import parse_args

    with pytest.raises(SystemExit):
        parse_args(TINY + ["--train-iters", "1", "--eval-micro-batch-size", "3",
                           "--eval-global-batch-size", "4"])
    assert ("--eval-global-batch-size (4) must be a positive multiple of --eval-micro-batch-size "
            "(3) x data-parallel size (1)") in capsys.readouterr().err
