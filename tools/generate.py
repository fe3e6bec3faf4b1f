#!/usr/bin/env python
"""Generate text from a GPT-MoE checkpoint written by pretrain_gpt_moe.py (Megatron's flags).

    python tools/generate.py --load CKPT --use-checkpoint-args --prompts "Hello" "The" \
        --num-tokens-to-generate 32
    torchrun --nproc_per_node 2 tools/generate.py --load CKPT --use-checkpoint-args \
        --expert-model-parallel-size 2 --prompt-file prompts.jsonl --top_k 0 --top_p 0.9 --seed 7

The checkpoint loads into any TP/EP/PP layout it can be resharded to. Greedy decoding
(``--top_k 1``, Megatron's default) stops at EOD or after ``--num-tokens-to-generate`` tokens.
Each prompt is printed followed by its completion (rank 0). ``--ring-memory-slots K`` keeps the
transformer layers' weights in host memory and streams them through K device slots
(docs/inference.md).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def add_text_generate_args(parser):
    """Megatron-LM's text-generation flags (same names, defaults and meanings)."""
    g = parser.add_argument_group("text generation")
    g.add_argument("--temperature", type=float, default=1.0, help="Sampling temperature.")
    g.add_argument("--top_k", type=int, default=1, help="Top-k sampling (1 = greedy, the default; "
                                                         "0 = off).")
    g.add_argument("--top_p", type=float, default=0.0, help="Top-p (nucleus) sampling; 0 = off.")
    g.add_argument("--return-log-probs", action="store_true",
                   help="Print the log probability of every generated token.")
    g.add_argument("--num-tokens-to-generate", type=int, default=30,
                   help="Number of tokens to generate for each prompt.")
    g.add_argument("--prompts", metavar="PROMPT", type=str, nargs="+", default=None,
                   help="Prompts, each in quotes, separated by spaces.")
    g.add_argument("--prompt-file", default=None,
                   help="JSONL file, one prompt per line in its 'text' field (or a JSON string).")
    g.add_argument("--max-batch-size", "--inference-max-requests", "--inference-max-batch-size",
                   type=int, default=8, dest="inference_max_requests",
                   help="Max number of prompts to process at once (Megatron's names: "
                        "--inference-max-requests, 0.16's --inference-max-batch-size, the static "
                        "script's --max-batch-size).")
    g.add_argument("--inference-max-seq-length", type=int, default=None,
                   help="Prompt + generated tokens limit (default: --max-position-embeddings).")
    add_ring_memory_args(parser)
    return parser


def add_ring_memory_args(parser):
    from megatron_moe.inference.ring_memory_args import add_ring_memory_args as add

    return add(parser)


def add_generate_args(parser):
    """This tool's flags: the shared generation flags and Megatron's static-inference script's."""
    from megatron_moe.inference.static_script import add_static_script_args

    return add_static_script_args(add_text_generate_args(parser))


def validate_generate_args(args):
    from megatron_moe.inference.static_script import validate_static_script_args

    validate_generation_args(args)
    validate_static_script_args(args)


def validate_generation_args(args, need_prompts=True):
    if need_prompts and not args.prompts and not args.prompt_file:
        raise ValueError("--prompts or --prompt-file is required")
    if args.prompts and args.prompt_file:
        raise ValueError("--prompts and --prompt-file are mutually exclusive")
    if args.prompt_file and not os.path.isfile(args.prompt_file):
        raise ValueError(f"--prompt-file: {args.prompt_file} does not exist")
    if args.num_tokens_to_generate < 0:
        raise ValueError(f"--num-tokens-to-generate must be >= 0 (got {args.num_tokens_to_generate})")
    if args.num_tokens_to_generate == 0 and not args.return_log_probs:
        raise ValueError("--num-tokens-to-generate 0 needs --return-log-probs (nothing to show)")
    if args.top_k < 0:
        raise ValueError(f"--top_k must be >= 0 (got {args.top_k})")
    if not 0.0 <= args.top_p <= 1.0:
        raise ValueError(f"--top_p must be in [0, 1] (got {args.top_p})")
    if args.top_k > 1 and args.top_p > 0.0:
        raise ValueError("--top_k > 1 and --top_p > 0 cannot be combined (megatron-core samples "
                         "with one of them)")
    if args.top_k == 1 and args.top_p > 0.0:
        raise ValueError("--top_p needs --top_k 0 (--top_k 1, the default, is greedy)")
    if args.temperature <= 0.0:
        raise ValueError(f"--temperature must be > 0 (got {args.temperature})")
    if args.inference_max_requests < 1:
        raise ValueError("--max-batch-size must be >= 1")
    validate_inference_layout(args)
    from megatron_moe.inference.ring_memory_args import validate_ring_memory_args

    validate_ring_memory_args(args)


