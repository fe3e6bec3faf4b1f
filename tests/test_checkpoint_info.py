"""tools/checkpoint_info.py on a real 2-rank checkpoint, then on damaged copies of it."""

import json
import os
import shutil

from megatron_moe.runtime.local_ranks import run_distributed, run_script
from tests._ckpt_cases import ROOT, TINY, run_pretrain_capture

TOOL = os.path.join(ROOT, "tools", "checkpoint_info.py")


def info(*args):
    # the script as __main__ in a process forked from the fork server (torch already imported)
    out = run_script(TOOL, list(args), env=dict(os.environ, OMP_NUM_THREADS="1"), timeout_s=120)
    return out.returncode, out.stdout, out.stderr


def test_checkpoint_info(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    run_distributed(run_pretrain_capture, 2, TINY + [
        "--expert-model-parallel-size", "2", "--train-iters", "1", "--save", ckpt], timeout_s=300)

    rc, out, err = info(ckpt)
    assert rc == 0, err
    assert "iteration:  1" in out and "complete:   yes" in out
    assert "layout:     TP=1 PP=1 EP=2 ETP=1 CP=1 DP=2 WORLD=2" in out
    assert "  num_experts = 4" in out and "  expert_model_parallel_size = 2" in out
    rc, out, _ = info(ckpt, "--json")
    data = json.loads(out)
    tensors = {t["name"]: t for t in data["tensors"]}
    # global shapes from the metadata; megatron-core stores one chunk per (layer, expert)
    fc1 = tensors["decoder.layers.mlp.experts.experts.linear_fc1.weight"]
    assert fc1["shape"] == [2, 4, 128, 32] and fc1["dtype"] == "float32" and fc1["shards"] == 8
    assert tensors["embedding.word_embeddings.weight"]["shape"] == [256 + 128, 32]  # padded vocab
    assert "optimizer.state.exp_avg_sq.decoder.layers.mlp.router.weight" in tensors
    assert data["iteration"] == 1 and data["consumed_train_samples"] == 8 and data["complete"]

    it_dir = os.path.join(ckpt, "iter_0000001")
    # a truncated shard: incomplete, the file named, exit status 1
    bad = str(tmp_path / "bad")
    shutil.copytree(it_dir, bad)
    shard = sorted(n for n in os.listdir(bad) if n.endswith(".distcp"))[-1]
    with open(os.path.join(bad, shard), "r+b") as f:
        f.truncate(16)
    rc, out, _ = info(bad, "--no-tensors", "--no-args")
    assert rc == 1 and f"shard file {shard} is truncated" in out
    # a save that never finished: no global metadata, a .tmp name
    tmp = str(tmp_path / "iter_0000002.tmp")
    shutil.copytree(it_dir, tmp)
    os.remove(os.path.join(tmp, ".metadata"))
    rc, out, _ = info(tmp, "--no-tensors", "--no-args")
    assert rc == 1 and ".metadata missing" in out and "never finished" in out
