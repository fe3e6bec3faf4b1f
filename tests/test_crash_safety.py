"""Crash safety with real kills: kill -9 of the whole job (launcher and workers) mid-save.

The job saves every iteration; MEGATRON_MOE_TEST_SAVE_DELAY makes each save slow at three
places (between shard files, before the rename, between rename and tracker), so the polling
below can kill the job at a chosen moment. After each kill, the same command (--load = --save)
resumes from the last complete checkpoint the tracker names and training goes on; a half-written
``iter_*.tmp`` is never loaded. Losses printed for the same iteration by different launches agree.
"""

import os
import re

from megatron_moe.training.checkpointing import TEST_SAVE_DELAY_ENV
from megatron_moe.runtime.local_ranks import run_distributed
from tests._ckpt_cases import TINY, kill_group, log_text, start_torchrun, wait_for

ARGS = TINY + ("--expert-model-parallel-size 2 --train-iters 1000 --lr-decay-style constant "
               "--save-interval 1").split()
ENV = {TEST_SAVE_DELAY_ENV: "0.7"}


def _tracker(ckpt):
    path = os.path.join(ckpt, "latest_checkpointed_iteration.txt")
    return int(open(path).read()) if os.path.exists(path) else None


def _files(path):
    return set(os.listdir(path)) if os.path.isdir(path) else set()


def _dir(ckpt, it, suffix=""):
    return os.path.join(ckpt, f"iter_{it:07d}{suffix}")


def _losses(text):
    return {int(i): l for i, l in re.findall(r" iteration +(\d+)/ *\d+ \|.*?\| lm loss: (\S+) \|", text)}


def _launch(tmp_path, n, ckpt, extra=()):
    log = str(tmp_path / f"launch{n}.log")
    return start_torchrun(2, ARGS + ["--save", ckpt, "--load", ckpt, *extra], env=ENV,
                          log_path=log), log


def _kill_when(job, predicate, what):
    try:
        wait_for(predicate, 240, job, what)
    finally:
        kill_group(job)


def test_kill9_at_many_moments_resumes_from_last_complete_checkpoint(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    logs = []

    # 1. mid-write of shards: iteration 2's .tmp holds some shard files, no global metadata yet
    job, log = _launch(tmp_path, 1, ckpt)
    logs.append(log)
    _kill_when(job, lambda: _tracker(ckpt) == 1 and any(
        f.endswith(".distcp") for f in _files(_dir(ckpt, 2, ".tmp")))
        and ".metadata" not in _files(_dir(ckpt, 2, ".tmp")), "a half-written iter_0000002.tmp")
    assert _tracker(ckpt) == 1 and not os.path.exists(_dir(ckpt, 2))

    # 2. resumed from 1 (the half-written 2 is ignored); killed after 2's rename, before the
    #    tracker moved: the tracker still names 1
    job, log = _launch(tmp_path, 2, ckpt)
    logs.append(log)
    _kill_when(job, lambda: "at iteration 1" in log_text(log) and os.path.isdir(_dir(ckpt, 2))
               and _tracker(ckpt) == 1, "iter_0000002 renamed, tracker not yet moved")
    assert "successfully loaded checkpoint from" in log_text(log)

    # 3. resumed from 1 again; 2 re-saved over the complete-but-untracked one; killed with 3's
    #    shards and metadata complete but not renamed
    job, log = _launch(tmp_path, 3, ckpt)
    logs.append(log)
    _kill_when(job, lambda: _tracker(ckpt) == 2 and {".metadata", "metadata.json"}
               <= _files(_dir(ckpt, 3, ".tmp")), "a complete, not yet renamed iter_0000003.tmp")
    assert re.search(r"successfully loaded checkpoint from \S+ at iteration 1\b", log_text(log))
    assert _tracker(ckpt) == 2 and not os.path.exists(_dir(ckpt, 3))

    # 4. resumed from 2, runs to its exit interval and exits cleanly
    job, log = _launch(tmp_path, 4, ckpt, ["--exit-interval", "4"])
    logs.append(log)
    try:
        rc = job.wait(timeout=240)
    finally:
        kill_group(job)
    text = log_text(log)
    assert rc == 0, text[-3000:]
    assert re.search(r"successfully loaded checkpoint from \S+ at iteration 2\b", text)
    assert _tracker(ckpt) == 4 and not os.path.exists(_dir(ckpt, 3, ".tmp"))
    assert sorted(_losses(text)) == [3, 4]

    # the same iteration printed the same loss in every launch that ran it
    seen = {}
    for path in logs:
        for it, loss in _losses(log_text(path)).items():
            assert seen.setdefault(it, loss) == loss, (it, seen[it], loss)
    assert set(seen) >= {1, 2, 3, 4}


def _async_then_resume(rank, world_size, argv_async, argv_resume):
    """An --async-save run, then (same processes) a resume from its iteration-2 checkpoint."""
    from megatron_moe.training import checkpointing
    from tests._ckpt_cases import run_pretrain_sequence

    scheduled = []
    real = checkpointing.finalize_async_save

    def counting(blocking=False):
        done = real(blocking=blocking)
        scheduled.extend(done)
        return done

    checkpointing.finalize_async_save = counting
    try:
        first = run_pretrain_sequence(rank, world_size, [argv_async])[0]
    finally:
        checkpointing.finalize_async_save = real
    queue_used = checkpointing._async_queue is not None
    second = run_pretrain_sequence(rank, world_size, [argv_resume])[0]
    return first, second, queue_used, len(scheduled)


def test_async_save_checkpoints_are_complete_and_resume_exactly(tmp_path):
    """--async-save: shards written in the background (megatron-core's AsyncCallsQueue), the
    rename and tracker as its finalisation. Iteration 2's checkpoint is written while iteration 3
    trains, yet holds iteration 2's state: resuming from it reproduces iteration 3 bit for bit."""
    from tools.checkpoint_info import inspect

    ckpt = str(tmp_path / "ckpt")
    args = TINY + ["--expert-model-parallel-size", "2", "--train-iters", "3"]
    out = run_distributed(_async_then_resume, 2,
                          args + ["--save", ckpt, "--save-interval", "1", "--async-save"],
                          args + ["--load", ckpt, "--ckpt-step", "2"], timeout_s=400)
    first, second, queue_used, finalized = out[0]
    assert queue_used and finalized == 3          # three async requests, each finalised
    assert _tracker(ckpt) == 3
    for it in (1, 2, 3):
        assert inspect(_dir(ckpt, it))["complete"]
        assert not os.path.exists(_dir(ckpt, it, ".tmp"))
    assert second["iteration"] == [3]
    assert second["lm_loss"] == first["lm_loss"][2:]
