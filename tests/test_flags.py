"""Megatron-LM's whole flag surface (megatron_moe/flags): every flag has a status, none is
"unrecognized", refusals are one line at parse time, docs/flags.md is generated and current."""

import argparse
import os
import subprocess
import sys

import pytest
import torch

from megatron_moe import flags
from megatron_moe.arguments import build_parser, parse_args

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASE = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32 "
        "--micro-batch-size 2 --lr 1e-3 --train-iters 2 --mock-data --tokenizer-type NullTokenizer "
        "--vocab-size 256").split()


class _Exit(Exception):
    pass


@pytest.fixture(scope="module")
def parser():
    p = build_parser()

    def exit_(status=0, message=None):
        raise _Exit(message)

    p.exit = exit_
    return p


def _spellings(record):
    return [record["flag"]] + record["aliases"]


def _own_actions(parser):
    return {s: a for s, a in parser._option_string_actions.items()
            if getattr(a, "megatron_status", None) is None}


def test_every_megatron_flag_of_every_release_has_a_status():
    table = flags.status_table()
    for release in flags.RELEASES:
        records = flags.megatron_flags(release)
        assert len(records) > 600, release   # the whole list was read, not a stub
        missing = sorted(set(records) - set(table))
        assert not missing, f"Megatron {release} flags without a line in status.txt: {missing}"
    stale = sorted(set(table) - set(flags.all_megatron_flags()))
    assert not stale, f"status.txt lines for flags Megatron does not have: {stale}"


def test_status_of_a_flag_matches_who_defines_it(parser):
    own = _own_actions(parser)
    wrong = []
    for flag, (status, _) in flags.status_table().items():
        spellings = _spellings(flags.all_megatron_flags()[flag])
        defined = [s for s in spellings if s in own]
        if status == "implemented" and len(defined) != len(spellings):
            wrong.append(f"{flag}: implemented but our parser lacks "
                         f"{sorted(set(spellings) - set(defined))}")
        if status != "implemented" and defined:
            wrong.append(f"{flag}: {status} but our own code defines it (mark it implemented)")
    assert not wrong, "\n".join(wrong)


def _value_for(action):
    if action.nargs == 0:
        return []
    if action.choices:
        value = str(list(action.choices)[0])
    elif action.type in (int, float) or action.default is None or isinstance(action.default,
                                                                             (int, float)):
        value = "1"
    else:
        value = "x"
    return [value] * (action.nargs if isinstance(action.nargs, int) else 1)


def test_no_megatron_flag_is_unrecognized(parser):
    """Every spelling of every Megatron flag, with a value of its shape, on one command line."""
    argv, missing = list(BASE), []
    for record in flags.all_megatron_flags().values():
        for spelling in _spellings(record):
            action = parser._option_string_actions.get(spelling)
            if action is None:
                missing.append(spelling)
            elif spelling not in BASE:
                argv += [spelling] + _value_for(action)
    assert not missing, missing
    args = parser.parse_args(argv)   # an unrecognized one would raise _Exit
    refused = {f for f, (s, _) in flags.status_table().items() if s == "refused"}
    assert set(flags.refused_given(args)) == refused


def test_refused_flags_fail_with_one_line_naming_the_flag(parser):
    refused = [f for f, (s, _) in flags.status_table().items() if s == "refused"]
    assert len(refused) > 100
    for flag in refused:
        args = argparse.Namespace(**{flags._REFUSED_PREFIX + flag: True, "lr": 1.0})
        with pytest.raises(ValueError) as err:
            flags.check_refused(args)
        message = str(err.value)
        assert message.startswith(f"{flag} is refused: ") and "\n" not in message
    assert flags.refused_given(parser.parse_args(BASE)) == []
    one = parser.parse_args(BASE + ["--mrope-section", "1", "2", "3"])
    assert flags.refused_given(one) == ["--mrope-section"]


