"""A full disk at a save: the free-space check before writing, and ENOSPC while the shards are
written (synchronous and --async-save). Faults are injected here: shutil.disk_usage reports a
nearly full disk, or megatron-core's shard writer fails with ENOSPC after writing a few bytes
(in the forked writer processes, as a real full disk would). Each time: one line naming the path,
the bytes needed and free; the partial iter_*.tmp removed; the previous checkpoint kept, named,
and resumable."""

import errno
import functools
import os

from megatron_moe.runtime.local_ranks import run_distributed
from megatron_moe.training.checkpoint_manifest import total_bytes, verify_directory
from tests._ckpt_cases import TINY, run_pretrain_steps

BASE = TINY + ["--expert-model-parallel-size", "2", "--train-iters", "3", "--save-interval", "1"]


def _it(root, it, suffix=""):
    return os.path.join(root, f"iter_{it:07d}{suffix}")


def _tracker(root):
    return int(open(os.path.join(root, "latest_checkpointed_iteration.txt")).read())


def _nearly_full_disk(root):
    """shutil.disk_usage says 1000 bytes are free once iteration 1 is saved under ``root``."""
    import shutil

    real = shutil.disk_usage

    def usage(path):
        out = real(path)
        if os.path.isdir(_it(root, 1)):
            return out._replace(free=1000)
        return out

    shutil.disk_usage = usage
    return lambda: setattr(shutil, "disk_usage", real)


def _enospc_in_writer(fired, iteration=2):
    """Rank 1's shard files of ``iteration`` fail with ENOSPC after 100 bytes (megatron-core's
    writer workers are forked from the rank, so they inherit this); from then on
    shutil.disk_usage says 1000 bytes are free, as on a disk another job filled (``fired``: a
    file the fault creates, so that every process sees it; one per run)."""
    import shutil

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    real, real_usage = filesystem_async._write_item, shutil.disk_usage

    @functools.wraps(real)   # megatron-core inspects its signature
    def write_item(*args, **kwargs):
        stream = next(a for a in args if hasattr(a, "write") and hasattr(a, "name"))
        name = str(stream.name)
        if f"iter_{iteration:07d}.tmp" in name and os.path.basename(name).startswith("__1_"):
            stream.write(b"\0" * 100)
            open(fired, "w").close()
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(*args, **kwargs)

    def usage(path):
        out = real_usage(path)
        return out._replace(free=1000) if os.path.exists(fired) else out

    filesystem_async._write_item, shutil.disk_usage = write_item, usage

    def undo():   # ``fired`` stays: another rank may still be reporting this run's failure
        filesystem_async._write_item, shutil.disk_usage = real, real_usage
    return undo


def _enospc_unhandled(fired):
    """Mutation: the fault as above, and a failed save is not handled (the error as raised)."""
    from megatron_moe.training import checkpointing

    undo = _enospc_in_writer(fired)
    real = checkpointing._save_failed

    def reraise(exc, *a):
        raise exc

    checkpointing._save_failed = reraise

    def restore():
        undo()
        checkpointing._save_failed = real
    return restore


def _error(run):
    lines = [line for line in run["text"].splitlines() if line.startswith("error:")]
    assert run["exit"] == 1 and len(lines) == 1, (run["exit"], run["text"][-3000:])
    return lines[0]


def test_disk_full_at_save(tmp_path):
    roots = {name: str(tmp_path / name) for name in ("check", "sync", "unhandled", "async")}
    enospc = lambda name: functools.partial(_enospc_in_writer, str(tmp_path / f"{name}-fired"))
    steps = [
        dict(argv=BASE + ["--save", roots["check"]],
             mutate=functools.partial(_nearly_full_disk, roots["check"])),
        dict(argv=BASE + ["--save", roots["sync"]], mutate=enospc("sync")),
        dict(argv=BASE + ["--save", roots["unhandled"]],
             mutate=functools.partial(_enospc_unhandled, str(tmp_path / "unhandled-fired"))),
        dict(argv=BASE + ["--save", roots["async"], "--async-save"], mutate=enospc("async")),
        # the kept checkpoint resumes
        dict(argv=BASE + ["--load", roots["sync"]]),
    ]
    check, sync, unhandled, async_, resumed = run_distributed(run_pretrain_steps, 2, steps,
                                                              timeout_s=900)[0]

    # the check before writing: nothing of iteration 2 written
    line = _error(check)
    needed = total_bytes(_it(roots["check"], 1))
    assert f"{_it(roots['check'], 2, '.tmp')}: not enough disk space" in line, line
    assert f"it needs about {needed} bytes" in line and "1000 bytes are free" in line
    assert f"the last checkpoint, {_it(roots['check'], 1)} (iteration 1), is kept" in line

    # ENOSPC in the writer, synchronous and --async-save (raised at the finalisation)
    for root, run in ((roots["sync"], sync), (roots["async"], async_)):
        line = _error(run)
        assert f"{_it(root, 2, '.tmp')}: no space left on device: it needs about " \
               f"{total_bytes(_it(root, 1))} bytes" in line, line
        assert "1000 bytes are free once the partial save is removed" in line
        assert "removed iter_0000002.tmp" in line
        assert f"the last checkpoint, {_it(root, 1)} (iteration 1), is kept" in line

    for root in (roots["check"], roots["sync"], roots["async"]):
        assert sorted(os.listdir(root)) == ["iter_0000001", "latest_checkpointed_iteration.txt"]
        assert _tracker(root) == 1 and verify_directory(_it(root, 1)) == []

    # mutation: unhandled, the partial .tmp stays and the error names no path or sizes
    assert str(unhandled["exit"]).startswith("raised"), unhandled
    assert os.path.isdir(_it(roots["unhandled"], 2, ".tmp"))
    assert "No space left" not in unhandled["exit"] or "bytes" not in unhandled["exit"]

    assert resumed["exit"] == 0, resumed["text"][-3000:]
    assert "successfully loaded checkpoint" in resumed["text"] and " at iteration 1" in \
        resumed["text"]
