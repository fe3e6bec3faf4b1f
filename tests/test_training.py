"""End-to-end training on gloo: parallel layouts, exact resume, resharding, bad input.

Each case runs the real ``pretrain()`` (or the real CLI under torchrun) on 2-4 CPU processes.
"""

import os
import shutil
import subprocess
import sys

import pytest

from megatron_moe.runtime.local_ranks import run_distributed
from tests._train_cases import run_pretrain

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TINY = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32 "
        "--micro-batch-size 2 --global-batch-size 8 --lr 3e-3 --mock-data "
        "--tokenizer-type NullTokenizer --vocab-size 256 --num-experts 4 --moe-router-topk 2 "
        "--moe-token-dispatcher-type alltoall --moe-aux-loss-coeff 0.01 --log-interval 1 "
        "--eval-interval 1000 --eval-iters 1 --disable-bias-linear").split()


def train(world, extra, **kw):
    return run_distributed(run_pretrain, world, TINY + extra.split(), timeout_s=300, **kw)


def assert_loss_falls(history):
    losses = history["lm_loss"]
    assert all(l == l for l in losses), losses  # no NaN
    assert losses[-1] < losses[0] - 0.05, losses


@pytest.mark.parametrize("world,layout", [
    (2, "--expert-model-parallel-size 2"),
    (2, "--tensor-model-parallel-size 2 --sequence-parallel"),
    (2, "--pipeline-model-parallel-size 2 --expert-model-parallel-size 1 --use-distributed-optimizer"),
    (4, "--tensor-model-parallel-size 2 --sequence-parallel --expert-model-parallel-size 2 "
        "--use-distributed-optimizer"),
], ids=["ep2", "tp2-sp", "pp2-distopt", "tp2xep2-distopt"])
def test_loss_falls(world, layout):
    histories = train(world, f"--train-iters 8 {layout}")
    assert_loss_falls(histories[0])
    # every rank logs the same, all-reduced loss
    assert all(h["lm_loss"] == histories[0]["lm_loss"] for h in histories)


def test_exact_resume(tmp_path):
    """train 6 == train 3, stop, resume, train 3: bit-identical losses (dropout on: RNG restored)."""
    ckpt = str(tmp_path / "ckpt")
    layout = "--expert-model-parallel-size 2 --train-iters 6"
    full = train(2, layout)[0]
    first = train(2, f"{layout} --save {ckpt} --exit-interval 3")[0]
    assert open(os.path.join(ckpt, "latest_checkpointed_iteration.txt")).read() == "3"
    assert os.path.isdir(os.path.join(ckpt, "iter_0000003"))
    second = train(2, f"{layout} --save {ckpt} --load {ckpt}")[0]
    assert second["iteration"][0] == 4
    assert first["lm_loss"] + second["lm_loss"] == full["lm_loss"]
    assert first["lr"] + second["lr"] == full["lr"]
    assert first["grad_norm"] + second["grad_norm"] == full["grad_norm"]


def test_resume_with_other_expert_parallel_size(tmp_path):
    """Saved at EP=2, resumed at EP=1 (megatron-core resharding): the same weights continue."""
    ckpt = str(tmp_path / "ckpt")
    common = "--train-iters 5 --hidden-dropout 0 --attention-dropout 0"
    full = train(2, f"{common} --expert-model-parallel-size 2")[0]
    train(2, f"{common} --expert-model-parallel-size 2 --save {ckpt} --exit-interval 3")
    resumed = train(2, f"{common} --expert-model-parallel-size 1 --load {ckpt}")[0]
    # iteration 4's forward uses the weights after step 3: identical up to summation order
    assert resumed["iteration"][0] == 4
    assert resumed["lm_loss"][0] == pytest.approx(full["lm_loss"][3], rel=1e-5)
    assert resumed["lr"] == full["lr"][3:]


# --- the CLI, under torchrun -------------------------------------------------------------------
def torchrun(nproc, args, timeout=240, env=None):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
           "--master_port", str(_port()), os.path.join(ROOT, "pretrain_gpt_moe.py"), *args]
    run_env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", **(env or {}))
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=run_env)


def cli(args, env=None, timeout=60):
    """pretrain_gpt_moe.py as __main__ in a fresh process (forked from run_script's preloaded
    server: the argument errors below cost no interpreter start-up)."""
    from megatron_moe.runtime.local_ranks import run_script

    run_env = dict(os.environ, PYTHONPATH=ROOT, **(env or {}))
    return run_script(os.path.join(ROOT, "pretrain_gpt_moe.py"), args, env=run_env,
                      timeout_s=timeout)


def _port():
    from megatron_moe.runtime.local_ranks import free_port

    return free_port()


