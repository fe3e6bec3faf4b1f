#!/usr/bin/env python
"""Read Megatron-LM's MoE pretraining functional-test configs into this repo's data file.

    python tools/extract_megatron_moe_configs.py --git-dir /path/to/Megatron-LM/.git \
        --ref core_v0.19.0 --output tests/data/megatron_moe_functional_configs.json

Also recorded: the model confs of Qwen3-235B-A22B, DeepSeek-R1 and Kimi-K2
(``examples/post_training/modelopt/conf``, their ``MODEL_ARGS`` words) under ``model_confs``.

With ``--static-inference-output FILE``: the MoE configs that Megatron's CI runs through its static
generation script (``examples/inference/advanced/gpt_static_inference.py``: the test cases of
``tests/test_utils/recipes/h100/moe-static-inference.yaml``), as ``MODEL_ARGS`` pairs with the
recipe's script path (tests/data/megatron_moe_static_inference_configs.json; docs/inference.md).

With ``--reruns-output FILE``: the rerun engine's flags (``--rerun-mode``, ``--error-injection-*``,
...) of Megatron-LM's ``tests/functional_tests/test_cases/gpt/gpt3_mcore_reruns_*`` configs
(tests/data/megatron_reruns_configs.json; docs/checkpoints.md, "Result validation").

Source: ``tests/functional_tests/test_cases/moe/*/model_config.yaml`` at ``--ref`` (read with
``git show``, no checkout needed). A pretraining config is one without a ``MODE`` key (the others
are Megatron's inference and RL tests). Recorded per config: its ``TEST_TYPE`` and its
``MODEL_ARGS`` as (flag, value) pairs with every scalar kept as the YAML text (PyYAML's
BaseLoader, as Megatron's runner reads them through ``yq``); ``command_line()`` turns them into
the argv that Megatron's runner (``shell_test_utils/_run_training.sh``) builds: ``true`` -> the
bare flag, ``[a, b]`` -> ``a b``, anything else -> one argument. Data, never code: nothing of
Megatron-LM is executed.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys

CASES_DIR = "tests/functional_tests/test_cases/moe"


def _git(git_dir: str, *args: str) -> str:
    return subprocess.run(["git", f"--git-dir={git_dir}", *args], check=True,
                          capture_output=True, text=True).stdout


def read_configs(git_dir: str, ref: str) -> dict:
    import yaml

    names = _git(git_dir, "ls-tree", "--name-only", f"{ref}:{CASES_DIR}").split()
    configs = {}
    for name in sorted(names):
        text = _git(git_dir, "show", f"{ref}:{CASES_DIR}/{name}/model_config.yaml")
        data = yaml.load(text, Loader=yaml.BaseLoader)  # every scalar as its YAML text
        if "MODE" in data:   # inference / RL tests, not pretraining
            continue
        configs[name] = {"test_type": data.get("TEST_TYPE"),
                         "model_args": [[key, value] for key, value in data["MODEL_ARGS"].items()]}
    return configs


MODEL_CONFS = ("examples/post_training/modelopt/conf/Qwen/Qwen3-235B-A22B.sh",
               "examples/post_training/modelopt/conf/deepseek-ai/DeepSeek-R1.sh",
               "examples/post_training/modelopt/conf/moonshotai/Kimi-K2-Instruct.sh")


def read_model_confs(git_dir: str, ref: str) -> dict:
    """{conf path: argv} of Megatron's model confs: the words of their MODEL_ARGS="..." string."""
    import shlex

    out = {}
    for path in MODEL_CONFS:
        text = _git(git_dir, "show", f"{ref}:{path}")
        body = re.search(r'MODEL_ARGS="(.*?)"', text, re.S).group(1)
        out[path] = shlex.split(body.replace("\\\n", " "))
    return out


RERUNS_DIR = "tests/functional_tests/test_cases/gpt"
RERUN_FLAGS = ("--rerun-mode", "--error-injection-rate", "--error-injection-type",
               "--check-for-spiky-loss", "--check-for-large-grads",
               "--result-rejected-tracker-filename", "--no-check-for-nan-in-loss-and-grad")


