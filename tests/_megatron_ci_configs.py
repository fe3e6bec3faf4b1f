"""Megatron-LM's MoE CI configs on a CPU: the documented substitutions (tests/
test_megatron_ci_configs.py's docstring), the refusal peel, and tiny-size training argv."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os
import re

from megatron_moe.compat.versions import mcore_at_least
from tools.extract_megatron_moe_configs import command_line

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(ROOT, "tests", "data", "megatron_moe_functional_configs.json")
WORLD_SIZE = 8   # Megatron's CI runs these on one 8-GPU node

# flag -> a word its one-line CPU refusal must contain
GPU_ONLY = {
    "--moe-grouped-gemm": "CUDA",
    "--fp8-format": "needs CUDA", "--fp8-recipe": "needs CUDA", "--first-last-layers-bf16": "needs CUDA",
    "--fp8-param-gather": "Transformer Engine",
    "--cuda-graph-impl": "needs CUDA", "--cuda-graph-modules": "needs CUDA",
    "--cuda-graph-warmup-steps": "needs CUDA",
    "--attention-backend": "Transformer Engine",
    "--overlap-moe-expert-parallel-comm": "needs CUDA",
    "--fine-grained-activation-offloading": "needs CUDA", "--offload-modules": "needs CUDA",
    "--use-transformer-engine-op-fuser": "needs CUDA",
    "--delay-wgrad-compute": "needs CUDA",
}
# --optimizer muon: refused on megatron-core 0.16.1 (no Muon) and, on 0.19, without the
# emerging-optimizers package; the --muon-* flags themselves always parse (Megatron's shapes)
MISSING_HERE = {
    "--optimizer": "megatron-core >= 0.19",
    "--verify-integrity": "megatron-core >= 0.19",
}
if mcore_at_least("0.19"):
    MISSING_HERE["--optimizer"] = "emerging-optimizers"
else:   # Megatron-FSDP's buffer dtypes are megatron-core 0.19's settings
    MISSING_HERE.update({flag: "0.19 or newer" for flag in (
        "--megatron-fsdp-main-params-dtype", "--megatron-fsdp-main-grads-dtype",
        "--megatron-fsdp-grad-comm-dtype")})


def muon_runs_here() -> bool:
    """megatron-core >= 0.19 with emerging-optimizers: Megatron's Muon configs keep --optimizer muon."""
    return mcore_at_least("0.19") and importlib.util.find_spec("emerging_optimizers") is not None
# list-valued flags: the entry that is GPU-only (dropped from the list, not the whole flag)
GPU_ONLY_ENTRIES = {"--recompute-modules": ("moe_act", "--moe-grouped-gemm")}

_DATA_FLAGS = {"--data-path", "--vocab-file", "--merge-file", "--data-cache-path"}


def load_configs():
    with open(DATA) as f:
        return json.load(f)


def cpu_model_args(model_args, tmp):
    """The documented CPU substitutions (module docstring) on one config's MODEL_ARGS pairs."""
    out = []
    for key, value in model_args:
        if key in _DATA_FLAGS:
            continue
        if key == "--transformer-impl" and value == "transformer_engine":
            value = "local"
        if key == "--distributed-backend" and value == "nccl":
            value = "gloo"
        for var in ("CHECKPOINT_SAVE_PATH", "CHECKPOINT_LOAD_PATH", "TENSORBOARD_PATH",
                    "INFERENCE_OUTPUT_PATH"):
            value = value.replace("${%s}" % var, os.path.join(tmp, var.lower()))
        out.append([key, value])
    return out


def try_parse(model_args, world_size=WORLD_SIZE):
    """None when parse + validation accept the config, else the refusal text (stderr)."""
    from megatron_moe.arguments import parse_args

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            parse_args(command_line(model_args) + ["--mock-data"], world_size=world_size)
    except SystemExit:
        return err.getvalue()
    return None


