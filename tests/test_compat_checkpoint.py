"""A checkpoint written under the oldest supported megatron-core loads and resumes under the newest.

The two releases need two venvs (Python 3.11 resolves megatron-core 0.16.1, Python 3.12 the newest
0.19.x), so both runs are subprocesses: the old venv's interpreter trains and saves, the new one
loads and continues. Interpreters are found as ``.venv*/bin/python`` in the repository (what
scripts/setup_env.sh builds; CI's two legs make .venv and .venv312), plus the running one, plus
``MEGATRON_MOE_PYTHONS`` (os.pathsep-separated). With only one megatron-core release among them the
test skips, or fails when ``MEGATRON_MOE_REQUIRE_CROSS_VERSION=1`` (CI's 3.12 leg).
"""

import glob
import json
import os
import subprocess
import sys

import pytest
from packaging.version import Version

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A tiny GPT-MoE with expert parallel 2: expert-sharded weights and the two chained optimizers'
# (dense, expert) Adam state cross the version boundary. No dropout: nothing depends on how a
# release draws random numbers after the load. (--use-distributed-optimizer is left out: its
# resume on each release is tests/test_distrib_optimizer.py; across releases it is not tested.)
ARGS = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32 "
        "--micro-batch-size 2 --global-batch-size 8 --lr 3e-3 --mock-data "
        "--tokenizer-type NullTokenizer --vocab-size 256 --num-experts 4 --moe-router-topk 2 "
        "--moe-token-dispatcher-type alltoall --moe-aux-loss-coeff 0.01 --log-interval 1 "
        "--eval-interval 1000 --eval-iters 1 --disable-bias-linear --hidden-dropout 0 "
        "--attention-dropout 0 --expert-model-parallel-size 2 "
        "--ckpt-format torch_dist --train-iters 6").split()


def _interpreters():
    found = [sys.executable] + sorted(glob.glob(os.path.join(ROOT, ".venv*", "bin", "python")))
    found += [p for p in os.environ.get("MEGATRON_MOE_PYTHONS", "").split(os.pathsep) if p]
    versions = {}
    for python in dict.fromkeys(os.path.abspath(p) for p in found):  # not realpath: a venv's python is a link
        out = subprocess.run([python, "-c", "import megatron.core as m; print(m.__version__)"],
                             capture_output=True, text=True, timeout=180)
        if out.returncode == 0:
            # 0.19 appends the git hash of a repository around site-packages: release only
            versions.setdefault(Version(Version(out.stdout.strip().splitlines()[-1]).public), python)
    return versions


def _train(python, argv):
    out = subprocess.run([python, os.path.join(ROOT, "tests", "_xver_train.py"), json.dumps(argv)],
                         capture_output=True, text=True, timeout=420,
                         env=dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1"))
    assert out.returncode == 0, f"{python}:\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}"
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_checkpoint_from_oldest_release_resumes_on_newest(tmp_path):
    versions = _interpreters()
    if len(versions) < 2:
        reason = (f"needs venvs with two megatron-core releases, found {sorted(map(str, versions))}: "
                  "build the other with scripts/setup_env.sh (e.g. PYTHON=python3.12 VENV=.venv312)")
        if os.environ.get("MEGATRON_MOE_REQUIRE_CROSS_VERSION") == "1":
            pytest.fail(reason)
        pytest.skip(reason)
    old, new = min(versions), max(versions)
    ckpt = str(tmp_path / "ckpt")
    # old release: 6 iterations, saving after 3 and 6
    full = _train(versions[old], ARGS + ["--save", ckpt, "--save-interval", "3"])
    assert Version(Version(full["megatron_core"]).public) == old
    # Megatron's tracker file names the iteration --load takes: resume from 3
    with open(os.path.join(ckpt, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("3")
    resumed = _train(versions[new], ARGS + ["--load", ckpt])
    assert Version(Version(resumed["megatron_core"]).public) == new
    ref, got = full["history"], resumed["history"]
    assert got["iteration"] == [4, 5, 6]  # the checkpoint's iteration and scheduler state were read
    assert got["lr"] == ref["lr"][3:]
    # iteration 4 runs on the loaded weights, 5 and 6 also on the loaded Adam moments: a release
    # that dropped either would drift from the old release's own continuation
    assert got["lm_loss"] == pytest.approx(ref["lm_loss"][3:], rel=1e-4)
    assert got["grad_norm"] == pytest.approx(ref["grad_norm"][3:], rel=1e-3)
