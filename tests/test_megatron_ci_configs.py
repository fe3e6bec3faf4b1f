"""Megatron-LM's own MoE pretraining functional-test configs (tests/data/
megatron_moe_functional_configs.json, read from Megatron-LM at the release it names by
tools/extract_megatron_moe_configs.py) go through our parser and validation as given.

The CPU substitutions, and only these: ``--transformer-impl transformer_engine`` -> ``local``,
``--distributed-backend nccl`` -> ``gloo``, data/tokenizer paths -> ``--mock-data``, the run's
directories -> a temporary one, and a GPU-only feature is dropped *after* the parser refused it
with one line naming it (so the refusal itself is tested too). The same holds for what needs a
package or a megatron-core release this environment lacks (Muon: megatron-core >= 0.19 with
emerging-optimizers, where Megatron's 6 Muon configs keep --optimizer muon and its --muon-* flags;
--verify-integrity: megatron-core >= 0.19).
"""

from __future__ import annotations

import re

import pytest

from tests._megatron_ci_configs import (GPU_ONLY, GPU_ONLY_ENTRIES, MISSING_HERE, cpu_model_args,
                                        load_configs, muon_runs_here, peel_cpu)
from tools.extract_megatron_moe_configs import command_line

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
    dropped, refusal, _ = peel_cpu(model_args)
    assert refusal is None, f"{name}: refused after dropping {dropped}: {refusal}"
    # nothing dropped that the config does not set, and only GPU-only / missing-package flags
    keys = {k for k, _ in CONFIGS["configs"][name]["model_args"]}
    for item in dropped:
        flag = item.split()[0]
        assert flag in keys and (flag in GPU_ONLY or flag in MISSING_HERE
                                 or flag in GPU_ONLY_ENTRIES), item
    if muon_runs_here():  # Muon is kept: megatron-core's Muon gets the config's --muon-* values
        assert "--optimizer" not in dropped, dropped


def test_megatrons_muon_configs_keep_muon_where_megatron_core_has_it(tmp_path):
    """Megatron's 6 Muon configs: on megatron-core >= 0.19 with emerging-optimizers, parsed with
    --optimizer muon and its --muon-* values (and the layer-wise distributed optimizer for the
    dist_muon ones); elsewhere --optimizer is the one flag peeled for Muon."""
    from megatron_moe.arguments import parse_args

    muon = sorted(n for n in CONFIGS["configs"] if "muon" in n)
    assert len(muon) == 6 and sum("resume_torch_dist_dist_muon" in n for n in muon) == 4
    for name in muon:
        model_args = cpu_model_args(CONFIGS["configs"][name]["model_args"], str(tmp_path))
        dropped, refusal, kept = peel_cpu(model_args)
        assert refusal is None, (name, refusal)
        assert ("--optimizer" in dropped) == (not muon_runs_here()), (name, dropped)
        if muon_runs_here():
            args = parse_args(command_line(kept) + ["--mock-data"], world_size=8)
            assert (args.optimizer, args.muon_momentum, args.muon_extra_scale_factor,
                    args.muon_scale_mode) == ("muon", 0.9, 0.2, "spectral"), name
            layer_wise = "--use-distributed-optimizer" in dict(kept)   # the *_dist_muon* ones
            assert args.use_layer_wise_distributed_optimizer == layer_wise, name
            assert not args.use_distributed_optimizer, name


def test_a_refusal_outside_the_gpu_only_list_fails_the_peel(monkeypatch):
    """Mutation: --log-params-norm refused again (as before issue 39) stops the config."""
    from megatron_moe import arguments

    name = "gpt3_mcore_te_tp2_pp1_te_8experts2parallel_dist_optimizer"
    model_args = cpu_model_args(CONFIGS["configs"][name]["model_args"], "/tmp/unused")
    assert peel_cpu([list(p) for p in model_args])[:2] == ([], None)
    original = arguments.validate_megatron_ci_args

    def refuse_params_norm(args):
        if args.log_params_norm:
            raise ValueError("--log-params-norm is refused: this logging option is not implemented")
        original(args)

    monkeypatch.setattr(arguments, "validate_megatron_ci_args", refuse_params_norm)
    dropped, refusal, _ = peel_cpu([list(p) for p in model_args])
    assert refusal is not None and "--log-params-norm" in refusal
