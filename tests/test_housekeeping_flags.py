"""Megatron-LM training flags, end to end on tiny CPU runs (each case also fails under a
mutation, run in the spawned ranks):

* --no-create-attention-mask-in-dataloader: no mask in any batch; with the dataloader's plain
  causal mask the model is given none (its attention builds the same), the same fp32 losses; with
  --reset-attention-mask the model is given the edited mask;
* --save-retain-interval: exactly Megatron's checkpoints remain, the tracker's checkpoint is
  complete whenever one is deleted, a resume continues bit-exactly;
* --log-progress: Megatron's progress.txt lines, FLOPs carried over a resume;
* --manual-gc, --manual-gc-interval: the collector off in every step and evaluation, collections
  at Megatron's points (start, every N iterations, around evaluations), on again after the run,
  the same losses; --empty-unused-memory-level 2: the allocator's cache emptied after each
  forward-backward, optimizer step and evaluation step;
* --disable-gloo-process-groups: refused on gloo; the NCCL path's value creates no Gloo group and
  trains, saves and resumes with the distributed optimizer.
"""

import os

import pytest

from megatron_moe.runtime.local_ranks import DistributedRunError, run_distributed
from tests import _housekeeping_cases as cases
from tests._train_cases import run_pretrain
from tests.test_training import TINY

EXACT = "--attention-dropout 0 --hidden-dropout 0".split()
NO_MASK = ["--no-create-attention-mask-in-dataloader"]
SEQ, MICRO, GLOBAL = 32, 2, 8


def _train(fn, argv, world=1, **kw):
    return run_distributed(fn, world, TINY + argv, timeout_s=300, **kw)[0]


# --- --no-create-attention-mask-in-dataloader ---------------------------------------------------
def _check_masks(mutate=None):
    argv = EXACT + ["--train-iters", "3"]
    with_mask, data_masks, model_masks = _train(cases.train_seeing_masks, argv, mutate=mutate)
    without, data_none, model_none = _train(cases.train_seeing_masks, argv + NO_MASK,
                                            mutate=mutate)
    reset, _, reset_masks = _train(cases.train_seeing_masks, argv + ["--reset-attention-mask"],
                                   mutate=mutate)
    # 3 iterations, then one validation and one test batch: 4 micro-batches each
    n = (3 + 2) * GLOBAL // MICRO
    assert len(data_masks) == len(data_none) == len(reset_masks) == n
    causal = MICRO * SEQ * (SEQ - 1) // 2   # the masked (future) positions of a micro-batch
    # the dataloader builds Megatron's causal mask unless told not to
    assert data_masks == [((MICRO, 1, SEQ, SEQ), causal)] * n, data_masks[:2]
    assert data_none == [None] * n, data_none[:2]
    # the plain causal mask is not handed to the model (its attention builds the same one):
    # the same fp32 losses either way
    assert model_masks == model_none == [None] * n, (model_masks[:2], model_none[:2])
    assert without == with_mask, (without, with_mask)
    assert len(set(with_mask)) == 3   # it trained
    # --reset-attention-mask edits it per document: then the model gets it (at least the future
    # positions masked, more where a document starts inside the sequence)
    assert all(m is not None and m[0] == (MICRO, 1, SEQ, SEQ) and m[1] >= causal
               for m in reset_masks), reset_masks[:2]
    assert len(set(reset)) == 3


def test_attention_mask_in_dataloader_on_and_off():
    _check_masks()


@pytest.mark.parametrize("mutate", ["flag-ignored", "mask-never-needed"])
def test_attention_mask_mutation_fails(mutate):
    with pytest.raises(AssertionError):
        _check_masks(mutate)


# --- --save-retain-interval and --log-progress ---------------------------------------------------
def _iterations(ckpt):
    return sorted(int(name[len("iter_"):]) for name in os.listdir(ckpt)
                  if name.startswith("iter_"))


def _progress(ckpt):
    """progress.txt as (event, {field: value}) per line, after checking the line's prefix."""
    out = []
    for line in open(os.path.join(ckpt, "progress.txt")).read().splitlines():
        date, job, gpus, event, *fields = line.split("\t")
        assert len(date) == 19 and job.startswith("Job ID: ") and gpus == "# GPUs: 1", line
        out.append((event, dict(f.split(": ", 1) for f in fields)))
    return out


def _saved(lines):
    return {int(f["Iteration"]): f for e, f in lines if e == "Saved checkpoint"}


