"""Megatron-LM's MoE static-inference CI configs, as written, through tools/generate.py on a CPU.

Megatron's CI runs three MoE configs through its static generation script
(``examples/inference/advanced/gpt_static_inference.py``; tests/data/
megatron_moe_static_inference_configs.json, read by tools/extract_megatron_moe_configs.py): a
DeepSeek-16B-like model (64 experts top-6, sigmoid scores, shared experts, grouped GEMM, RoPE,
RMSNorm, bf16, TikTokenizer) at TP1/EP1, at TP4 x EP4 with sequence parallelism, and with CUDA
graphs. Their command lines are used as the pretraining configs' are (tests/
test_megatron_ci_configs.py): Transformer Engine -> local, nccl -> gloo, the ``${...}`` paths into a
temporary directory, sizes made tiny; each remaining refusal must be one line naming a GPU-only
flag (flash decoding, CUDA graphs). The checkpoint under the config's ``--load`` path is a 3-iteration
training run of the same architecture, its tokenizer a tiktoken vocabulary at the config's
``--tokenizer-model`` path.
"""

import json
import os

import pytest

from megatron_moe.runtime.local_ranks import run_distributed
from tests import _megatron_inference_configs as I
from tests._train_cases import run_pretrain
from tools.extract_megatron_moe_configs import command_line

TP1 = "gpt_static_inference_tp1_pp1_ep1_16B_logitsmatch"
TP4 = "gpt_static_inference_tp4_pp1_ep4_16B_logitsmatch"
GRAPHS = "gpt_static_inference_cuda_graphs_pad_tp4_pp1_ep4_16B_logitsmatch"


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The tiny checkpoint at the configs' --load path, its tokenizer at their --tokenizer-model."""
    tmp = str(tmp_path_factory.mktemp("static_inference"))
    a = dict(I.tiny_args(TP1, tmp))
    vocab = I.write_tokenizer(a["--tokenizer-model"])
    pairs = I.peel_cpu(I.tiny_args(TP1, tmp), 1)  # the refusals come after the checkpoint's read
    assert pairs[1] is not None and "--load" in pairs[1]
    run_distributed(run_pretrain, 1, I.training_argv(I.tiny_args(TP1, tmp), a["--load"], vocab),
                    timeout_s=300)
    return tmp


def test_the_three_configs_parse_with_only_gpu_flags_refused(trained):
    configs = I.load_configs()
    assert sorted(configs) == sorted([TP1, TP4, GRAPHS])
    assert {c["script"] for c in configs.values()} == {
        "examples/inference/advanced/gpt_static_inference.py"}
    dropped = {}
    for name in configs:
        pairs = I.tiny_args(name, trained)
        flags, refusal, _ = I.peel_cpu(pairs, I.world_size_of(pairs))
        assert refusal is None, (name, refusal)
        dropped[name] = flags
    assert dropped[TP1] == dropped[TP4] == ["--flash-decode"]
    assert sorted(dropped[GRAPHS]) == sorted(["--flash-decode", "--cuda-graph-impl",
                                              "--inference-rng-tracker",
                                              "--moe-pad-experts-for-cuda-graph-inference"])


@pytest.fixture(scope="module")
def runs(trained):
    tiny = {name: I.tiny_args(name, trained) for name in (TP1, TP4)}
    pairs = {name: I.peel_cpu(args, I.world_size_of(args))[2] for name, args in tiny.items()}
    a = dict(pairs[TP1])
    out = {}
    for name in (TP1, TP4):
        argv = command_line(pairs[name])
        rc, printed = run_distributed(I.generate_rank, I.world_size_of(pairs[name]), argv,
                                      timeout_s=400)[0]
        assert rc == 0, printed
        with open(dict(pairs[name])["--output-path"]) as f:
            out[name] = dict(json.load(f), printed=printed)
    skip = command_line(pairs[TP1]) + ["--skip-prompt-log-probs", "--top-n-logprobs", "2"]
    rc, _ = run_distributed(I.generate_rank, 1, skip, timeout_s=300)[0]
    with open(a["--output-path"]) as f:
        out["skip"] = json.load(f)
    return out


def test_output_file_is_megatrons_and_holds_what_was_generated(runs):
    doc = runs[TP1]
    entry = doc["0"]
    assert set(entry) == {"input_prompt", "generated_text", "generated_tokens", "tpot", "latency",
                          "logprobs"}
    assert entry["input_prompt"].startswith("Time travel to 2008")
    n = len(entry["generated_tokens"])
    assert 0 < n <= 30 and len(entry["tpot"]) == n and entry["latency"] > 0
    # the printed generation (tools/generate.py's own lines) is what the file holds: the prompt's
    # log probs (tokens 2..p) then the generated tokens', as Megatron's script concatenates them
    lines = doc["printed"].splitlines()
    printed = [float(v) for v in next(l for l in lines if l.startswith("log probs:")).split()[2:]]
    prompt = [float(v) for v in next(l for l in lines
                                     if l.startswith("prompt log probs:")).split()[3:]]
    assert len(entry["logprobs"]) == len(prompt) + n and len(printed) == n
    assert entry["logprobs"] == pytest.approx(prompt + printed, abs=1e-4)  # printed to 4 places


def test_skip_prompt_log_probs_and_top_n(runs):
    full, skip = runs[TP1]["0"], runs["skip"]["0"]
    n = len(full["generated_tokens"])
    assert skip["generated_tokens"] == full["generated_tokens"]
    assert skip["logprobs"] == pytest.approx(full["logprobs"][-n:], abs=1e-6)
    top = skip["generated_top_n_logprobs"]
    assert len(top) == n and all(len(d) == 2 for d in top)
    # the generated (greedy) token is the most likely one: its log prob is the top one's
    assert [max(d.values()) for d in top] == pytest.approx(skip["logprobs"], abs=1e-5)


def test_tp4_ep4_on_four_ranks_equals_tp1_on_one(runs):
    one, four = runs[TP1]["0"], runs[TP4]["0"]
    assert four["generated_tokens"] == one["generated_tokens"]
    assert max(abs(x - y) for x, y in zip(one["logprobs"], four["logprobs"])) < 5e-3  # bf16
    assert len(four["logprobs"]) == len(one["logprobs"])
