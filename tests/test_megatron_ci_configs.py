"""Megatron-LM's own MoE pretraining functional-test configs (tests/data/
megatron_moe_functional_configs.json, read from Megatron-LM at the release it names by
tools/extract_megatron_moe_configs.py) go through our parser and validation as given.

The CPU substitutions, and only these: ``--transformer-impl transformer_engine`` -> ``local``,
``--distributed-backend nccl`` -> ``gloo``, data/tokenizer paths -> ``--mock-data``, the run's
directories -> a temporary one, and a GPU-only feature is dropped *after* the parser refused it
with one line naming it (so the refusal itself is tested too). The same holds for what needs a
package or a megatron-core release this environment lacks (Muon: emerging-optimizers;
--verify-integrity: megatron-core >= 0.19).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re

import pytest

from megatron_moe.arguments import parse_args
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
    "--use-megatron-fsdp": "FSDP", "--data-parallel-sharding-strategy": "FSDP",
    "--outer-dp-sharding-strategy": "FSDP", "--megatron-fsdp-main-params-dtype": "FSDP",
    "--megatron-fsdp-main-grads-dtype": "FSDP", "--megatron-fsdp-grad-comm-dtype": "FSDP",
    "--ckpt-format": "fsdp_dtensor",
    "--attention-backend": "Transformer Engine",
    "--overlap-moe-expert-parallel-comm": "needs CUDA",
    "--fine-grained-activation-offloading": "needs CUDA", "--offload-modules": "needs CUDA",
    "--use-transformer-engine-op-fuser": "needs CUDA",
    "--delay-wgrad-compute": "needs CUDA",
}
MISSING_HERE = {
    "--optimizer": "emerging-optimizers", "--muon-momentum": "emerging-optimizers",
    "--muon-extra-scale-factor": "emerging-optimizers", "--muon-scale-mode": "emerging-optimizers",
    "--verify-integrity": "megatron-core >= 0.19",
}
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
        for var in ("CHECKPOINT_SAVE_PATH", "CHECKPOINT_LOAD_PATH", "TENSORBOARD_PATH"):
            value = value.replace("${%s}" % var, os.path.join(tmp, var.lower()))
        out.append([key, value])
    return out


def try_parse(model_args):
    """None when parse + validation accept the config, else the refusal text (stderr)."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            parse_args(command_line(model_args) + ["--mock-data"], world_size=WORLD_SIZE)
    except SystemExit:
        return err.getvalue()
    return None


def peel_cpu(model_args):
    """Parse; each refusal must be one line naming a GPU-only flag (or entry) of the config,
    which is then dropped. Returns (dropped flags, final refusal or None)."""
    dropped = []
    for _ in range(len(model_args) + 1):
        refusal = try_parse(model_args)
        if refusal is None:
            return dropped, None
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
        expected = GPU_ONLY.get(flag) or MISSING_HERE.get(flag)
        if expected is None or expected not in message:
            return dropped, message
        model_args = [p for p in model_args if p[0] != flag]
        dropped.append(flag)
    return dropped, "did not converge"


CONFIGS = load_configs()


def test_data_file_is_megatrons_51_moe_pretraining_configs():
    assert CONFIGS["release"] == "core_v0.19.0"
    assert re.fullmatch(r"[0-9a-f]{40}", CONFIGS["commit"])
    configs = CONFIGS["configs"]
    assert len(configs) == 51
    # every one sets the logging flags Megatron's CI sets on every run
    for name, cfg in configs.items():
        keys = {k for k, _ in cfg["model_args"]}
        assert {"--log-params-norm", "--log-num-zeros-in-grad", "--num-experts"} <= keys, name


def test_command_line_follows_megatrons_runner():
    assert command_line([["--a", "true"], ["--b", "[x y]"], ["--c", "([0]*1+[1]*15)"],
                         ["--d", ""], ["--e", "1e-6"]]) == \
        ["--a", "--b", "x", "y", "--c", "([0]*1+[1]*15)", "--e", "1e-6"]


@pytest.mark.parametrize("name", sorted(CONFIGS["configs"]))
def test_config_parses_on_cpu_with_only_documented_substitutions(name, tmp_path):
    model_args = cpu_model_args(CONFIGS["configs"][name]["model_args"], str(tmp_path))
    dropped, refusal = peel_cpu(model_args)
    assert refusal is None, f"{name}: refused after dropping {dropped}: {refusal}"
    # nothing dropped that the config does not set, and only GPU-only / missing-package flags
    keys = {k for k, _ in CONFIGS["configs"][name]["model_args"]}
    for item in dropped:
        flag = item.split()[0]
        assert flag in keys and (flag in GPU_ONLY or flag in MISSING_HERE
                                 or flag in GPU_ONLY_ENTRIES), item


def test_a_refusal_outside_the_gpu_only_list_fails_the_peel(monkeypatch):
    """Mutation: --log-params-norm refused again (as before issue 39) stops the config."""
    from megatron_moe import arguments

    name = "gpt3_mcore_te_tp2_pp1_te_8experts2parallel_dist_optimizer"
    model_args = cpu_model_args(CONFIGS["configs"][name]["model_args"], "/tmp/unused")
    assert peel_cpu([list(p) for p in model_args]) == ([], None)
    original = arguments.validate_megatron_ci_args

    def refuse_params_norm(args):
        if args.log_params_norm:
            raise ValueError("--log-params-norm is refused: this logging option is not implemented")
        original(args)

    monkeypatch.setattr(arguments, "validate_megatron_ci_args", refuse_params_norm)
    dropped, refusal = peel_cpu([list(p) for p in model_args])
    assert refusal is not None and "--log-params-norm" in refusal
