"""Megatron-LM's MoE static-inference CI configs on a CPU (tests/test_megatron_inference_configs.py):
the CPU substitutions of the pretraining configs, the refusal peel over tools/generate.py's parser,
a tiny checkpoint of the configs' architecture, and the rank function that runs generate.py."""

from __future__ import annotations

import contextlib
import io
import json
import os

from tests import _megatron_ci_configs as C
from tools.extract_megatron_moe_configs import command_line

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(ROOT, "tests", "data", "megatron_moe_static_inference_configs.json")

# flag -> a word its one-line CPU refusal from generate.py must contain
GPU_ONLY = {"--flash-decode": "needs CUDA", "--cuda-graph-impl": "needs CUDA",
            "--inference-rng-tracker": "needs CUDA",
            "--moe-pad-experts-for-cuda-graph-inference": "needs CUDA"}

# sizes only (the configs' 27-layer, 64-expert DeepSeek-16B made tiny): every other flag is kept
TINY = dict(C.TINY_SIZES, **{"--num-layers": "2", "--num-experts": "8", "--seq-length": "512",
                            "--max-position-embeddings": "512",
                            "--inference-max-seq-length": "512"})


def load_configs() -> dict:
    with open(DATA) as f:
        return json.load(f)["configs"]


def tiny_args(name: str, tmp: str) -> list:
    """The config's MODEL_ARGS pairs with the CPU substitutions and tiny sizes."""
    pairs = C.cpu_model_args(load_configs()[name]["model_args"], tmp)
    return [[k, TINY.get(k, v)] for k, v in pairs]


def world_size_of(pairs) -> int:
    a = dict(pairs)
    return int(a.get("--tensor-model-parallel-size", 1)) * int(a.get("--pipeline-model-parallel-size", 1))


def try_parse(pairs, world_size: int):
    """None when generate.py's parser and validation accept the command line, else the error."""
    from megatron_moe.inference.arguments import parse_inference_args
    from tools.generate import add_generate_args, validate_generate_args

    err = io.StringIO()
    saved = os.environ.get("WORLD_SIZE")
    os.environ["WORLD_SIZE"] = str(world_size)
    try:
        with contextlib.redirect_stderr(err):
            parse_inference_args(command_line(pairs), add_generate_args, prog="generate.py",
                                 validate_tool=validate_generate_args)
    except SystemExit:
        return err.getvalue()
    finally:
        if saved is None:
            os.environ.pop("WORLD_SIZE")
        else:
            os.environ["WORLD_SIZE"] = saved
    return None


def peel_cpu(pairs, world_size: int):
    """The pretraining configs' refusal peel (tests/_megatron_ci_configs.py) over generate.py."""
    return C.peel_cpu(pairs, world_size, parse=try_parse, gpu_only=GPU_ONLY)


def training_argv(pairs, save: str, vocab_size: int) -> list:
    """A short pretraining run of the configs' architecture: the config's flags that the training
    parser accepts (generation's own and the load flags left out), plus a schedule and --save."""
    from megatron_moe.arguments import build_parser

    options = build_parser()._option_string_actions
    skip = {"--load", "--use-checkpoint-args", "--no-use-tokenizer-model-from-checkpoint-args",
            "--no-load-optim", "--ckpt-assume-constant-structure"}
    kept = [[k, v] for k, v in pairs if k in options and k not in skip
            and getattr(options[k], "megatron_status", "") != "refused"]
    return command_line(kept) + [
        "--mock-data", "--vocab-size", str(vocab_size), "--seq-length", "64",
        "--train-iters", "3", "--eval-iters", "1", "--global-batch-size", "2", "--lr", "1e-3",
        "--num-workers", "0", "--save", save]   # the configs' 8 loader workers: start-up only


def write_tokenizer(path: str) -> int:
    """Megatron's tiktoken JSON vocabulary at the config's --tokenizer-model path; the
    --vocab-size that holds it with TikTokenizer's 1000 special tokens."""
    from tests import _data_helpers as H

    os.makedirs(os.path.dirname(path), exist_ok=True)
    docs = [f"Time travel to {1990 + i}, and go to a bar or a club on the Lower East Side of "
            f"New York like the movies." for i in range(200)]
    H.write_tiktoken_vocab(docs, path, 300)
    with open(path) as f:
        return 1000 + len(json.load(f))


def generate_rank(rank, world_size, argv):
    """tools/generate.py's main(argv) on this rank: (exit code, what it printed)."""
    from tools import generate

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = generate.main(argv)
    return rc, out.getvalue()