def test_cli_log_line_and_corrupt_checkpoint(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    tb = str(tmp_path / "tb")
    args = TINY + ["--expert-model-parallel-size", "2", "--train-iters", "2", "--save", ckpt,
                   "--tensorboard-dir", tb]
    out = torchrun(2, args)
    assert out.returncode == 0, out.stderr[-3000:]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(tb)
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"lm loss", "learning-rate", "grad-norm", "load_balancing_loss",
            "moe/expert_load_max_over_mean_layer_1"} <= tags, tags
    assert [e.step for e in events.Scalars("lm loss")] == [1, 2]
    lines = [l for l in out.stdout.splitlines() if " iteration " in l and "consumed samples" in l]
    assert len(lines) == 2
    # Megatron-LM's exact field order and formats
    import re

    pattern = (r"^ \[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+\] iteration +2/ +2 \| consumed samples: +16 \| "
               r"elapsed time per iteration \(ms\): \d+\.\d \| learning rate: \d\.\d{6}E[+-]\d\d \| "
               r"global batch size: +8 \| lm loss: \d\.\d{6}E[+-]\d\d \| load_balancing_loss: "
               r"\d\.\d{6}E[+-]\d\d \| loss scale: 1\.0 \| grad norm: \d+\.\d{3} \| number of skipped "
               r"iterations: +0 \| number of nan iterations: +0 \| tokens per second: \d+\.\d \|$")
    assert re.match(pattern, lines[-1]), lines[-1]
    assert "[moe] layer   1 | expert load max/mean:" in out.stdout

    # corrupt every shard file of the checkpoint: a clear error, no traceback wall
    ckpt_dir = os.path.join(ckpt, "iter_0000002")
    for name in os.listdir(ckpt_dir):
        if name.endswith(".distcp"):
            with open(os.path.join(ckpt_dir, name), "r+b") as f:
                f.truncate(16)
    out = torchrun(2, TINY + ["--expert-model-parallel-size", "2", "--train-iters", "4",
                              "--load", ckpt])
    assert out.returncode != 0
    assert "error: --load:" in out.stdout and "iter_0000002" in out.stdout, out.stdout[-2000:]
    # the checksum manifest names a damaged file and what the save wrote (docs/checkpoints.md)
    assert ".distcp" in out.stdout and "truncated" in out.stdout, out.stdout[-2000:]
    assert "Traceback" not in out.stdout


def test_interrupted_save_keeps_previous_checkpoint(tmp_path):
    """A save killed before its rename leaves iter_*.tmp; the tracker still names the old one."""
    ckpt = str(tmp_path / "ckpt")
    train(2, f"--expert-model-parallel-size 2 --train-iters 2 --save {ckpt}")
    os.makedirs(os.path.join(ckpt, "iter_0000004.tmp"))  # what a kill mid-save leaves
    resumed = train(2, f"--expert-model-parallel-size 2 --train-iters 3 --load {ckpt} "
                       f"--override-opt_param-scheduler")[0]
    assert resumed["iteration"] == [3]


@pytest.mark.parametrize("extra,env,needle", [
    ("--tensor-model-parallel-size 2 --sequence-parallel", {"WORLD_SIZE": "3"},
     "not divisible by --tensor-model-parallel-size"),
    ("--bogus-flag 1", {}, "unrecognized arguments: --bogus-flag"),
    ("--expert-model-parallel-size 3 --global-batch-size 6", {"WORLD_SIZE": "3"},
     "--num-experts (4) must be divisible"),
    ("--lr-warmup-iters 5", {}, "--lr-warmup-iters (5) must be smaller than --lr-decay-iters (1"),
    ("--tensor-model-parallel-size 2", {"WORLD_SIZE": "2"}, "requires --sequence-parallel"),
    ("--tensor-model-parallel-size 2 --sequence-parallel --add-bias-linear", {"WORLD_SIZE": "2"},
     "--expert-tensor-parallel-size 2 needs --disable-bias-linear"),
], ids=["world-size", "unknown-flag", "experts-vs-ep", "warmup", "tp-needs-sp", "etp-bias"])
def test_bad_flags_fail_before_any_process_group(extra, env, needle):
    out = cli(TINY + ["--train-iters", "1"] + extra.split(), env=env)
    assert out.returncode == 2
    assert needle in out.stderr, out.stderr
    assert "Traceback" not in out.stderr


def test_missing_data_path_names_the_file(tmp_path):
    args = [a for a in TINY if a != "--mock-data"]
    out = cli(args + ["--train-iters", "1", "--data-path", str(tmp_path / "nope_text_document")])
    assert out.returncode == 2
    assert "nope_text_document.bin does not exist" in out.stderr
    assert "Traceback" not in out.stderr


