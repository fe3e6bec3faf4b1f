"""Megatron-LM's --use-checkpoint-args, --no-use-tokenizer-model-from-checkpoint-args and
--pretrained-checkpoint in training.

One tiny GPT-MoE (SentencePiece data, RMSNorm, SwiGLU, 4 experts top-2) is trained for 2
iterations once for the module; its tokenizer file is then moved, as if the checkpoint had been
copied to another cluster. The command-line cases parse in this process; the training cases run
one after another in one spawned rank (tests/_ckpt_cases.run_pretrain_steps), each mutation next
to the run it breaks.
"""

import functools
import os
import shutil

import pytest

from megatron_moe.runtime.local_ranks import run_distributed
from tests import _ckpt_args_cases as M
from tests import _data_helpers as H
from tests._ckpt_cases import run_pretrain_steps

MODEL = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32 --swiglu "
         "--normalization RMSNorm --num-experts 4 --moe-router-topk 2 "
         "--moe-token-dispatcher-type alltoall --moe-aux-loss-coeff 0.01 --disable-bias-linear "
         "--hidden-dropout 0 --attention-dropout 0").split()
RUN = ("--micro-batch-size 2 --global-batch-size 4 --lr 3e-3 --lr-decay-iters 10 --log-interval 1 "
       "--eval-interval 1000 --eval-iters 1 --split 90,10,0 --override-opt_param-scheduler").split()
# model flags that contradict the checkpoint's: Megatron-LM's rule replaces them
CONTRADICTING = "--moe-router-topk 3 --normalization LayerNorm --hidden-dropout 0.5".split()


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    d = tmp_path_factory.mktemp("ckptargs")
    os.makedirs(d / "there")
    os.makedirs(d / "here")
    data, tok_there = H.sp_dataset(str(d / "there"), max_docs=40, vocab_size=300)
    tok = str(d / "here" / "sp.model")   # where the tokenizer is now
    pre, ft = str(d / "pre"), str(d / "ft")
    data_args = ["--data-path", data, "--tokenizer-model", tok]
    ckpt_args = ["--load", pre, "--use-checkpoint-args",
                 "--no-use-tokenizer-model-from-checkpoint-args"] + RUN + data_args
    finetune = MODEL + RUN + data_args + ["--pretrained-checkpoint", pre, "--train-iters", "2"]
    steps = {
        "pretrain": {"argv": MODEL + RUN + ["--data-path", data, "--tokenizer-model", tok_there,
                                            "--train-iters", "2", "--save", pre]},
        # no model flag given, three contradicting: the checkpoint's model resumes
        "resume": {"argv": ckpt_args + CONTRADICTING + ["--train-iters", "3"],
                   "prepare": functools.partial(shutil.move, tok_there, tok)},
        "resume_mutated": {"argv": ckpt_args + CONTRADICTING + ["--train-iters", "3"],
                           "mutate": M.checkpoint_args_not_applied},
        "reference": {"argv": MODEL + RUN + data_args + ["--load", pre, "--finetune",
                                                         "--train-iters", "1"]},
        "scratch": {"argv": MODEL + RUN + data_args + ["--train-iters", "1"]},
        "finetune": {"argv": finetune + ["--load", ft, "--save", ft, "--exit-interval", "1"]},
        "finetune_relaunch": {"argv": finetune + ["--load", ft, "--save", ft]},
        "ignored": {"argv": finetune + ["--load", str(d / "ft2")],
                    "mutate": M.pretrained_checkpoint_ignored},
        "resumed": {"argv": finetune[:-1] + ["3", "--load", str(d / "ft3")],
                    "mutate": M.pretrained_checkpoint_resumed},
    }
    runs = run_distributed(run_pretrain_steps, 1, list(steps.values()), timeout_s=600)[0]
    return dict(zip(steps, runs), pre=pre, data=data, tok=tok, tok_there=tok_there, dir=d)


def _parse(argv, capsys):
    """arguments.parse_args in this process: (args, '') or (None, the error line)."""
    from megatron_moe import arguments

    try:
        return arguments.parse_args(argv, world_size=1), ""
    except SystemExit as exc:
        assert exc.code == 2
        err = capsys.readouterr().err
        assert "Traceback" not in err
        return None, err.splitlines()[0]