def peel_cpu(model_args, world_size=WORLD_SIZE, parse=None, gpu_only=None):
    """Parse (``parse``: another entry point's, e.g. generate.py's); each refusal must be one line
    naming a GPU-only flag (or entry) of the config (``gpu_only``: flag -> a word of its refusal),
    which is then dropped. Returns (dropped flags, final refusal or None, the remaining args)."""
    parse = parse or try_parse
    expected_words = {**GPU_ONLY, **MISSING_HERE} if gpu_only is None else gpu_only
    dropped = []
    for _ in range(len(model_args) + 1):
        refusal = parse(model_args, world_size)
        if refusal is None:
            return dropped, None, model_args
        message = refusal.split("error:", 1)[1].splitlines()[0].strip()
        named = re.findall(r"--[a-z0-9][a-z0-9_-]*", message)
        present = [key for key, _ in model_args]
        flag = next((f for f in named if f in present), None)
        if flag in GPU_ONLY_ENTRIES and GPU_ONLY_ENTRIES[flag][0] in message:
            entry = GPU_ONLY_ENTRIES[flag][0]
            for pair in model_args:
                if pair[0] == flag:
                    pair[1] = re.sub(rf"\b{entry}\b", "", pair[1]).replace("[ ", "[").strip()
            model_args = [p for p in model_args if p[1] not in ("[]", "")]
            dropped.append(f"{flag} {entry}")
            continue
        expected = expected_words.get(flag)
        if expected is None or expected not in message:
            return dropped, message, model_args
        model_args = [p for p in model_args if p[0] != flag]
        dropped.append(flag)
    return dropped, "did not converge", model_args




# --- tiny-size training (only sizes overridden; every housekeeping / logging / schedule /
# recompute flag of the config is kept) ---------------------------------------------------------
TINY_SIZES = {"--hidden-size": "32", "--ffn-hidden-size": "64", "--moe-ffn-hidden-size": "32",
              "--moe-shared-expert-intermediate-size": "32", "--num-attention-heads": "4",
              "--kv-channels": "8", "--seq-length": "32", "--max-position-embeddings": "32",
              "--micro-batch-size": "1", "--eval-iters": "1", "--q-lora-rank": "16",
              "--kv-lora-rank": "16", "--qk-head-dim": "8", "--qk-pos-emb-head-dim": "8",
              "--v-head-dim": "8", "--make-vocab-size-divisible-by": "64"}


def world_size_of(model_args) -> int:
    import math

    a = dict(model_args)
    tp, pp = int(a.get("--tensor-model-parallel-size", 1)), int(a.get("--pipeline-model-parallel-size", 1))
    cp, ep = int(a.get("--context-parallel-size", 1)), int(a.get("--expert-model-parallel-size", 1))
    etp = int(a.get("--expert-tensor-parallel-size", tp))
    return math.lcm(tp * pp * cp, etp * ep * pp)


def tiny_training_argv(name, tmp, train_iters=4, without=(), **overrides):
    """(world size, argv) of one CI config on CPU ranks: the documented substitutions and GPU-only
    drops (the refusal peel), then only sizes (and the run's length) overridden. ``without``:
    flags a test removes to show what they do (mutations)."""
    configs = load_configs()["configs"]
    model_args = [p for p in cpu_model_args(configs[name]["model_args"], tmp) if p[0] not in without]
    world = world_size_of(model_args)
    dropped, refusal, model_args = peel_cpu(model_args, world)
    assert refusal is None, refusal
    a = dict(model_args)
    pp = int(a.get("--pipeline-model-parallel-size", 1))
    vpp = int(a.get("--num-virtual-stages-per-pipeline-rank", 1))
    tp, cp = int(a.get("--tensor-model-parallel-size", 1)), int(a.get("--context-parallel-size", 1))
    sizes = dict(TINY_SIZES, **{"--train-iters": str(train_iters)})
    sizes["--global-batch-size"] = str(world // (tp * pp * cp) * 2 * pp)
    if "--num-layers" in a:
        layers = pp * vpp if vpp > 1 else 2 * pp
        sizes["--num-layers"] = str(layers)
        if a.get("--moe-layer-freq", "").startswith("("):
            sizes["--moe-layer-freq"] = f"([0]*1+[1]*{layers - 1})"
    sizes.update(overrides)
    out = [[k, sizes.get(k, v)] for k, v in model_args]
    out += [[k, v] for k, v in overrides.items() if k not in a]
    argv = command_line(out) + ["--mock-data", "--tokenizer-type", "NullTokenizer",
                                "--vocab-size", "256"]
    return world, argv, dropped
