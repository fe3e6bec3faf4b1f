"""--step-batch-size-schedule (Megatron-LM's flag, megatron-core >= 0.19's step-schedule
calculator): each iteration runs the global batch the schedule gives for the tokens consumed
before it (micro-batches run, consumed samples, the log line); a run stopped between two steps
resumes with the same batches and losses; bad combinations are one line at parse time. Each case
has a mutation (installed in the ranks, tests/_rampup_cases.py) that makes it fail.
"""

import re

import pytest

from megatron_moe.compat.versions import mcore_at_least
from megatron_moe.runtime.local_ranks import run_distributed
from tests._rampup_cases import run_recorded

TINY = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32 "
        "--micro-batch-size 2 --lr 3e-3 --mock-data --tokenizer-type NullTokenizer "
        "--vocab-size 256 --num-experts 4 --moe-router-topk 2 --moe-token-dispatcher-type alltoall "
        "--moe-aux-loss-coeff 0.01 --log-interval 1 --eval-interval 1000 --eval-iters 1 "
        "--disable-bias-linear").split()
SEQ = 32
# thresholds in tokens (Megatron-LM passes --seq-length): batch 2, then 4 from 8 samples
# (256 tokens), 8 from 16 samples (0.5K = 500 tokens -> 15 samples)
SCHEDULE = "0:2 256:4 0.5K:8"
RUN = ["--step-batch-size-schedule", SCHEDULE, "--train-samples", "40"]

needs_019 = pytest.mark.skipif(not mcore_at_least("0.19"),
                               reason="megatron-core 0.16 has no step-schedule calculator")


