"""Qwen3-MoE: Megatron-LM's Qwen3-30B-A3B configuration with the sizes overridden
(examples/train_qwen3_30b_a3b_cpu.sh) on 2 CPU ranks: EP=2 with exact resume through the script
itself and generation with tools/generate.py; TP=2 and PP=2; the QK layernorm and --kv-channels
really in the model; tools/report_theoretical_memory.py's QK-norm term against measured tensors.
"""

import os
import re
import subprocess
import sys

import pytest

from megatron_moe.runtime.local_ranks import free_port, run_distributed
from tests import _data_helpers as H
from tests._ckpt_cases import run_pretrain_sequence
from tests._train_cases import generate_cli, run_pretrain

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "examples", "train_qwen3_30b_a3b_cpu.sh")
ITERS = 4


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """A byte-level BPE HuggingFace tokenizer (Qwen's kind) and a .bin/.idx corpus made with it."""
    from tools import preprocess_data

    d = tmp_path_factory.mktemp("qwen3")
    corpus = str(d / "corpus.jsonl")
    docs = H.write_corpus(corpus, max_docs=120)
    tok = H.train_hf_bytelevel(docs, str(d / "tokenizer"), 400, "<|endoftext|>",
                               tokenizer_class="PreTrainedTokenizerFast")
    prefix = str(d / "corpus")
    preprocess_data.main(["--input", corpus, "--output-prefix", prefix, "--tokenizer-type",
                          "HuggingFaceTokenizer", "--tokenizer-model", tok, "--no-progress",
                          "--log-interval", "0", "--append-eod"])
    return dict(dir=d, tok=tok, data=prefix + "_text_document")


def script_argv(data, ckpt):
    """The flags the CPU script hands pretrain_gpt_moe.py (a fake torchrun on PATH records them)."""
    fake = data["dir"] / "bin"
    fake.mkdir(exist_ok=True)
    dump = data["dir"] / "argv"
    (fake / "python").write_text(f'#!/usr/bin/env bash\nprintf "%s\\0" "$@" > {dump}\n')
    (fake / "python").chmod(0o755)
    subprocess.run(["bash", SCRIPT, ckpt, data["tok"], data["data"]], check=True, timeout=60,
                   env=dict(os.environ, PYTHON=str(fake / "python")), capture_output=True)
    argv = dump.read_bytes().decode().split("\0")[:-1]
    return argv[argv.index(os.path.join(ROOT, "pretrain_gpt_moe.py")) + 1:]


def run_script(data, ckpt, *extra, timeout=300):
    env = dict(os.environ, PYTHON=sys.executable, PYTHONPATH=ROOT, OMP_NUM_THREADS="1",
               MASTER_PORT=str(free_port()))
    return subprocess.run(["bash", SCRIPT, ckpt, data["tok"], data["data"], *extra],
                          capture_output=True, text=True, timeout=timeout, env=env)


def _log(stdout, field):
    return [m.group(1) for m in re.finditer(rf"\| {field}: ([^ ]+) \|", stdout)]


