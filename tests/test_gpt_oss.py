"""gpt-oss: Megatron-LM's gpt-oss-20b configuration with the sizes overridden
(examples/train_gpt_oss_20b_cpu.sh) on 2 CPU ranks at EP=2; its features really act (sinks get
gradients and move, windowed layers see only the window, full layers everything); the flags'
refusals.
"""

import os
import subprocess

import pytest

from megatron_moe.runtime.local_ranks import run_distributed
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


# --- Hugging Face interop (tools/checkpoint/convert.py, megatron_moe/hf/families.py GptOss) -------
HF_TOL = dict(rtol=1e-5, atol=1e-5)   # fp32
HF_LAYOUTS = ["--expert-model-parallel-size 2",
              "--tensor-model-parallel-size 2 --sequence-parallel --expert-model-parallel-size 2 "
              "--expert-tensor-parallel-size 1"]


def make_gpt_oss(path):
    """A tiny random GptOssForCausalLM: window 4 (< the 16 test tokens) on layer 0, full layer 1;
    swiglu_limit 0.5 so that the clamp bites; YaRN factor 8 with an unrounded correction range;
    random (not zero) biases and sinks, so that a lost one shows."""
    import torch
    import transformers

    torch.manual_seed(0)
    cfg = transformers.GptOssConfig(
        vocab_size=250, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        intermediate_size=32, num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2,
        sliding_window=4, max_position_embeddings=256, initializer_range=0.1, swiglu_limit=0.5,
        rope_parameters={"rope_type": "yarn", "factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0,
                         "truncate": False, "original_max_position_embeddings": 32,
                         "rope_theta": 150000.0})
    model = transformers.GptOssForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("bias", "sinks")):
                p.normal_(0.0, 0.5)
            elif name.endswith("layernorm.weight"):
                p.uniform_(0.5, 1.5)
    model.save_pretrained(path, max_shard_size="60KB")


@pytest.fixture(scope="module")
def gpt_oss_hf(tmp_path_factory):
    from tests._hf_cases import pipeline_rank
    from tests.test_hf_convert import TOKENS, convert

    pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("gpt_oss_hf")
    d = {name: str(root / name) for name in ("hf", "meg", "back")}
    make_gpt_oss(d["hf"])
    d["log"] = convert(["--loader", "hf", "--saver", "megatron", "--load-dir", d["hf"],
                        "--save-dir", d["meg"], "--target-expert-parallel-size", "2"],
                       ["--loader", "megatron", "--saver", "hf", "--load-dir", d["meg"],
                        "--save-dir", d["back"], "--max-shard-size", "100KB"])
    _, logits = run_distributed(pipeline_rank, 2, [], [(d["hf"], d["meg"], HF_LAYOUTS, TOKENS)],
                                timeout_s=400)[0]
    d["logits"] = logits[0]
    return d


def _hf_logits(path, mutate=None, **override):
    from tests.test_hf_convert import hf_logits

    return hf_logits(path, mutate, **override)


def test_gpt_oss_roundtrip_bit_exact(gpt_oss_hf):
    from tests.test_hf_convert import assert_roundtrip_bit_exact

    assert_roundtrip_bit_exact(gpt_oss_hf["hf"], gpt_oss_hf["back"], gpt_oss_hf["log"])


def test_gpt_oss_logits_match_transformers(gpt_oss_hf):
    import torch

    d = gpt_oss_hf
    reference = _hf_logits(d["hf"])
    assert reference.abs().max() > 0.5
    for layout, (iteration, logits) in zip(HF_LAYOUTS, d["logits"]):
        assert iteration == 0
        torch.testing.assert_close(logits, reference, **HF_TOL, msg=lambda m: f"{layout!r}: {m}")
        print(f"gpt_oss {layout}: max |ours - transformers| = "
              f"{(logits - reference).abs().max():.2e} (max |logit| {reference.abs().max():.2f})")


def _swap_gate_up_layout(model):
    """gate and up as two blocks instead of interleaved columns (the usual GLU layout)."""
    import torch

    for layer in model.model.layers:
        for name in ("gate_up_proj", "gate_up_proj_bias"):
            p = getattr(layer.mlp.experts, name)
            half = p.shape[-1] // 2
            # what [gate | up] blocks look like when read as interleaved columns
            p.copy_(torch.stack([p[..., :half], p[..., half:]], dim=-1).flatten(-2))