def test_noop_flags_keep_megatron_dest_and_default(parser):
    noop = [f for f, (s, _) in flags.status_table().items() if s == "noop"]
    assert "--no-masked-softmax-fusion" in noop
    defaults = parser.parse_args(BASE)
    for flag in noop:
        record = flags.all_megatron_flags()[flag]
        assert getattr(defaults, record["dest"]) == record["default"], flag
    given = parser.parse_args(BASE + ["--no-masked-softmax-fusion", "--no-rope-fusion"])
    assert given.masked_softmax_fusion is False and given.apply_rope_fusion is False


def test_fusion_selectors_reach_megatron_core_only_with_transformer_engine():
    from megatron_moe.models.builder import _fusion_selectors

    args = parse_args(BASE + ["--position-embedding-type", "rope", "--swiglu",
                              "--no-bias-swiglu-fusion"], world_size=1)
    with_te = _fusion_selectors(args, te=True)
    assert with_te["masked_softmax_fusion"] and with_te["apply_rope_fusion"]
    assert with_te["bias_activation_fusion"] is False        # --no-bias-swiglu-fusion passed on
    args.masked_softmax_fusion = False                        # --no-masked-softmax-fusion
    assert _fusion_selectors(args, te=True)["masked_softmax_fusion"] is False
    assert not any(_fusion_selectors(args, te=False).values())   # local/CPU: unfused kernels


def test_local_path_on_cuda_takes_megatron_cores_compiled_fusions(monkeypatch):
    """Local path on CUDA: the selectors whose fused version is megatron-core's own torch.compile
    region reach megatron-core (SwiGLU, bias-dropout-add, native cross-entropy); the TE/apex
    kernels' selectors stay off."""
    from megatron_moe.models.builder import _fusion_selectors

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    args = parse_args(BASE + ["--position-embedding-type", "rope", "--swiglu",
                              "--cross-entropy-loss-fusion"], world_size=1)
    sel = _fusion_selectors(args, te=False)
    assert sel["bias_activation_fusion"] and sel["bias_dropout_fusion"]
    assert sel["cross_entropy_loss_fusion"]
    assert not (sel["masked_softmax_fusion"] or sel["apply_rope_fusion"] or sel["moe_router_fusion"])
    args.bias_swiglu_fusion = args.bias_dropout_fusion = False   # --no-bias-swiglu-fusion ...
    args.cross_entropy_fusion_impl = "te"                        # TE's kernel: not on this path
    assert not any(_fusion_selectors(args, te=False).values())
    args = parse_args(BASE + ["--position-embedding-type", "rope"], world_size=1)   # GeLU
    assert _fusion_selectors(args, te=False)["bias_activation_fusion"] is False


def test_refusal_on_the_cli_before_any_process_group():
    """pretrain_gpt_moe.py with a refused flag: exit 2, one error line, no rank started."""
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "pretrain_gpt_moe.py"), *BASE,
         "--cache-mla-latents"],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=ROOT, WORLD_SIZE="2", RANK="0"))
    assert proc.returncode == 2, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert errors == ["pretrain_gpt_moe.py: error: --cache-mla-latents is refused: "
                      + flags.status_table()["--cache-mla-latents"][1]]
    assert "init_process_group" not in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize("extra,message", [
    ("--transformer-impl local --attention-backend fused",
     "--attention-backend fused needs --transformer-impl transformer_engine"),
    ("--no-position-embedding", "--no-position-embedding is deprecated"),
    ("--transformer-impl inference_optimized", "--transformer-impl inference_optimized is refused"),
    ("--rotary-percent 1.5", "--rotary-percent (1.5) must be in (0, 1]"),
    ("--hidden-size 30", "--hidden-size (30) must be divisible by --num-attention-heads (4)"),
    ("--overlap-param-gather", "--overlap-param-gather needs --use-distributed-optimizer"),
    ("--main-grads-dtype bf16", "--main-grads-dtype bf16: only fp32"),
    ("--main-grads-dtype fp8", "Megatron's choices: fp32, bf16"),
], ids=["fused-local", "no-pos-emb", "inference-impl", "rotary-percent", "heads", "param-gather",
        "main-grads-bf16", "main-grads-fp8"])