@pytest.fixture(scope="module")
def trained(data):
    """Train ITERS in-process (float losses); train half and resume through the script (CLI)."""
    full_ckpt, ckpt = str(data["dir"] / "full"), str(data["dir"] / "resumed")
    # both in-process runs in the same two ranks (one process start for the pair)
    full, first = run_distributed(run_pretrain_sequence, 2, [
        script_argv(data, full_ckpt) + ["--train-iters", str(ITERS), "--save-interval", str(ITERS)],
        script_argv(data, ckpt) + ["--train-iters", str(ITERS), "--exit-interval", str(ITERS // 2)],
    ], timeout_s=500)[0]
    resumed = run_script(data, ckpt, "--train-iters", str(ITERS))
    return dict(full=full, first=first, resumed=resumed, full_ckpt=full_ckpt, ckpt=ckpt)


def test_script_trains_and_resumes_exactly(trained):
    full, first, out = trained["full"], trained["first"], trained["resumed"]
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    losses = full["lm_loss"]
    assert all(l == l for l in losses) and losses[-1] < losses[0] - 0.05, losses
    half = ITERS // 2
    assert first["lm_loss"] == losses[:half] and first["grad_norm"] == full["grad_norm"][:half]
    # the resumed CLI run continues at iteration half+1 with the uninterrupted run's numbers
    assert re.search(rf"iteration +{half + 1}/ +{ITERS} \|", out.stdout), out.stdout[-2000:]
    assert _log(out.stdout, "lm loss") == [f"{l:.6E}" for l in losses[half:]]
    assert _log(out.stdout, "grad norm") == [f"{g:.3f}" for g in full["grad_norm"][half:]]


def test_checkpoint_holds_qk_layernorm_and_kv_channels(trained):
    from tools.checkpoint_info import inspect

    info = inspect(os.path.join(trained["full_ckpt"], f"iter_{ITERS:07d}"))
    assert info["complete"], info["problems"]
    shapes = {t["name"]: t["shape"] for t in info["tensors"]}
    heads, groups, kv, hidden = 4, 2, 32, 64
    qkv = [s for n, s in shapes.items() if n.endswith("self_attention.linear_qkv.weight")]
    assert qkv and all(s[-2:] == [(heads + 2 * groups) * kv, hidden] for s in qkv), qkv
    for which in ("q_layernorm", "k_layernorm"):
        norms = [s for n, s in shapes.items() if n.endswith(f"self_attention.{which}.weight")]
        assert norms and all(s[-1] == kv for s in norms), (which, shapes.keys())
    assert not [n for n in shapes if "shared_expert" in n]                 # Qwen3: none
    assert info["args"]["moe_router_dtype"] == "fp32" and info["args"]["qk_layernorm"]


def test_generate_from_the_resumed_checkpoint(trained):
    text, logps = generate_cli(trained["ckpt"], "The module", tokens=6)
    assert 1 <= len(logps) <= 6 and all(v <= 0 for v in logps), (text, logps)


@pytest.mark.parametrize("layout", [
    "--tensor-model-parallel-size 2 --sequence-parallel --expert-model-parallel-size 1",
    "--pipeline-model-parallel-size 2 --expert-model-parallel-size 1",
], ids=["tp2", "pp2"])
def test_tensor_and_pipeline_parallel(data, layout, tmp_path):
    history = run_distributed(run_pretrain, 2, script_argv(data, str(tmp_path / "c"))
                              + ["--train-iters", "3"] + layout.split(), timeout_s=400)[0]
    losses = history["lm_loss"]
    assert all(l == l for l in losses) and losses[-1] < losses[0], losses


def test_memory_tool_counts_qk_layernorm():
    """The estimate's QK-norm term == the measured difference of a model with and without it
    (weights exactly; the norms' saved activations within the tool's activation tolerance)."""
    from tests.test_theoretical_memory import ACT_TOLERANCE, TINY, _measure_rank
    from tools import report_theoretical_memory as rtm

    base = TINY + "--kv-channels 32 --group-query-attention --num-query-groups 2".split()
    argvs = {"plain": base, "qk": base + ["--qk-layernorm"]}
    measured = run_distributed(_measure_rank, 1, argvs, timeout_s=300)[0]
    est = {}
    for name, argv in argvs.items():
        args, _ = rtm.parse(argv + ["--world-size", "1", "--attention-backend", "unfused"])
        est[name] = rtm.estimate(args)
    d_params = measured["qk"]["n_params"] - measured["plain"]["n_params"]
    assert d_params == 2 * 2 * 32                  # 2 layers x (q, k) x kv-channels (RMSNorm)
    assert est["qk"]["params"] - est["plain"]["params"] == 4 * d_params     # fp32 bytes
    d_act = measured["qk"]["activations"] - measured["plain"]["activations"]
    d_est = est["qk"]["activations"] - est["plain"]["activations"]
    assert d_act > 0 and abs(d_est / d_act - 1) <= ACT_TOLERANCE, (d_act, d_est)


@pytest.mark.parametrize("features", [
    "--moe-balance-policy proprophet --moe-permute-fusion --moe-a2a-algorithm hierarchical "
    "--ranks-per-node 1",
    "--moe-router-topology node_limited --ranks-per-node 1 --moe-router-max-nodes 1 "
    "--embedding-partition hidden",
    "--moe-expert-offload host",
], ids=["balance+fused-permute+hierarchical-a2a", "topology-routing+embedding-partition",
        "expert-offload"])
def test_project_features_with_qwen3(data, features, tmp_path):
    """This project's MoE features on the Qwen3 layer (QK norm, fp32 router, fine-grained top-8)."""
    history = run_distributed(run_pretrain, 2, script_argv(data, str(tmp_path / "c"))
                              + ["--train-iters", "3"] + features.split(), timeout_s=400)[0]
    assert len(history["lm_loss"]) == 3 and all(l == l for l in history["lm_loss"])