def _check_retention(tmp_path, mutate=None, async_save=False):
    ckpt = str(tmp_path / "ckpt")
    # 12 iterations in two jobs: the first stops at 10
    save = EXACT + ["--train-iters", "12", "--save", ckpt, "--save-interval", "2",
                    "--save-retain-interval", "4", "--log-progress"] + \
        (["--async-save"] if async_save else [])
    first, violations = _train(cases.train_retaining, save + ["--exit-interval", "10"],
                               mutate=mutate)
    assert violations == []
    # saves at 2, 4, 6, 8, 10: each retires the previous one unless it is a multiple of 4
    assert _iterations(ckpt) == [4, 8, 10]
    assert open(os.path.join(ckpt, "latest_checkpointed_iteration.txt")).read() == "10"
    second, violations = _train(cases.train_retaining, save + ["--load", ckpt], mutate=mutate)
    assert violations == []
    assert _iterations(ckpt) == [4, 8, 12]   # the loaded 10 is retired by the save at 12
    assert second["iteration"] == [11, 12]
    return first, second, _progress(ckpt)


@pytest.fixture(scope="module")
def retained(tmp_path_factory):
    """The two jobs of _check_retention, run once for the retention and progress-log tests."""
    return _check_retention(tmp_path_factory.mktemp("retain"))


def test_save_retain_interval_keeps_megatrons_checkpoints_and_resumes(retained):
    first, second, _ = retained
    straight = _train(run_pretrain, EXACT + ["--train-iters", "12"])
    assert first["lm_loss"] + second["lm_loss"] == straight["lm_loss"]


@pytest.mark.parametrize("mutate", ["keeps-by-new-iteration", "deletes-before-tracker"])
def test_save_retain_interval_mutation_fails(tmp_path, mutate):
    with pytest.raises(AssertionError):
        _check_retention(tmp_path, mutate)


def test_save_retain_interval_with_async_save(tmp_path):
    _, _, lines = _check_retention(tmp_path, async_save=True)
    scheduled = [int(f["Iteration"]) for e, f in lines if e == "Saving async checkpoint"]
    committed = [int(f["Iteration"]) for e, f in lines if e == "Saved async checkpoint"]
    assert scheduled == committed == [2, 4, 6, 8, 10, 12], lines


def _check_progress_log(lines):
    events = [e for e, _ in lines]
    assert events.count("Starting job") == 2 and events[0] == "Starting job", events
    saved = _saved(lines)
    assert sorted(saved) == [2, 4, 6, 8, 10, 12]
    deleted = sorted(int(f["Iteration"]) for e, f in lines if e == "Deleted checkpoint")
    assert deleted == [2, 6, 10]
    per_save = float(saved[2]["Floating-point operations"])
    assert per_save > 0
    for it, fields in saved.items():
        # the FLOPs of every iteration so far, the first job's included after the resume
        assert float(fields["Floating-point operations"]) == pytest.approx(per_save * it / 2,
                                                                            rel=1e-2), (it, fields)
        assert fields["Tokens (in billions)"] == f"{it * GLOBAL * SEQ / 1e9:.2f}"
        for name in ("Job throughput", "Cumulative throughput"):
            value, unit = fields[name].split(" ")
            assert unit == "TFLOP/s/GPU" and float(value) >= 0


def test_log_progress_writes_megatrons_progress_file(retained):
    _check_progress_log(retained[2])


def test_log_progress_mutation_fails(tmp_path):
    """A resume that loses the checkpoint's FLOP count: the 12th iteration's line counts 2."""
    ckpt = str(tmp_path / "ckpt")
    save = EXACT + ["--train-iters", "12", "--save", ckpt, "--save-interval", "2",
                    "--save-retain-interval", "4", "--log-progress"]
    _train(run_pretrain, save + ["--exit-interval", "10"])
    _train(cases.train_resuming_without_flops, save + ["--load", ckpt])
    with pytest.raises(AssertionError):
        _check_progress_log(_progress(ckpt))


