"""Checkpoint integrity: per-file checksums written at save, verified at load and by
tools/checkpoint_info.py --verify; a model of another configuration is named by its flags.

One 2-rank training run saves iterations 1 and 2; copies of that save directory are then damaged
(4 KB of random bytes written into a shard, a shard truncated, the previous iteration damaged
too, the manifests removed as in a checkpoint written before this change) and each copy is
resumed. Every run is the real pretrain(); errors are the one line it prints."""

import functools
import json
import os
import random
import shutil

from megatron_moe.runtime.local_ranks import run_distributed, run_script
from megatron_moe.training.checkpoint_manifest import MANIFEST
from tests._ckpt_cases import ROOT, TINY, run_pretrain_steps

BASE = TINY + ["--expert-model-parallel-size", "2"]


def _it(root, it):
    return os.path.join(root, f"iter_{it:07d}")


def _largest_shard(directory):
    shards = [n for n in os.listdir(directory) if n.endswith(".distcp")]
    return max(shards, key=lambda n: os.path.getsize(os.path.join(directory, n)))


def _copy(src, dst):
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(src, dst)


def _random_bytes(src, dst, iterations=(2,)):
    """4 KB of random bytes over the middle of the largest model tensor's bytes in its shard file
    (torch DCP's .metadata says where), the file size unchanged."""
    from torch.distributed.checkpoint import FileSystemReader

    _copy(src, dst)
    rng = random.Random(0)
    for it in iterations:
        storage = FileSystemReader(_it(dst, it)).read_metadata().storage_data
        index, where = max(((i, s) for i, s in storage.items() if not i.fqn.startswith("optim")),
                           key=lambda item: item[1].length)
        assert where.length >= 8192, (index.fqn, where.length)
        with open(os.path.join(_it(dst, it), where.relative_path), "r+b") as f:
            f.seek(where.offset + where.length // 2 - 2048)
            f.write(bytes(rng.getrandbits(8) for _ in range(4096)))


def _truncate(src, dst):
    _copy(src, dst)
    path = os.path.join(_it(dst, 2), _largest_shard(_it(dst, 2)))
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


def _no_manifest(src, dst):
    _copy(src, dst)
    for it in (1, 2):
        os.remove(os.path.join(_it(dst, it), MANIFEST))


def _old_truncated(src, dst):
    """A checkpoint saved before checksums, with a truncated shard."""
    _no_manifest(src, dst)
    path = os.path.join(_it(dst, 2), _largest_shard(_it(dst, 2)))
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


def _skip_verification():
    """Mutation: load without checking the checksums (what every load did before)."""
    from megatron_moe.training import checkpointing

    real = checkpointing.verify_checkpoint
    checkpointing.verify_checkpoint = lambda ckpt: []
    return lambda: setattr(checkpointing, "verify_checkpoint", real)


def _skip_config_check():
    """Mutation: no shape comparison before megatron-core's load."""
    from megatron_moe.training import checkpointing

    real = checkpointing._model_mismatch
    checkpointing._model_mismatch = lambda *a: None
    return lambda: setattr(checkpointing, "_model_mismatch", real)


def _error(run):
    lines = [line for line in run["text"].splitlines() if line.startswith("error:")]
    assert run["exit"] == 1 and len(lines) == 1, run["text"][-3000:]
    return lines[0]


def test_damaged_shards_and_config_mismatch(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    copies = {name: str(tmp_path / name) for name in
              ("random", "random_both", "truncated", "old", "old_truncated")}
    resume = lambda load, *extra: BASE + ["--train-iters", "3", "--load", load,
                                         "--override-opt_param-scheduler", *extra]
    steps = [
        dict(argv=BASE + ["--train-iters", "2", "--save", ckpt, "--save-interval", "1"]),
        dict(argv=resume(copies["random"]),
             prepare=functools.partial(_random_bytes, ckpt, copies["random"])),
        dict(argv=resume(copies["random"]), mutate=_skip_verification),
        dict(argv=resume(copies["random_both"]),
             prepare=functools.partial(_random_bytes, ckpt, copies["random_both"], (1, 2))),
        dict(argv=resume(copies["truncated"]),
             prepare=functools.partial(_truncate, ckpt, copies["truncated"])),
        dict(argv=resume(ckpt, "--hidden-size", "64")),
        dict(argv=resume(ckpt, "--hidden-size", "64"), mutate=_skip_config_check),
        dict(argv=resume(copies["old"]), prepare=functools.partial(_no_manifest, ckpt, copies["old"])),
        dict(argv=resume(copies["old_truncated"]),
             prepare=functools.partial(_old_truncated, ckpt, copies["old_truncated"])),
    ]
    out = run_distributed(run_pretrain_steps, 2, steps, timeout_s=900)[0]
    saved, random_, unverified, both, truncated, hidden, hidden_mut, old, old_truncated = out

    # the manifest: every file of the iteration directory, beside Megatron's layout
    assert saved["exit"] == 0
    for it in (1, 2):
        files = set(os.listdir(_it(ckpt, it)))
        data = json.load(open(os.path.join(_it(ckpt, it), MANIFEST)))
        assert set(data["files"]) == files - {MANIFEST} and data["iteration"] == it
        assert {"metadata.json", ".metadata"} <= files and any(f.endswith(".distcp") for f in files)
    assert open(os.path.join(ckpt, "latest_checkpointed_iteration.txt")).read() == "2"

    # 4 KB of random bytes in a shard: the file named, the previous iteration offered (verified)
    line = _error(random_)
    damaged = [n for n in os.listdir(_it(ckpt, 2)) if n.endswith(".distcp")
               and f"{_it(copies['random'], 2)}/{n}: checksum mismatch" in line]
    assert len(damaged) == 1, line
    assert f"{_it(copies['random'], 1)} verifies: resume from it with --ckpt-step 1" in line
    # mutation: without verification the damaged checkpoint loads silently
    assert "successfully loaded checkpoint" in unverified["text"], unverified["text"][-3000:]
    assert "checksum mismatch" not in unverified["text"]   # (it then stopped on a NaN loss here)

    # the previous iteration damaged too: nothing offered
    line = _error(both)
    assert "checksum mismatch" in line and "no earlier checkpoint under" in line, line

    # a truncated shard: the file named, with its sizes
    shard = _largest_shard(_it(ckpt, 2))
    line = _error(truncated)
    assert f"{_it(copies['truncated'], 2)}/{shard}: truncated:" in line, line
    assert "--ckpt-step 1" in line

    # another hidden size: the flag and both values, never "corrupt"
    line = _error(hidden)
    assert "--hidden-size 32 in the checkpoint, 64 on this command line" in line, line
    assert "corrupt" not in line and "checksum mismatch" not in line
    # mutation: without the comparison megatron-core's shape error is all there is
    assert "--hidden-size" not in _error(hidden_mut)

    # a checkpoint written before checksums loads, saying so once
    assert old["exit"] == 0, old["text"][-3000:]
    notes = [l for l in old["text"].splitlines() if f"has no {MANIFEST}" in l]
    assert len(notes) == 1 and "successfully loaded checkpoint" in old["text"]

    # ... and one with a truncated shard names the file from torch DCP's metadata
    line = _error(old_truncated)
    assert f"{_it(copies['old_truncated'], 2)}/{shard}: truncated:" in line, line
    assert "--ckpt-step 1" in line and "corrupt or incomplete" in line

    # tools/checkpoint_info.py --verify reads every file
    tool = os.path.join(ROOT, "tools", "checkpoint_info.py")
    # (as __main__ in a process forked from the fork server: torch already imported)
    run = lambda *a: run_script(tool, [*a, "--no-tensors", "--no-args"], timeout_s=120,
                                env=dict(os.environ, OMP_NUM_THREADS="1"))
    good = run(ckpt, "--verify")
    assert good.returncode == 0 and "checksums:  verified" in good.stdout, good.stdout
    bad = run(copies["random"], "--verify")
    assert bad.returncode == 1 and f"{damaged[0]}: checksum mismatch" in bad.stdout, bad.stdout
    unchecked = run(copies["random"])      # without --verify only sizes are compared
    assert unchecked.returncode == 0
    assert "not verified" in run(copies["old"], "--verify").stdout