@pytest.mark.parametrize("mutate", [None, "not_applied"])
def test_model_flags_come_from_the_checkpoint(trained, mutate, monkeypatch, capsys):
    """Megatron-LM's rule: its model flags are the checkpoint's even when the command line says
    otherwise; --seq-length (filled only when not given) stays the command line's, and so do the
    flags outside its list (--lr; --qk-layernorm, which Megatron-LM does not take either)."""
    from megatron_moe.training import checkpoint_args

    if mutate:
        monkeypatch.setattr(checkpoint_args, "_apply", lambda args, stored: {})
    argv = (["--load", trained["pre"], "--use-checkpoint-args", "--tokenizer-model", trained["tok"],
             "--no-use-tokenizer-model-from-checkpoint-args", "--data-path", trained["data"],
             "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
             "--seq-length", "16",
             "--num-experts", "8", "--disable-bias-linear", "--qk-layernorm",
             "--train-iters", "5"] + RUN + CONTRADICTING)
    args, err = _parse(argv, capsys)
    assert err == ""
    got = {k: getattr(args, k) for k in ("moe_router_topk", "normalization", "hidden_dropout",
                                         "swiglu", "num_experts")}
    from_checkpoint = dict(moe_router_topk=2, normalization="RMSNorm", hidden_dropout=0.0,
                           swiglu=True, num_experts=4)
    assert (got == from_checkpoint) is (mutate is None), got
    assert (args.seq_length, args.lr, args.qk_layernorm, args.train_iters) == (16, 3e-3, True, 5)


@pytest.mark.parametrize("mutate", [None, "flag_ignored", "never_from_checkpoint"])
def test_tokenizer_model_from_checkpoint(trained, mutate, monkeypatch, capsys):
    """By default the checkpoint's --tokenizer-model wins: here it names the file's old place, so
    the launch fails naming it; --no-use-tokenizer-model-from-checkpoint-args keeps the command
    line's, and the same launch parses."""
    from megatron_moe.training import checkpoint_args as ca

    if mutate == "flag_ignored":
        monkeypatch.setattr(ca, "FROM_CHECKPOINT", ca.FROM_CHECKPOINT + ca.TOKENIZER)
    if mutate == "never_from_checkpoint":
        monkeypatch.setattr(ca, "TOKENIZER", ())
    argv = ["--load", trained["pre"], "--use-checkpoint-args", "--data-path", trained["data"],
            "--tokenizer-model", trained["tok"], "--train-iters", "3"] + RUN
    default, err = _parse(argv, capsys)
    kept, kept_err = _parse(argv + ["--no-use-tokenizer-model-from-checkpoint-args"], capsys)
    outcome = (default is None and f"--tokenizer-model: {trained['tok_there']} does not exist" in err,
               kept is not None and kept.tokenizer_model == trained["tok"])
    assert outcome == (True, True) or mutate, (outcome, err, kept_err)
    assert outcome != (True, True) or not mutate, outcome


@pytest.mark.parametrize("mutate", [None, "pretrained_not_read"])
def test_flags_from_the_pretrained_checkpoint(trained, tmp_path, mutate, monkeypatch, capsys):
    """A finetune's first launch: --load is still empty, the model's flags come from
    --pretrained-checkpoint (Megatron-LM reads it first, then --load)."""
    from megatron_moe.training import checkpoint_args

    if mutate:
        real = checkpoint_args.has_checkpoint
        monkeypatch.setattr(checkpoint_args, "has_checkpoint",
                            lambda root: root != trained["pre"] and real(root))
    argv = ["--pretrained-checkpoint", trained["pre"], "--load", str(tmp_path),
            "--use-checkpoint-args", "--data-path", trained["data"], "--tokenizer-model",
            trained["tok"], "--no-use-tokenizer-model-from-checkpoint-args",
            "--train-iters", "3"] + RUN
    args, err = _parse(argv, capsys)
    if mutate:
        assert args is None and "--use-checkpoint-args: no checkpoint under --load" in err, err
    else:
        assert (args.hidden_size, args.num_experts, args.normalization) == (32, 4, "RMSNorm"), err


@pytest.mark.parametrize("mutate", [None, "bert_checked_first"])
def test_bert_entry_point_checks_its_flags_after_the_checkpoints(trained, mutate, monkeypatch,
                                                                 capsys):
    """pretrain_bert_moe.py's own checks (--seq-length leaves room for [CLS]/[SEP], ...) see the
    flags the checkpoint supplied: no --seq-length on the command line. Mutation: its checks run
    before the checkpoint's flags are applied (as they did right after argparse)."""
    import pretrain_bert_moe

    from megatron_moe import arguments

    if mutate:
        real = arguments._use_checkpoint_args

        def checked_first(args, parser):
            parser.validate_extra_args(args)
            real(args, parser)

        monkeypatch.setattr(arguments, "_use_checkpoint_args", checked_first)
    argv = ["--load", trained["pre"], "--use-checkpoint-args", "--data-path", trained["data"],
            "--tokenizer-model", trained["tok"], "--no-use-tokenizer-model-from-checkpoint-args",
            "--train-iters", "3"] + RUN
    try:
        args = arguments.parse_args(argv, extra_args_provider=pretrain_bert_moe.extra_args_provider,
                                    world_size=1)
    except TypeError:   # None < 4: the check saw no --seq-length
        assert mutate
        return
    assert not mutate and (args.seq_length, args.hidden_size) == (32, 32)