def test_progress_log_cumulative_start_follows_megatrons_reading(tmp_path):
    """The start of the jobs with this world size: the first 'Starting job' after the last change
    of world size, with the FLOPs of the last committed checkpoint before it (an async save counts
    once its 'Saved async checkpoint' line is there)."""
    from megatron_moe.training.progress_log import start_of_this_world_size

    def line(when, gpus, text):
        return f"2026-11-29 06:{when}:00\tJob ID: 7\t# GPUs: {gpus}\t{text}\n"

    def save(flops, kind="Saved checkpoint"):
        return (f"{kind}\tIteration: 1\tJob throughput: 1.0 TFLOP/s/GPU\tCumulative throughput: "
                f"1.0 TFLOP/s/GPU\tFloating-point operations: {flops:.2e}\tTokens (in billions): 0.00")

    (tmp_path / "progress.txt").write_text(
        line(10, 8, "Starting job") + line(11, 8, save(1e15)) + line(12, 4, "Starting job")
        + line(13, 4, save(2e15)) + line(14, 8, "Starting job")
        + line(15, 8, save(3e15, "Saving async checkpoint")) + line(16, 8, "Starting job")
        + line(17, 8, "Saved async checkpoint\tIteration: 1") + line(18, 8, "Starting job"))
    start, flops = start_of_this_world_size(str(tmp_path), 8)
    assert (start.minute, flops) == (14, 2e15)
    with pytest.raises(ValueError, match="no 'Starting job' line with # GPUs: 4"):
        start_of_this_world_size(str(tmp_path), 4)   # none since the last change of world size


@pytest.mark.parametrize("mutate", [None, "start-flops-dropped"])
def test_progress_log_throughputs(tmp_path, monkeypatch, mutate):
    """A save's line from known times and FLOPs (one process: 1 GPU): this job 100 s and 2e16
    FLOPs (200.0 TFLOP/s/GPU); the jobs of this world size 600 s since the first of them started,
    after a checkpoint of 5e14 FLOPs: (2.1e16 - 5e14) / 600 s = 34.2 TFLOP/s/GPU. The mutation
    forgets the FLOPs done before that first job started (35.0)."""
    import datetime as dt
    import types

    from megatron_moe.training import progress_log as P

    (tmp_path / "progress.txt").write_text(
        "2026-11-29 05:50:00\tJob ID: \t# GPUs: 1\tStarting job\n"
        "2026-11-29 05:55:00\tJob ID: \t# GPUs: 1\tSaved checkpoint\tIteration: 5\tJob throughput: "
        "1.0 TFLOP/s/GPU\tCumulative throughput: 1.0 TFLOP/s/GPU\tFloating-point operations: "
        "5.00e+14\tTokens (in billions): 0.00\n"
        "2026-11-29 05:58:00\tJob ID: \t# GPUs: 4\tStarting job\n"
        "2026-11-29 06:00:00\tJob ID: \t# GPUs: 1\tStarting job\n")

    class Clock(dt.datetime):
        @classmethod
        def now(cls, tz=None):
            return cls(2026, 11, 29, 6, 10, 0)

    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    monkeypatch.setattr(P, "datetime", Clock)
    monkeypatch.setattr(P, "time", types.SimpleNamespace(time=lambda: 1100.0))
    if mutate:
        real = P.start_of_this_world_size
        monkeypatch.setattr(P, "start_of_this_world_size", lambda *a: (real(*a)[0], 0.0))
    args = types.SimpleNamespace(save=str(tmp_path), world_size=1, seq_length=4096,
                                 consumed_train_samples=500_000, async_save=False)
    P.ProgressLog(args, job_start_s=1000.0, flops_at_job_start=1e15).checkpoint_saved(7, 2.1e16)
    last = (tmp_path / "progress.txt").read_text().splitlines()[-1]
    expected = ("2026-11-29 06:10:00\tJob ID: \t# GPUs: 1\tSaved checkpoint\tIteration: 7\t"
                "Job throughput: 200.0 TFLOP/s/GPU\tCumulative throughput: 34.2 TFLOP/s/GPU\t"
                "Floating-point operations: 2.10e+16\tTokens (in billions): 2.05")
    if mutate:
        assert last != expected and "Cumulative throughput: 35.0 TFLOP/s/GPU" in last, last
    else:
        assert last == expected, last


# --- --disable-gloo-process-groups ---------------------------------------------------------------
def _check_no_gloo_groups(tmp_path, mutate=None):
    ckpt = str(tmp_path / "ckpt")
    argv = ["--use-distributed-optimizer", "--save", ckpt, "--train-iters", "3"]
    first, gloo = _train(cases.train_without_gloo_groups, argv + ["--exit-interval", "2"],
                         world=2, mutate=mutate)
    assert gloo == 0
    second, gloo = _train(cases.train_without_gloo_groups, argv + ["--load", ckpt], world=2,
                          mutate=mutate)
    assert gloo == 0 and second["iteration"] == [3]


