"""gpt-oss: Megatron-LM's gpt-oss-20b configuration with the sizes overridden
(examples/train_gpt_oss_20b_cpu.sh) on 2 CPU ranks at EP=2; its features really act (sinks get
gradients and move, windowed layers see only the window, full layers everything); the flags'
refusals.
"""

import os
import subprocess

import pytest

from megatron_moe.testing import run_distributed
from tests._gpt_oss_cases import train_and_probe_rank

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "examples", "train_gpt_oss_20b_cpu.sh")
GPU_SCRIPT = os.path.join(ROOT, "examples", "train_gpt_oss_20b_distributed.sh")


def script_argv(path, tmp, *positional):
    """The flags a script hands pretrain_gpt_moe.py (a fake python/torchrun records them)."""
    fake = tmp / "bin"
    fake.mkdir(exist_ok=True)
    dump = tmp / "argv"
    for tool in ("python", "torchrun"):
        (fake / tool).write_text(f'#!/usr/bin/env bash\nprintf "%s\\0" "$@" > {dump}\n')
        (fake / tool).chmod(0o755)
    subprocess.run(["bash", path, *positional], check=True, timeout=60, capture_output=True,
                   env=dict(os.environ, PYTHON=str(fake / "python"),
                            PATH=f"{fake}:{os.environ['PATH']}"))
    argv = dump.read_bytes().decode().split("\0")[:-1]
    return argv[argv.index(os.path.join(ROOT, "pretrain_gpt_moe.py")) + 1:]


def _model_flags(argv):
    """The model-defining flags of a script (sizes and parallel layout aside)."""
    sizes = {"--num-layers", "--hidden-size", "--ffn-hidden-size", "--num-attention-heads",
             "--num-query-groups", "--kv-channels", "--seq-length", "--max-position-embeddings",
             "--num-experts", "--moe-ffn-hidden-size", "--moe-router-topk", "--window-size",
             "--yarn-original-max-position-embeddings"}
    out, i = {}, 0
    while i < len(argv):
        flag = argv[i]
        value = argv[i + 1] if i + 1 < len(argv) and not argv[i + 1].startswith("--") else None
        if flag not in sizes:
            out[flag] = value
        i += 2 if value is not None else 1
    return out


def test_cpu_script_is_the_gpu_configuration_with_sizes_overridden(tmp_path):
    cpu = _model_flags(script_argv(SCRIPT, tmp_path, "/tmp/ckpt"))
    gpu = _model_flags(script_argv(GPU_SCRIPT, tmp_path, "/tmp/ckpt", "/tmp/tok", "/tmp/data"))
    gpt_oss = ["--softmax-type", "--window-attn-skip-freq", "--quick-geglu", "--glu-linear-offset",
               "--activation-func-clamp-value", "--position-embedding-type", "--rotary-base",
               "--rotary-scaling-factor", "--no-yarn-correction-range-round-to-int",
               "--add-bias-linear", "--moe-router-dtype", "--normalization"]
    for flag in gpt_oss:
        assert flag in gpu and cpu.get(flag) == gpu[flag], flag
    assert gpu["--softmax-type"] == "learnable" and gpu["--position-embedding-type"] == "yarn"


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gpt_oss")
    argv = script_argv(SCRIPT, tmp, str(tmp / "ckpt")) + ["--train-iters", "4"]
    return run_distributed(train_and_probe_rank, 2, argv, timeout_s=400)


def test_trains_at_ep2_loss_finite_and_falling(trained):
    for rank in trained:
        losses = rank["history"]["lm_loss"]
        assert len(losses) == 4 and all(l == l for l in losses), losses
        assert losses[-1] < losses[0] - 0.05, losses


def test_learnable_sinks_get_gradients_and_train(trained):
    for rank in trained:
        grads, moved = rank["grads"], rank["moved"]
        assert len(grads) == 2, grads           # one sink vector per layer (2 layers)
        for name, seen in grads.items():
            # 4 iterations x 2 micro-batches of 2 (global 8 over 2 data-parallel ranks)
            assert len(seen) == 8 and all(v > 0 for v in seen), (name, seen)
            assert moved[name] > 0, name


def test_window_on_odd_layers_full_attention_on_even(trained):
    """--window-size 3,0 --window-attn-skip-freq 2: layer 1 windowed, layer 2 full (Megatron's
    rule, gpt-oss's layer_types). Moving key/value 0 changes queries 0..3 of the windowed layer
    only, every query of the full layer; a sink of +30 takes the attention away."""
    probes = {p["layer"]: p for p in trained[0]["probes"]}
    assert probes[1]["window"] == (3, 0) and probes[2]["window"] is None
    assert probes[1]["changed"] == [True] * 4 + [False] * 8, probes[1]["changed"]
    assert probes[2]["changed"] == [True] * 12, probes[2]["changed"]
    for p in probes.values():
        assert p["sunk_norm"] < 1e-3 * p["out_norm"], p


BASE = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
        "--micro-batch-size 1 --train-iters 1 --lr 1e-3 --mock-data --tokenizer-type NullTokenizer "
        "--vocab-size 100 --position-embedding-type rope").split()


@pytest.mark.parametrize("extra,message", [
    ("--quick-geglu --swiglu", "--quick-geglu and --swiglu are mutually exclusive"),
    ("--glu-linear-offset 1.0", "--glu-linear-offset needs a gated MLP"),
    ("--activation-func-clamp-value 7", "--activation-func-clamp-value needs a gated MLP"),
    ("--window-size 127", "--window-size takes two integers"),
    ("--window-attn-skip-freq 2", "--window-attn-skip-freq needs --window-size"),
    ("--window-size 3,0 --window-attn-skip-freq [1,0,1]", "has 3 entries, --num-layers is 2"),
    ("--yarn-beta-fast 32", "--yarn-beta-fast needs --position-embedding-type yarn"),
    ("--softmax-type learnable --multi-latent-attention", "not wired to --multi-latent-attention"),
])
def test_refusals_name_the_flag(extra, message, capsys):
    from megatron_moe.arguments import parse_args

    with pytest.raises(SystemExit) as exit_:
        parse_args(BASE + extra.split(), world_size=1)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and message in err and err.count("error:") == 1, err
