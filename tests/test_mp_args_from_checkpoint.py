"""Megatron-LM's --use-mp-args-from-checkpoint-args: with --use-checkpoint-args the model-parallel
sizes (tensor, pipeline, virtual pipeline, expert) are the checkpoint's.

A tiny GPT-MoE is trained for 2 iterations at TP=2 on 2 CPU ranks and saved; the same 2 ranks then
resume it with no parallel flag on the command line (TP would be 1, DP 2). Every run happens in one
spawned pair of ranks, one after another (tests/_ckpt_cases.run_pretrain_steps); the parse cases
run in this process.
"""

import pytest

from megatron_moe.runtime.local_ranks import run_distributed
from tests._ckpt_cases import TINY, run_pretrain_steps

# --sequence-parallel: not a model-parallel size (Megatron-LM does not take it); off at TP=1
RUN = ("--micro-batch-size 2 --global-batch-size 8 --lr 3e-3 --lr-decay-iters 10 --log-interval 1 "
       "--eval-interval 1000 --eval-iters 1 --mock-data --vocab-size 256 --sequence-parallel").split()
RESUME = ["--use-checkpoint-args", "--use-mp-args-from-checkpoint-args", "--train-iters", "3",
          "--override-opt_param-scheduler"] + RUN


def _no_mp_args():
    """The mutation, in the ranks: --use-mp-args-from-checkpoint-args takes nothing."""
    from megatron_moe.training import checkpoint_args

    real = checkpoint_args.MODEL_PARALLEL
    checkpoint_args.MODEL_PARALLEL = ()
    return lambda: setattr(checkpoint_args, "MODEL_PARALLEL", real)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("mpargs")
    pre = str(d / "pre")
    tp2 = TINY + ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--lr-decay-iters",
                  "10"]
    steps = {
        "pretrain": {"argv": tp2 + ["--train-iters", "2", "--save", pre]},
        "straight": {"argv": tp2 + ["--train-iters", "3"]},   # the same 3 iterations, no restart
        "resume": {"argv": ["--load", pre] + RESUME},
        "resume_mutated": {"argv": ["--load", pre] + RESUME, "mutate": _no_mp_args},
    }
    out = run_distributed(run_pretrain_steps, 2, list(steps.values()), timeout_s=600)[0]
    return dict(zip(steps, out), pre=pre)


def test_resume_takes_the_checkpoints_tensor_parallel_size(runs):
    """The resumed run is built at TP=2 (the rank-0 line says so), keeps the checkpoint's layout
    (its RNG state restored, no layout-change note) and its iteration-3 loss is the uninterrupted
    run's, bit for bit. Mutation (sizes not taken): TP=1 x DP=2, the layout-change note."""
    for name in ("pretrain", "straight", "resume", "resume_mutated"):
        assert runs[name]["exit"] == 0, (name, runs[name]["text"][-2000:])
    text = runs["resume"]["text"]
    assert "training from iteration 2 to 3" in text, text[-2000:]
    line = next(l for l in text.splitlines() if l.startswith("> --use-checkpoint-args"))
    assert "tensor_model_parallel_size 1 -> 2" in line, line
    assert "parallel layout changed" not in text
    assert runs["resume"]["history"]["lm_loss"][-1] == runs["straight"]["history"]["lm_loss"][-1]
    # mutation
    mutated = runs["resume_mutated"]["text"]
    assert "tensor_model_parallel_size" not in next(
        l for l in mutated.splitlines() if l.startswith("> --use-checkpoint-args"))
    assert "parallel layout changed" in mutated, mutated[-2000:]


def _parse(argv, capsys, world_size=2):
    from megatron_moe import arguments

    try:
        return arguments.parse_args(argv, world_size=world_size), ""
    except SystemExit as exc:
        assert exc.code == 2
        err = capsys.readouterr().err
        assert "Traceback" not in err
        return None, err.splitlines()[0]


@pytest.mark.parametrize("mutate", [None, "not_taken"])
def test_sizes_override_the_command_line(runs, mutate, monkeypatch, capsys):
    """Forced as in Megatron-LM: a contradicting --tensor-model-parallel-size 1 on the command line
    is replaced by the checkpoint's 2 (data parallel becomes 1); without the flag the command line's
    size stays."""
    from megatron_moe.training import checkpoint_args

    if mutate:
        monkeypatch.setattr(checkpoint_args, "MODEL_PARALLEL", ())
    base = ["--load", runs["pre"], "--use-checkpoint-args", "--tensor-model-parallel-size", "1"] + \
        RUN + ["--train-iters", "3"]
    taken, err = _parse(base + ["--use-mp-args-from-checkpoint-args"], capsys)
    assert err == ""
    kept, err = _parse(base, capsys)
    assert err == "" and kept.tensor_model_parallel_size == 1
    assert (taken.tensor_model_parallel_size, taken.data_parallel_size) == \
        ((2, 1) if mutate is None else (1, 2))


def test_without_use_checkpoint_args_is_one_line(capsys):
    args, err = _parse(TINY + ["--train-iters", "1", "--use-mp-args-from-checkpoint-args"], capsys,
                       world_size=1)
    assert args is None and "--use-mp-args-from-checkpoint-args needs --use-checkpoint-args" in err


@pytest.mark.parametrize("mutate", [None, "not_taken"])
def test_inference_tools_take_the_sizes(runs, mutate, monkeypatch, capsys):
    """tools/generate.py's parser: the layout is the command line's unless
    --use-mp-args-from-checkpoint-args, then the checkpoint's TP=2 (a size given there still
    wins, the inference tools' rule). Mutation: the flag ignored there."""
    from megatron_moe.inference import arguments as inference_args
    from tools.generate import add_text_generate_args

    if mutate:
        monkeypatch.setattr(inference_args, "MP_FROM_CHECKPOINT", frozenset())
    monkeypatch.setenv("WORLD_SIZE", "2")
    base = ["--load", runs["pre"], "--use-checkpoint-args", "--prompts", "x", "--sequence-parallel"]

    def parse(argv):
        return inference_args.parse_inference_args(argv, add_text_generate_args, prog="generate.py")

    assert parse(base).tensor_model_parallel_size == 1
    taken = parse(base + ["--use-mp-args-from-checkpoint-args"]).tensor_model_parallel_size
    assert (taken == 2) is (mutate is None), taken
    assert parse(base + ["--use-mp-args-from-checkpoint-args", "--tensor-model-parallel-size",
                         "1"]).tensor_model_parallel_size == 1