def test_without_gloo_process_groups_trains_saves_and_resumes(tmp_path):
    _check_no_gloo_groups(tmp_path)


@pytest.mark.parametrize("mutate", ["groups-created", "optimizer-not-told"])
def test_without_gloo_process_groups_mutation_fails(tmp_path, mutate):
    with pytest.raises((AssertionError, DistributedRunError)):
        _check_no_gloo_groups(tmp_path, mutate)


def test_gloo_groups_are_created_by_default():
    """The count the test above reads does see megatron-core's Gloo groups when they are made."""
    _, gloo = _train(cases.train_without_gloo_groups, ["--train-iters", "1"], world=2,
                     mutate="groups-created")
    assert gloo > 0


# --- parse-time refusals --------------------------------------------------------------------------
# --- --manual-gc, --empty-unused-memory-level -------------------------------------------------
def _check_manual_gc(mutate=None):
    argv = EXACT + "--train-iters 4 --eval-interval 2 --eval-iters 1".split()
    gc_argv = argv + ["--manual-gc", "--manual-gc-interval", "3", "--empty-unused-memory-level", "2"]
    losses, events = _train(cases.train_counting_gc, gc_argv, mutate=mutate)
    steps = [e for e in events if e[0] in ("step", "eval")]
    # the collector off in every step and evaluation, on again after the run
    assert steps == [("step", False)] * 2 + [("eval", False)] + [("step", False)] * 2 + \
        [("eval", False)] * 3, events    # evaluations at 2 and 4, then validation and test
    assert events[-1] == ("end", True), events
    # one full collection at the start, after iteration 3, before each evaluation; a
    # young-generation one after each evaluation (torch's own compile-time collections aside)
    collects = [e[1] for e in events if e[0] == "collect" and "megatron_moe" in e[2]]
    assert collects == [2] + [2, 0] + [2] + [2, 0] * 3, events
    # the allocator's cache emptied after each of the 4 forward-backwards and optimizer steps and
    # each of the 4 evaluation steps (2 during training, validation and test after it)
    assert events.count(("empty_cache",)) == 12, events
    # without the flags: no collection of ours, no emptying, the same losses
    plain, plain_events = _train(cases.train_counting_gc, argv + ["--manual-gc-interval", "3"])
    assert not [e for e in plain_events if e[0] == "collect" and "megatron_moe" in e[2]]
    assert ("empty_cache",) not in plain_events, plain_events
    assert losses == plain and len(set(losses)) == 4, (losses, plain)


def test_manual_gc_and_empty_cache_on_megatrons_schedule():
    _check_manual_gc()


def test_manual_gc_turns_the_collector_back_on_when_training_raises():
    error, enabled = _train(cases.train_failing_with_manual_gc,
                            EXACT + ["--train-iters", "3", "--manual-gc"])
    assert error == "step 2 failed" and enabled, (error, enabled)


@pytest.mark.parametrize("mutate", ["hooks-dropped", "empty-cache-ignored"])
def test_manual_gc_and_empty_cache_mutation_fails(mutate):
    with pytest.raises(AssertionError):
        _check_manual_gc(mutate)


@pytest.mark.parametrize("flags, message", [
    ("--manual-gc --manual-gc-interval -1", "must be 0 or more"),
    ("--disable-gloo-process-groups", "--disable-gloo-process-groups needs --distributed-backend "
                                      "nccl"),
    ("--save /tmp/x --save-interval 2 --save-retain-interval 3",
     "--save-retain-interval 3 must be a positive multiple of --save-interval 2"),
    ("--save /tmp/x --save-interval 2 --save-retain-interval 0",
     "--save-retain-interval 0 must be a positive multiple"),
    ("--reset-attention-mask --no-create-attention-mask-in-dataloader",
     "--reset-attention-mask edits the dataloader's attention mask"),
])
def test_refused_at_parse_time_in_one_line(flags, message, capsys):
    import torch

    from megatron_moe.arguments import parse_args

    if torch.cuda.is_available() and "gloo" in flags:
        pytest.skip("a CUDA machine runs NCCL")
    with pytest.raises(SystemExit):
        parse_args(TINY + ["--train-iters", "4"] + flags.split(), world_size=1)
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 2, err