def read_rerun_configs(git_dir: str, ref: str) -> dict:
    """{name: {test_type, argv}} of the gpt3_mcore_reruns_* configs: their rerun engine flags only
    (the rest is a 4k-sequence GPT on Transformer Engine, not this repo's subject). A config whose
    MODEL_ARGS come through a YAML merge key (``<<: *BASE``) has none at the top level: empty."""
    import yaml

    names = _git(git_dir, "ls-tree", "--name-only", f"{ref}:{RERUNS_DIR}").split()
    out = {}
    for name in sorted(n for n in names if n.startswith("gpt3_mcore_reruns")):
        text = _git(git_dir, "show", f"{ref}:{RERUNS_DIR}/{name}/model_config.yaml")
        data = yaml.load(text, Loader=yaml.BaseLoader)
        pairs = [(k, v) for k, v in data.get("MODEL_ARGS", {}).items() if k in RERUN_FLAGS]
        out[name] = {"test_type": data.get("TEST_TYPE"), "argv": command_line(pairs)}
    return out


STATIC_INFERENCE_RECIPE = "tests/test_utils/recipes/h100/moe-static-inference.yaml"


def read_static_inference_configs(git_dir: str, ref: str) -> dict:
    """{name: {test_type, script, model_args}} of the MoE configs Megatron's static-inference
    recipe runs (its ``products`` list), read as ``read_configs`` reads the pretraining ones."""
    import yaml

    recipe = yaml.load(_git(git_dir, "show", f"{ref}:{STATIC_INFERENCE_RECIPE}"),
                       Loader=yaml.BaseLoader)
    script = re.search(r"TRAINING_SCRIPT_PATH=(\S+?)\"", recipe["spec"]["script"]).group(1)
    names = [n for product in recipe["products"] for n in product["test_case"]]
    out = {}
    for name in names:
        text = _git(git_dir, "show", f"{ref}:{CASES_DIR}/{name}/model_config.yaml")
        data = yaml.load(text, Loader=yaml.BaseLoader)
        out[name] = {"test_type": data.get("TEST_TYPE"), "script": script,
                     "model_args": [[key, value] for key, value in data["MODEL_ARGS"].items()]}
    return out


def command_line(model_args) -> list[str]:
    """Megatron's runner rule (``_run_training.sh``): the argv of one config's MODEL_ARGS."""
    argv = []
    for key, value in model_args:
        if value == "":
            continue
        if value == "true":
            argv.append(key)
        elif re.fullmatch(r"\[[^]]+\]", value):
            argv += [key] + value[1:-1].replace(",", " ").split()
        else:
            argv += [key, value]
    return argv


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--git-dir", required=True, help="Megatron-LM's git directory (a bare mirror works)")
    p.add_argument("--ref", default="core_v0.19.0")
    p.add_argument("--output", required=True)
    p.add_argument("--reruns-output", default=None,
                   help="also write the gpt3_mcore_reruns_* configs' rerun flags here")
    p.add_argument("--static-inference-output", default=None,
                   help="also write the MoE static-inference configs here")
    args = p.parse_args(argv)
    commit = _git(args.git_dir, "rev-parse", f"{args.ref}^{{commit}}").strip()

    def write(path, source, configs, **more):
        doc = {"repository": "NVIDIA/Megatron-LM", "release": args.ref, "commit": commit,
               "source": source, "configs": configs, **more}
        with open(path, "w") as f:
            json.dump(doc, f, indent=1)
            f.write("\n")
        return doc

    if args.reruns_output:
        write(args.reruns_output, f"{RERUNS_DIR}/gpt3_mcore_reruns_*/model_config.yaml (MODEL_ARGS: "
                                  f"the rerun engine's flags)",
              read_rerun_configs(args.git_dir, args.ref))
    if args.static_inference_output:
        write(args.static_inference_output,
              f"{STATIC_INFERENCE_RECIPE} (products) -> {CASES_DIR}/<name>/model_config.yaml "
              f"(MODEL_ARGS)", read_static_inference_configs(args.git_dir, args.ref))
    out = write(args.output, f"{CASES_DIR}/*/model_config.yaml (MODEL_ARGS, configs without MODE)",
                read_configs(args.git_dir, args.ref),
                model_confs=read_model_confs(args.git_dir, args.ref))
    print(f"{len(out['configs'])} configs from {args.ref} ({commit[:12]}) -> {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
