"""Megatron-LM's static-generation script surface on tools/generate.py.

Megatron-LM generates from a checkpoint with ``examples/inference/advanced/gpt_static_inference.py``
(``examples/inference/gpt/`` before 0.19): its own inference flags (``megatron/inference/utils.py``
``add_inference_args``) on top of the training ones, writing ``--output-path`` as JSON. Megatron's
CI runs its MoE inference tests that way (tests/data/megatron_moe_static_inference_configs.json).
This module gives tools/generate.py the same flags with the same meanings and the same output
file, so those command lines run unchanged; every flag is either done as Megatron does it, or
accepted because it has no effect on static generation in Megatron either (said per flag below),
or refused in one line.

Why not in the shared generation flags (tools/generate.py ``add_text_generate_args``): the REST
server takes those too, and an output file or a request-arrival simulation means nothing there.
"""

from __future__ import annotations

import json
import os

# Megatron's add_inference_args flags that only its dynamic engine reads (request arrival
# scheduling, suspend/resume, coordinator, per-request events): refused when given a value other
# than the default; static generation takes every prompt at once.
_DYNAMIC_ONLY = {
    "suspend_resume_interval": ("--suspend-resume-interval", None),
    "suspend_timeout": ("--suspend-timeout", 0.0),
    "throughput_check_only": ("--throughput-check-only", False),
    "drain_between_batches": ("--drain-between-batches", False),
    "batch_boundaries": ("--batch-boundaries", None),
    "coordinator_schedule_output_path": ("--coordinator-schedule-output-path", None),
    "output_request_events": ("--output-request-events", False),
    "moe_routing_trace_max_inference_steps": ("--moe-routing-trace-max-inference-steps", None),
    "num_tokens_from_file": ("--num-tokens-from-file", False),
    "stream": ("--stream", False),
}


def add_static_script_args(parser):
    """The flags of Megatron's gpt_static_inference.py that tools/generate.py's shared generation
    flags do not already define (Megatron's names, defaults and meanings)."""
    g = parser.add_argument_group("Megatron's static inference script (gpt_static_inference.py)")
    g.add_argument("--output-path", default=None,
                   help="Write the generations as Megatron's JSON: {request id: {input_prompt, "
                        "generated_text, generated_tokens, tpot, latency[, logprobs]"
                        "[, generated_top_n_logprobs]}} (rank 0).")
    g.add_argument("--output-every-n-results", type=int, default=1,
                   help="Write only every n-th request's result to --output-path.")
    g.add_argument("--top-n-logprobs", type=int, default=0,
                   help="Return the top n log probs of every generated token.")
    g.add_argument("--skip-prompt-log-probs", action="store_true",
                   help="With --return-log-probs: logprobs holds the generated tokens' only (the "
                        "prompt tokens' are not written).")
    g.add_argument("--prompt-file-num-truncate", type=int, default=None,
                   help="Use only the first N prompts of --prompt-file.")
    g.add_argument("--inference-repeat-n", type=int, default=1,
                   help="Run the whole generation N times (a benchmark); the last run is written "
                        "and every run's latency printed.")
    g.add_argument("--model-provider", choices=["hybrid", "mamba", "gpt"], default="gpt",
                   help="gpt only here (Megatron's hybrid/Mamba models are not part of this "
                        "framework).")
    g.add_argument("--termination-id", type=int, default=None,
                   help="Refused: megatron-core's static engine ends at the tokenizer's EOD.")
    g.add_argument("--stop-words", metavar="WORD", nargs="+", default=None,
                   help="Refused: the static engine stops at the tokenizer's EOD only.")
    g.add_argument("--use-legacy-static-engine", action="store_true",
                   help="Accepted: megatron-core's legacy static engine is the only one here.")
    g.add_argument("--flash-decode", action="store_true",
                   help="megatron-core's flash-decoding kernel for decode steps (needs CUDA and "
                        "the flash_attn package; refused without them).")
    # megatron-core's CUDA-graph decoding (with --cuda-graph-impl local), passed to its config
    g.add_argument("--inference-rng-tracker", action="store_true",
                   help="megatron-core's RNG tracker for graph-captured inference (CUDA).")
    g.add_argument("--moe-pad-experts-for-cuda-graph-inference", action="store_true",
                   help="megatron-core pads expert inputs to capacity so decode steps can be "
                        "graph-captured (CUDA).")
    # accepted, with no effect on static generation (as in Megatron's own static script)
    g.add_argument("--incoming-requests-per-sec", type=float, default=100.0,
                   help="Accepted, no effect: Megatron's request-arrival simulation, which only "
                        "its dynamic engine and its synthetic prompts read.")
    g.add_argument("--incoming-requests-per-step", type=int, default=None,
                   help="Accepted, no effect (as --incoming-requests-per-sec).")
    g.add_argument("--incoming-requests-duration", type=float, default=10.0,
                   help="Accepted, no effect (as --incoming-requests-per-sec).")
    g.add_argument("--num-tokens-to-prompt", type=int, nargs="+", default=[64, 1024],
                   help="Accepted, no effect: lengths of Megatron's synthetic prompts; here "
                        "--prompts or --prompt-file is required.")
    g.add_argument("--inference-dynamic-batching-buffer-size-gb", type=float, default=40.0,
                   help="Accepted, no effect: the KV buffer of Megatron's non-legacy static "
                        "engine, which runs its CUDA-only dynamic engine.")
    g.add_argument("--max-tokens-to-oom", type=int, default=12000,
                   help="Accepted, no effect: Megatron-LM reads it nowhere (since 0.16).")
    g.add_argument("--no-record-throughput", action="store_false", dest="record_throughput",
                   help="Accepted, no effect: the static output records no throughput.")
    # refused in one line when given (Megatron's dynamic engine or CUDA kernels only)
    g.add_argument("--use-flashinfer-fused-rope", action="store_true",
                   help="Refused: flashinfer's CUDA RoPE kernel.")
    g.add_argument("--inference-ckpt-non-strict", action="store_true",
                   help="Refused: use --dist-ckpt-strictness.")
    for dest, (flag, default) in _DYNAMIC_ONLY.items():
        if isinstance(default, bool):
            g.add_argument(flag, dest=dest, action="store_true",
                           help="Refused: Megatron's dynamic engine only.")
        else:
            g.add_argument(flag, dest=dest, type=type(default) if default is not None else str,
                           default=default, help="Refused: Megatron's dynamic engine only.")
    return parser