@pytest.mark.parametrize("mutate", [None, "flag_ignored"])
def test_inference_tools_honour_the_tokenizer_flag(trained, mutate, monkeypatch, capsys):
    """tools/generate.py's parser (flags given there win over the checkpoint's): without
    --tokenizer-model the checkpoint's is taken, unless --no-use-tokenizer-model-from-checkpoint-args
    says not to, and then one line asks for it."""
    from megatron_moe.inference.arguments import parse_inference_args
    from megatron_moe.training import checkpoint_args
    from tools.generate import add_text_generate_args

    if mutate:
        monkeypatch.setattr(checkpoint_args, "TOKENIZER", ())
    monkeypatch.setenv("WORLD_SIZE", "1")

    def error(argv):
        with pytest.raises(SystemExit):
            parse_inference_args(argv, add_text_generate_args, prog="generate.py")
        return capsys.readouterr().err.splitlines()[0]

    base = ["--load", trained["pre"], "--use-checkpoint-args", "--prompts", "x"]
    assert f"--tokenizer-model: {trained['tok_there']} does not exist" in error(base)
    err = error(base + ["--no-use-tokenizer-model-from-checkpoint-args"])
    asked = "--tokenizer-type SentencePieceTokenizer needs --tokenizer-model" in err
    assert asked is (mutate is None), err
    assert "--pretrained-checkpoint is a training flag" in error(base + [
        "--pretrained-checkpoint", trained["pre"]])


@pytest.mark.parametrize("extra,needle", [
    (["--use-checkpoint-args"], "--use-checkpoint-args needs --load"),
    (["--use-checkpoint-args", "--load", "{empty}"],
     "--use-checkpoint-args: no checkpoint under --load {empty}"),
    (["--pretrained-checkpoint", "{empty}"], "--pretrained-checkpoint: no checkpoint under {empty}"),
], ids=["no-load", "empty-load", "empty-pretrained"])
def test_no_checkpoint_is_one_line_at_parse_time(tmp_path, capsys, extra, needle):
    empty = str(tmp_path)
    argv = MODEL + RUN + ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size",
                          "256", "--train-iters", "1"] + [a.format(empty=empty) for a in extra]
    args, err = _parse(argv, capsys)
    assert args is None and needle.format(empty=empty) in err, err


def test_training_resumes_with_checkpoint_args(trained):
    """No model flag on the command line, three contradicting ones: the checkpoint's model is
    built and resumed at its iteration; with the flags not applied the launch cannot parse."""
    run = trained["resume"]
    assert trained["pretrain"]["exit"] == 0, trained["pretrain"]["text"][-2000:]
    assert run["exit"] == 0, run["text"][-2000:]
    assert "training from iteration 2 to 3" in run["text"], run["text"][-2000:]
    line = next(l for l in run["text"].splitlines() if l.startswith("> --use-checkpoint-args"))
    assert "hidden_size None -> 32" in line and "normalization LayerNorm -> RMSNorm" in line \
        and "moe_router_topk 3 -> 2" in line and "swiglu False -> True" in line, line
    assert trained["resume_mutated"]["exit"] == 2   # --hidden-size ... required


def test_pretrained_checkpoint_finetunes(trained):
    """--load empty: the weights of --pretrained-checkpoint at iteration 0, as --finetune loads
    them (first loss identical; a run from scratch differs); the relaunch resumes --load's own
    checkpoint. Mutations: never falling back (the scratch loss), resuming the pretrained run
    instead of finetuning it (its iteration)."""
    first = {k: trained[k]["history"]["lm_loss"][0] if trained[k]["history"] else None
             for k in ("reference", "scratch", "finetune", "ignored")}
    assert trained["finetune"]["exit"] == 0, trained["finetune"]["text"][-2000:]
    assert "training from iteration 0 to 2" in trained["finetune"]["text"]
    assert first["finetune"] == first["reference"] != first["scratch"], first
    assert "training from iteration 1 to 2" in trained["finetune_relaunch"]["text"], \
        trained["finetune_relaunch"]["text"][-2000:]
    # mutations
    assert first["ignored"] == first["scratch"] != first["reference"], first
    assert "training from iteration 2 to 3" in trained["resumed"]["text"], \
        trained["resumed"]["text"][-2000:]
