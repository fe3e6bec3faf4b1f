#!/usr/bin/env python
"""Convert checkpoints between Hugging Face and Megatron (Megatron-LM's tools/checkpoint/convert.py).

    python tools/checkpoint/convert.py --model-type GPT --loader hf --saver megatron \
        --load-dir Mixtral-8x7B --save-dir ckpt/mixtral --target-tensor-parallel-size 2 \
        --target-expert-parallel-size 8
    python tools/checkpoint/convert.py --model-type GPT --loader megatron --saver hf \
        --load-dir ckpt/mixtral --save-dir Mixtral-8x7B-continued

Plugins are Megatron's: ``loader_<name>.py`` / ``saver_<name>.py`` next to this file, each with
``add_arguments(parser)``; a loader's ``load_checkpoint(args)`` returns (metadata, iterator of
(megatron-core name, tensor)) and the saver's ``save_checkpoint(metadata, tensors, args)`` consumes
it. Megatron-LM runs the two in separate processes joined by a queue; here they run in one
process as a generator pipeline, which moves each tensor once instead of pickling it through a
queue (docs/hf.md). Families: Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V3
(megatron_moe/hf/families.py).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import sys

LOADERS = ("hf", "megatron")
SAVERS = ("hf", "megatron")


def _plugin(kind, name):
    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(os.path.dirname(here))
    for path in (here, root):  # plugins, then the megatron_moe package of this checkout
        if path not in sys.path:
            sys.path.insert(0, path)
    return importlib.import_module(f"{kind}_{name}")


def build_parser(argv):
    parser = argparse.ArgumentParser(
        description="Megatron checkpoint converter (Hugging Face <-> Megatron torch_dist).",
        allow_abbrev=False, add_help=False)
    parser.add_argument("--model-type", required=True, choices=["GPT"],
                        help="Type of the model (only GPT MoE decoders convert)")
    parser.add_argument("--loader", required=True, choices=LOADERS,
                        help="Module name to load the checkpoint from (loader_<name>.py)")
    parser.add_argument("--saver", required=True, choices=SAVERS,
                        help="Module name to save the checkpoint with (saver_<name>.py)")
    parser.add_argument("--load-dir", required=True, help="Directory to load the model from")
    parser.add_argument("--save-dir", required=True, help="Directory to save the model to")
    parser.add_argument("--max-queue-size", type=int, default=50,
                        help="Accepted for Megatron-LM compatibility (no queue here)")
    parser.add_argument("--no-checking", action="store_false", dest="checking",
                        help="Accepted for Megatron-LM compatibility")
    pre = argparse.ArgumentParser(add_help=False)  # which plugins' flags to add
    pre.add_argument("--loader", choices=LOADERS)
    pre.add_argument("--saver", choices=SAVERS)
    known, _ = pre.parse_known_args(argv)
    names = ([("loader", known.loader)] if known.loader else [("loader", n) for n in LOADERS]) + \
            ([("saver", known.saver)] if known.saver else [("saver", n) for n in SAVERS])
    plugins = {}
    for kind, name in names:
        plugins[(kind, name)] = module = _plugin(kind, name)
        module.add_arguments(parser)
    parser.add_argument("-h", "--help", action="help", help="show this help message and exit")
    return parser, plugins


def _prompt_free():
    """glibc raises its mmap threshold after the first large free (up to 32 MiB); tensors of a few
    MiB then come from the heap, and freed ones stay resident until the heap top exceeds twice
    that threshold. A conversion allocates and frees one tensor after another, so its RSS would
    creep by tens of MiB of freed memory (measured: bench/hf_convert.py). A fixed 1 MiB threshold
    gives every tensor buffer its own mapping, returned to the system when it is freed. No-op
    without glibc."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD (malloc.h)
    except (OSError, AttributeError):
        pass


def main(argv=None):
    parser, plugins = build_parser(argv)
    args = parser.parse_args(argv)
    if os.path.abspath(args.load_dir) == os.path.abspath(args.save_dir):
        parser.error("--save-dir must differ from --load-dir")
    if "hf" in (args.loader, args.saver) and importlib.util.find_spec("safetensors") is None:
        parser.error("Hugging Face checkpoints need safetensors: pip install 'megatron-moe[hf]'")
    _prompt_free()
    loader = plugins[("loader", args.loader)]
    saver = plugins[("saver", args.saver)]
    metadata, tensors = loader.load_checkpoint(args)
    saver.save_checkpoint(metadata, tensors, args)


if __name__ == "__main__":
    main()