def megatron_step_batches(train_samples):
    """(consumed before, batch) per iteration: the schedule read as Megatron-LM documents it
    (the last entry whose token threshold // seq-length <= consumed samples), iterations until
    the consumed samples reach --train-samples (its update_train_iters)."""
    entries = [(0, 2), (256 // SEQ, 4), (500 // SEQ, 8)]
    out, consumed = [], 0
    while consumed < train_samples:
        batch = [b for at, b in entries if consumed >= at][-1]
        out.append((consumed, batch))
        consumed += batch
    return out


def _losses(run):
    return [r["loss"]["lm loss"] for r in run["records"]]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    ckpt = str(tmp_path_factory.mktemp("stepbs") / "ckpt")
    ckpt_mutated = ckpt + "_mutated"
    argvs = [RUN, RUN + ["--save", ckpt, "--exit-interval", "5"], RUN + ["--load", ckpt],
             RUN, RUN + ["--save", ckpt_mutated, "--exit-interval", "5"],
             RUN + ["--load", ckpt_mutated]]
    mutations = [None, None, None, "no_step_schedule", None, "consumed_from_iteration"]
    out = run_distributed(run_recorded, 1, [TINY + a for a in argvs], mutations=mutations,
                          timeout_s=400)[0]
    return dict(zip(["full", "first", "resumed", "no_schedule", "first_m", "resumed_m"], out))


def _follows(run):
    got = [(r["consumed_before"], r["microbatches"] * 2) for r in run["records"]]
    logged = [int(v) for v in re.findall(r"global batch size: +(\d+)", run["text"])]
    seen = [int(v) for v in re.findall(r"consumed samples: +(\d+)", run["text"])]
    return got, got == megatron_step_batches(40) and logged == [b for _, b in got] and \
        seen == [c + b for c, b in got]


@needs_019
def test_batches_follow_the_schedule(runs):
    """Iteration by iteration: the micro-batches run (x micro-batch 2), the log line's global
    batch size and consumed samples are the schedule's; 9 iterations for 40 samples. Mutation:
    the calculator built without the schedule (a constant batch of 2)."""
    full = runs["full"]
    assert full["error"] is None, full["error"]
    got, ok = _follows(full)
    assert ok, (got, megatron_step_batches(40))
    assert len(got) == 9 and {b for _, b in got} == {2, 4, 8}
    mutated = runs["no_schedule"]
    assert mutated["error"] is None, mutated["error"]
    got, ok = _follows(mutated)
    assert not ok and {b for _, b in got} == {2}, got


@needs_019
def test_resume_continues_the_schedule(runs):
    """Stopped after 5 iterations (batch 4), resumed: the same batches, consumed samples and
    losses bit for bit as the uninterrupted run. Mutation: the resume counts consumed samples as
    iterations x --global-batch-size (the schedule then restarts at the wrong step)."""
    full, first, resumed = runs["full"], runs["first"], runs["resumed"]
    assert first["error"] is None and resumed["error"] is None, (first["error"], resumed["error"])
    assert [r["consumed_before"] for r in first["records"]] == [0, 2, 4, 6, 8]
    assert [r["consumed_before"] for r in first["records"] + resumed["records"]] == \
        [r["consumed_before"] for r in full["records"]]
    assert [r["microbatches"] for r in first["records"] + resumed["records"]] == \
        [r["microbatches"] for r in full["records"]]
    assert _losses(first) + _losses(resumed) == _losses(full)
    # mutation
    first_m, resumed_m = runs["first_m"], runs["resumed_m"]
    assert resumed_m["error"] is None, resumed_m["error"]
    assert resumed_m["records"][0]["consumed_before"] == 10 != full["records"][5]["consumed_before"]
    assert _losses(first_m) + _losses(resumed_m) != _losses(full)


def _parse_error(argv, capsys):
    from megatron_moe import arguments

    with pytest.raises(SystemExit) as exc:
        world = 2 if "--pipeline-model-parallel-size 2" in argv else 1
        arguments.parse_args(TINY + argv.split(), world_size=world)
    assert exc.value.code == 2
    return [l for l in capsys.readouterr().err.splitlines() if l.strip()]


@needs_019
@pytest.mark.parametrize("argv,says", [
    ("--global-batch-size 8", "--step-batch-size-schedule and --global-batch-size exclude"),
    ("--rampup-batch-size 2 2 12", "--step-batch-size-schedule and --rampup-batch-size exclude"),
    ("--decrease-batch-size-if-needed", "and --decrease-batch-size-if-needed exclude"),
    ("--step-batch-size-schedule 0:3", "batch 3 is not a multiple of --micro-batch-size"),
    ("--step-batch-size-schedule 0:2,x", 'Invalid schedule entry "x"'),
    ("--step-batch-size-schedule 64:2", "first schedule entry must have threshold 0"),
    ("--pipeline-model-parallel-size 2 --num-layers 4 --num-layers-per-virtual-pipeline-stage 1",
     "interleaved schedule"),
])
@pytest.mark.parametrize("mutate", [None, "no_checks"])
def test_refusals(argv, says, mutate, capsys, monkeypatch):
    """One line naming the flag at parse time. Mutation: the checks skipped (the launch parses,
    or fails some other way)."""
    from megatron_moe import arguments

    if mutate:
        monkeypatch.setattr(arguments, "_validate_step_batch_schedule", lambda args: None)
    full = f"--step-batch-size-schedule {SCHEDULE.replace(' ', ',')} --train-samples 40 {argv}"
    try:
        lines = _parse_error(full, capsys)
    except (AssertionError, pytest.fail.Exception):
        assert mutate
        return
    refused = len(lines) == 2 and "--step-batch-size-schedule" in lines[0] and says in lines[0]
    assert refused is (mutate is None), lines


@pytest.mark.skipif(mcore_at_least("0.19"), reason="refused on megatron-core 0.16 only")
def test_refused_on_megatron_core_016(capsys):
    lines = _parse_error("--step-batch-size-schedule 0:2 --train-samples 40", capsys)
    assert "--step-batch-size-schedule needs megatron-core >= 0.19" in lines[0] and \
        "0.16" in lines[0], lines