def validate_inference_layout(args):
    """Layouts megatron-core's static generation loop cannot run, refused before start-up."""
    tp, ep = args.tensor_model_parallel_size, args.expert_model_parallel_size
    if args.num_experts and tp > 1 and ep == 1:
        raise ValueError("generation with --tensor-model-parallel-size > 1 on an MoE model needs "
                         "--expert-model-parallel-size > 1 (megatron-core's static generation "
                         "runs sequence parallelism only in MoE layers with TP x EP)")
    if args.context_parallel_size > 1:
        raise ValueError("--context-parallel-size > 1 is not supported for generation")


def read_prompts(path: str, limit: int | None = None) -> list[str]:
    """The prompts of a JSONL file (the first ``limit`` of them: --prompt-file-num-truncate)."""
    prompts = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"--prompt-file {path}:{number}: not JSON ({exc.msg})") from None
            text = item.get("text") if isinstance(item, dict) else item
            if not isinstance(text, str):
                raise ValueError(f"--prompt-file {path}:{number}: expected a string or an object "
                                 f"with a 'text' string")
            prompts.append(text)
            if len(prompts) == limit:
                break
    return prompts


def _help_parser():
    """The tool's own flags, without megatron-core imports, so --help answers at once."""
    p = argparse.ArgumentParser(
        prog="generate.py", description=__doc__.split("\n\n")[0],
        epilog="Every pretrain_gpt_moe.py flag is accepted as well (model, tokenizer, parallel "
               "layout: --tensor-model-parallel-size, --expert-model-parallel-size, ...); "
               "--use-checkpoint-args reads the model and tokenizer flags from the checkpoint "
               "and flags given here override them.")
    p.add_argument("--load", required=True, help="Checkpoint directory (pretrain_gpt_moe.py --save).")
    p.add_argument("--use-checkpoint-args", action="store_true")
    p.add_argument("--seed", type=int, default=1234, help="Sampling seed.")
    add_generate_args(p)
    return p


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if "-h" in argv or "--help" in argv:
        _help_parser().parse_args(["--help"])

    from megatron_moe.compat import install_megatron_core_stubs, quiet_known_warnings

    quiet_known_warnings()
    install_megatron_core_stubs()
    from megatron_moe.inference.arguments import parse_inference_args

    args = parse_inference_args(argv, add_generate_args, prog="generate.py",
                                validate_tool=validate_generate_args)
    try:
        prompts = args.prompts or read_prompts(args.prompt_file, args.prompt_file_num_truncate)
    except ValueError as exc:
        print(f"generate.py: error: {exc}", file=sys.stderr)
        return 2
    if not prompts:
        print(f"generate.py: error: --prompt-file {args.prompt_file} holds no prompts",
              file=sys.stderr)
        return 2

    import torch.distributed as dist

    from megatron_moe.inference.engine import TextGenerator, setup_model, single_process_port

    single_process_port()
    from megatron_moe.inference.ring_memory_args import attach_ring_memory

    model, tokenizer, iteration = setup_model(args)
    ring = attach_ring_memory(model, args)
    generator = TextGenerator(model, tokenizer, args)
    try:
        for repeat in range(args.inference_repeat_n):  # Megatron's --inference-repeat-n benchmark
            start = time.perf_counter()
            results = generator.generate(
                prompts, tokens_to_generate=args.num_tokens_to_generate,
                temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                return_log_probs=args.return_log_probs, top_n_logprobs=args.top_n_logprobs)
            latency = time.perf_counter() - start
            if dist.get_rank() == 0 and args.inference_repeat_n > 1:
                print(f"run {repeat + 1} of {args.inference_repeat_n}: {len(prompts)} prompts in "
                      f"{latency:.3f} s", flush=True)
    except ValueError as exc:
        if dist.get_rank() == 0:
            print(f"generate.py: error: {exc}", file=sys.stderr)
        return 2
    if dist.get_rank() == 0 and args.output_path:
        from megatron_moe.inference.static_script import megatron_output, write_output

        write_output(args.output_path, megatron_output(
            results, latency, return_log_probs=args.return_log_probs,
            skip_prompt_log_probs=args.skip_prompt_log_probs,
            every_n=args.output_every_n_results))
    if dist.get_rank() == 0:
        for r in results:
            print("-" * 80)
            print(r.prompt + r.completion, flush=True)
            if args.return_log_probs:
                print("log probs: " + " ".join(f"{v:.4f}" for v in r.log_probs), flush=True)
                print("prompt log probs: " + " ".join(f"{v:.4f}" for v in r.prompt_log_probs),
                      flush=True)
        print("-" * 80)
        if ring is not None:
            print(ring.summary(), flush=True)
    if ring is not None:
        ring.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