def test_bad_model_flags_fail_at_parse_time(extra, message, capsys):
    with pytest.raises(SystemExit) as exc:
        parse_args(BASE + extra.split(), world_size=1)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_gradients_in_fp32_is_accepted_and_always_on():
    for extra in ([], ["--accumulate-allreduce-grads-in-fp32"], ["--main-grads-dtype", "fp32"]):
        args = parse_args(BASE + extra + ["--bf16"], world_size=1)
        assert args.accumulate_allreduce_grads_in_fp32 is True and args.main_grads_dtype == "fp32"


def test_context_parallel_with_megatron_core_local_attention_fails_at_parse_time(capsys):
    """megatron-core's local attention asserts CP == 1 inside the model build; refused here (the
    SDPA attention has CP: tests/test_context_parallel.py)."""
    with pytest.raises(SystemExit) as exc:
        parse_args(BASE + "--transformer-impl local --attention-backend local "
                          "--context-parallel-size 2".split(), world_size=2)
    assert exc.value.code == 2
    err = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(err) == 1 and "--context-parallel-size 2 with --attention-backend local is not " \
        "supported" in err[0] and "--attention-backend flash" in err[0], err
    # flash (SDPA), and auto (SDPA under CP), are accepted
    for backend in ("flash", "auto"):
        args = parse_args(BASE + f"--transformer-impl local --attention-backend {backend} "
                                 f"--context-parallel-size 2".split(), world_size=2)
        assert args.context_parallel_size == 2


def test_transformer_impl_resolution():
    from megatron_moe.models.builder import have_transformer_engine

    args = parse_args(BASE, world_size=1)
    assert args.transformer_impl == ("transformer_engine" if have_transformer_engine() else "local")
    if not have_transformer_engine():
        with pytest.raises(SystemExit):
            parse_args(BASE + ["--transformer-impl", "transformer_engine"], world_size=1)
    args = parse_args(BASE + ["--transformer-impl", "local", "--use-mcore-models",
                              "--kv-channels", "16", "--hidden-size", "30"], world_size=1)
    assert args.transformer_impl == "local" and args.kv_channels == 16


def test_status_file_errors_name_the_line():
    with pytest.raises(ValueError, match=r"status.txt:2: expected 'FLAG STATUS REASON'"):
        flags.parse_status("--a implemented fine\n--b maybe why\n", "status.txt")
    with pytest.raises(ValueError, match=r"x:2: --a is listed twice"):
        flags.parse_status("--a noop k\n--a refused r\n", "x")


def test_flags_doc_is_current():
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    import gen_flags_doc

    text = gen_flags_doc.render()
    with open(os.path.join(ROOT, "docs", "flags.md")) as f:
        assert f.read() == text, "docs/flags.md is stale: run python tools/gen_flags_doc.py"
    for flag in flags.all_megatron_flags():
        assert f"| `{flag}` |" in text


def test_moe_balance_n_accepts_an_int_or_cost(capsys):
    """--moe-balance-n: an integer >= 0 (default 0) or 'cost'; anything else one line naming it."""
    assert parse_args(BASE, world_size=1).moe_balance_n == 0
    assert parse_args(BASE + ["--moe-balance-n", "2"], world_size=1).moe_balance_n == 2
    assert parse_args(BASE + ["--moe-balance-n", "cost"], world_size=1).moe_balance_n == "cost"
    for bad in ("many", "-1", "1.5"):
        with pytest.raises(SystemExit) as exc:
            parse_args(BASE + ["--moe-balance-n", bad], world_size=1)
        assert exc.value.code == 2
        errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
        assert len(errors) == 1 and "--moe-balance-n" in errors[0], errors


def test_flags_of_megatrons_ci_configs_have_a_status_and_a_doc_column():
    """Every flag Megatron's MoE CI configs set is one of Megatron's (aliases included) with a
    status, and docs/flags.md's CI column counts it (tests/data, tools/gen_flags_doc.py)."""
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    import gen_flags_doc

    usage, release = gen_flags_doc.ci_usage()
    table = flags.status_table()
    assert release.startswith("core_v0.19.0") and usage["--log-params-norm"] == 51
    assert not sorted(f for f in usage if f not in table), "CI flags without a status"
    doc = open(os.path.join(ROOT, "docs", "flags.md")).read()
    assert "| `--log-params-norm` | implemented |" in doc and " | all | 51 |" in doc