def validate_static_script_args(args):
    """ValueError with one line for what static generation here cannot do."""
    for dest, (flag, default) in _DYNAMIC_ONLY.items():
        if getattr(args, dest) != default:
            raise ValueError(f"{flag} is an option of Megatron's dynamic inference engine "
                             f"(gpt_dynamic_inference.py); generate.py runs megatron-core's static "
                             f"engine")
    if args.model_provider != "gpt":
        raise ValueError(f"--model-provider {args.model_provider}: only gpt models are part of "
                         f"this framework")
    if args.stop_words:
        raise ValueError("--stop-words: megatron-core's static engine stops at the tokenizer's "
                         "EOD only")
    if args.termination_id is not None:
        raise ValueError("--termination-id: megatron-core's static engine stops at the "
                         "tokenizer's EOD only (its controller does not read a termination id)")
    if args.use_flashinfer_fused_rope:
        raise ValueError("--use-flashinfer-fused-rope needs flashinfer's CUDA kernel, which this "
                         "framework does not install")
    if args.inference_ckpt_non_strict:
        raise ValueError("--inference-ckpt-non-strict: give --dist-ckpt-strictness (e.g. "
                         "log_unexpected) for a checkpoint whose keys differ from the model's")
    if args.flash_decode:
        _check_flash_decode()
    for flag in ("inference_rng_tracker", "moe_pad_experts_for_cuda_graph_inference"):
        if getattr(args, flag) and not _cuda():
            raise ValueError(f"--{flag.replace('_', '-')} needs CUDA (it serves megatron-core's "
                             f"CUDA-graph decoding, --cuda-graph-impl local); on a CPU leave it "
                             f"out")
    if args.output_every_n_results < 1:
        raise ValueError("--output-every-n-results must be >= 1")
    if args.inference_repeat_n < 1:
        raise ValueError("--inference-repeat-n must be >= 1")
    if args.top_n_logprobs < 0:
        raise ValueError("--top-n-logprobs must be >= 0")
    if args.prompt_file_num_truncate is not None and args.prompt_file_num_truncate < 1:
        raise ValueError("--prompt-file-num-truncate must be >= 1")
    if args.output_path:
        parent = os.path.dirname(os.path.abspath(args.output_path))
        if not os.path.isdir(parent):
            raise ValueError(f"--output-path {args.output_path}: directory {parent} does not exist")


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _check_flash_decode():
    """megatron-core's flash decoding calls flash_attn's ``flash_attn_with_kvcache`` (CUDA)."""
    import importlib.util

    if not _cuda():
        raise ValueError("--flash-decode needs CUDA (megatron-core decodes with flash_attn's "
                         "flash_attn_with_kvcache kernel); on a CPU leave it out")
    if importlib.util.find_spec("flash_attn") is None:
        raise ValueError("--flash-decode needs the flash_attn package (megatron-core decodes with "
                         "its flash_attn_with_kvcache kernel): pip install flash-attn, or leave "
                         "the flag out")


def megatron_output(generations, latency: float, *, return_log_probs: bool,
                    skip_prompt_log_probs: bool = False, every_n: int = 1) -> dict:
    """Megatron's --output-path document (gpt_static_inference.py): one entry per request, keyed
    by its request id, with the prompt's and the generated tokens' log probs concatenated."""
    out = {}
    for index, g in enumerate(generations):
        if index % every_n:
            continue
        entry = {"input_prompt": g.prompt, "generated_text": g.generated_text,
                 "generated_tokens": list(g.tokens), "tpot": list(g.tpot or []),
                 "latency": latency}
        if g.top_n is not None:
            entry["generated_top_n_logprobs"] = g.top_n
        if return_log_probs:
            prompt = [] if skip_prompt_log_probs else list(g.prompt_log_probs or [])
            entry["logprobs"] = prompt + list(g.log_probs or [])
        out[str(g.request_id)] = entry
    return out


def write_output(path: str, document: dict) -> None:
    """Written whole or not at all (a temporary file renamed over the target)."""
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(document, f)
    os.replace(tmp, path)