def _no_sinks(model):
    for layer in model.model.layers:
        layer.self_attn.sinks.fill_(-1e4)


@pytest.mark.parametrize("what", ["sinks", "clamp", "gate_up_layout", "window", "yarn_truncate",
                                  "yarn_factor"])
def test_gpt_oss_mutations_break_the_match(gpt_oss_hf, what):
    """Each gpt-oss feature matters in this comparison: HF without it gives other logits."""
    d = gpt_oss_hf
    rope = {"rope_type": "yarn", "factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0,
            "truncate": False, "original_max_position_embeddings": 32, "rope_theta": 150000.0}
    mutated = {
        "sinks": lambda: _hf_logits(d["hf"], mutate=_no_sinks),
        "clamp": lambda: _hf_logits(d["hf"], swiglu_limit=1e9),
        "gate_up_layout": lambda: _hf_logits(d["hf"], mutate=_swap_gate_up_layout),
        "window": lambda: _hf_logits(d["hf"], sliding_window=1000),
        "yarn_truncate": lambda: _hf_logits(d["hf"], rope_parameters=dict(rope, truncate=True)),
        "yarn_factor": lambda: _hf_logits(d["hf"], rope_parameters=dict(rope, factor=1.0)),
    }[what]()
    assert (mutated - d["logits"][0][1]).abs().max() > 1e3 * HF_TOL["atol"], what


def test_gpt_oss_config_generated_from_args_agrees_with_the_original(gpt_oss_hf):
    """The config.json written for a checkpoint trained here (no HF config stored) describes the
    same architecture (--hf-config-template's field-by-field check)."""
    import sys

    from megatron.core import dist_checkpointing

    from megatron_moe.hf.families import FAMILIES, guess_family, spec_from_args

    sys.path.insert(0, os.path.join(ROOT, "tools", "checkpoint"))
    import saver_hf

    d = gpt_oss_hf
    stored = dist_checkpointing.load_common_state_dict(os.path.join(d["meg"], "iter_0000000"))["args"]
    assert guess_family(stored) == "gpt_oss"
    generated = FAMILIES["gpt_oss"].config_from_args(stored, spec_from_args(stored, "gpt_oss", 250),
                                                    "float32")
    saver_hf._from_template(os.path.join(d["hf"], "config.json"), generated)
    assert generated["layer_types"] == ["sliding_attention", "full_attention"]
    assert generated["sliding_window"] == 4 and generated["swiglu_limit"] == 0.5


def test_gpt_oss_refusals():
    from megatron_moe.hf.families import FAMILIES, ConversionError

    base = dict(num_hidden_layers=1, hidden_size=8, num_attention_heads=2, vocab_size=10,
                num_local_experts=2, intermediate_size=4)
    for bad, message in ((dict(quantization_config={"quant_method": "mxfp4"}), "MXFP4"),
                         (dict(swiglu_alpha=1.5), "swiglu_alpha"),
                         (dict(attention_bias=False), "attention_bias=false"),
                         (dict(rope_parameters={"rope_type": "linear", "factor": 2.0}), "rope_type")):
        with pytest.raises(ConversionError, match=message):
            FAMILIES["gpt_oss"].spec_from_config(dict(base, **bad))


def test_gpt_oss_greedy_generation_matches_transformers(gpt_oss_hf):
    """tools/generate.py (megatron-core's static engine: KV cache, the window mask at decode,
    sinks, YaRN) on the converted checkpoint generates transformers' greedy tokens; the prompt
    (10 tokens) and the generation run past the 4-token window."""
    import torch
    import transformers

    from tests._train_cases import generate_cli

    prompt = [5, 17, 33, 101, 7, 9, 200, 3, 44, 12]
    text, logps = generate_cli(gpt_oss_hf["meg"], " ".join(map(str, prompt)), tokens=8)
    ours = [int(t) for t in text.split()]
    model = transformers.AutoModelForCausalLM.from_pretrained(gpt_oss_hf["hf"],
                                                              dtype=torch.float32).eval()
    theirs = model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)[0].tolist()
    assert len(ours) == 18 and len(logps) == 8 and ours == theirs, (ours, theirs)