def test_nan_loss_stops_with_clear_error_and_keeps_checkpoint(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    # the loop's own NaN check (--rerun-mode validate_results, the default, re-runs the iteration
    # first and exits 16: tests/test_result_validation.py)
    args = TINY + ["--expert-model-parallel-size", "2", "--train-iters", "6", "--lr", "1e9",
                   "--clip-grad", "0", "--init-method-std", "5", "--save", ckpt,
                   "--save-interval", "1", "--rerun-mode", "disabled"]
    out = torchrun(2, args)
    assert out.returncode != 0
    assert "error: lm loss is nan at iteration 2" in out.stdout, out.stdout[-2000:]
    assert "Last checkpoint: " + ckpt + " (iteration 1)" in out.stdout
    assert open(os.path.join(ckpt, "latest_checkpointed_iteration.txt")).read() == "1"
    assert not os.path.exists(os.path.join(ckpt, "iter_0000002"))


def test_exit_on_missing_checkpoint(tmp_path):
    """--exit-on-missing-checkpoint: an empty --load ends the run (Megatron-LM's line, status 0)
    before any model is built; without the flag the same launch starts from scratch, and once a
    checkpoint is there the flag loads it as usual."""
    from tests._ckpt_cases import run_pretrain_steps

    ckpt = str(tmp_path / "ckpt")
    os.makedirs(ckpt)
    base = TINY + ["--load", ckpt, "--save", ckpt, "--train-iters", "2"]
    exiting, scratch, resumed = run_distributed(run_pretrain_steps, 1, [
        {"argv": base + ["--exit-on-missing-checkpoint"]},
        {"argv": base + ["--exit-interval", "1"]},
        {"argv": base + ["--exit-on-missing-checkpoint"]},
    ], timeout_s=300)[0]
    assert exiting["exit"] == 0
    assert ">> '--exit-on-missing-checkpoint' set ... exiting. <<" in exiting["text"]
    assert "training from iteration" not in exiting["text"], exiting["text"]
    assert "training from iteration 0 to 2" in scratch["text"], scratch["text"]
    assert "training from iteration 1 to 2" in resumed["text"], resumed["text"]
    assert "exiting. <<" not in resumed["text"]


def _training_batches(rank, world, argv, mutate=None):
    """pretrain() with the first token of every training micro-batch recorded (which samples
    trained), and the log text."""
    import contextlib
    import io

    import pretrain_gpt_moe

    from megatron_moe.training import loop
    from tests._train_cases import _pretrain

    seen, real_step, real_drop = [], pretrain_gpt_moe.forward_step, loop.Trainer.drop_batch

    def forward_step(data_iterator, model):
        from megatron_moe.models.builder import unwrap

        if not unwrap(model).training:
            return real_step(data_iterator, model)
        batch = next(data_iterator)
        seen.append(batch["tokens"][:, :4].tolist())
        return real_step(iter([batch]), model)

    pretrain_gpt_moe.forward_step = forward_step
    if mutate:   # the skipped iteration's batch is not read: the next step trains on it
        loop.Trainer.drop_batch = lambda self, train_iter: None
    buf = io.StringIO()
    try:
        with contextlib.redirect_stdout(buf):
            result = _pretrain(argv)
    finally:
        pretrain_gpt_moe.forward_step, loop.Trainer.drop_batch = real_step, real_drop
    return seen, result["history"], buf.getvalue()


@pytest.mark.parametrize("mutate", [None, "batch_kept"])
def test_iterations_to_skip_drop_their_batch(mutate):
    """--iterations-to-skip 2 3 (Megatron-LM): iterations 2 and 3 read their batches and drop
    them; iteration 4 trains on the batch an uninterrupted run trains on at iteration 4, and the
    skipped samples show in the log line."""
    argv = TINY + ["--train-iters", "4"]
    plain = run_distributed(_training_batches, 1, argv, timeout_s=300)[0]
    skip = run_distributed(_training_batches, 1, argv + ["--iterations-to-skip", "2", "3"], mutate,
                           timeout_s=300)[0]
    per_step = len(plain[0]) // 4   # micro-batches per iteration
    assert plain[1]["iteration"] == [1, 2, 3, 4] and skip[1]["iteration"] == [1, 4]
    assert skip[1]["lm_loss"][0] == plain[1]["lm_loss"][0]
    assert " skipped iteration 2 (--iterations-to-skip)" in skip[2]
    assert "skipped samples:           16 |" in skip[2], skip[2][-1500:]
    trained = plain[0][:per_step] + plain[0][3 * per_step:]
    if mutate:
        assert skip[0] != trained
    else:
        assert skip[0] == trained
