"""Megatron-LM's logging flags: params norm, zeros in grad, timers, memory, validation perplexity,
Python logging level (``megatron/training/training.py`` ``training_log``, core_v0.19.0).

Each value is read on the host once per log interval (``Trainer._log``), never per step, so the
step itself stays free of host syncs. Names of TensorBoard/W&B scalars are Megatron's.
"""

from __future__ import annotations

import logging
import os

import torch

# Megatron's training_log: timers written at --timing-log-level 1 and 2 (names megatron-core's
# schedule and optimizer use); a timer nobody started is skipped by megatron-core's Timers.
TIMERS_LEVEL_1 = ("forward-backward", "layernorm-grads-all-reduce", "embedding-grads-all-reduce",
                  "all-grads-sync", "params-all-gather", "optimizer-copy-to-main-grad",
                  "optimizer-unscale-and-check-inf", "optimizer-clip-main-grad",
                  "optimizer-count-zeros", "optimizer-inner-step",
                  "optimizer-copy-main-to-model-params", "optimizer")
TIMERS_LEVEL_2 = ("batch-generator", "forward-compute", "backward-compute", "forward-recv",
                  "forward-send", "backward-recv", "backward-send", "forward-send-forward-recv",
                  "forward-send-backward-recv", "backward-send-forward-recv",
                  "backward-send-backward-recv", "forward-backward-send-forward-backward-recv")


def add_arguments(parser):
    from megatron_moe.flags import add_megatron_argument

    g = parser.add_argument_group("logging (Megatron-LM's training_log)")
    add_megatron_argument(g, "--log-params-norm",
                          help="Log the L2 norm of the parameters ('params norm', 'params-norm').")
    add_megatron_argument(g, "--log-num-zeros-in-grad",
                          help="Log the number of zeros in the gradient ('num zeros', 'num-zeros').")
    add_megatron_argument(g, "--log-timers-to-tensorboard",
                          help="Write megatron-core's timers to TensorBoard/W&B.")
    add_megatron_argument(g, "--timing-log-level",
                          help="0: no timers; 1: forward-backward, optimizer phases; 2: also "
                               "per-micro-batch compute and pipeline send/recv.")
    add_megatron_argument(g, "--timing-log-option",
                          help="Timer values over ranks: max, minmax or all.")
    add_megatron_argument(g, "--log-memory-to-tensorboard",
                          help="Write memory statistics (CUDA allocator; on CPU the process's "
                               "peak resident set) to TensorBoard.")
    add_megatron_argument(g, "--log-validation-ppl-to-tensorboard",
                          help="Write validation perplexity to TensorBoard.")
    add_megatron_argument(g, "--logging-level",
                          help="Python logging level of the root logger (e.g. 10 DEBUG, 40 ERROR); "
                               "MEGATRON_LOGGING_LEVEL is the fallback, as in Megatron.")


def validate_args(args):
    if args.logging_level is not None and args.logging_level < 0:
        raise ValueError(f"--logging-level must be >= 0 (got {args.logging_level})")


def apply_logging_level(args):
    """Megatron's setup_logging: --logging-level, else MEGATRON_LOGGING_LEVEL, else unchanged."""
    level = getattr(args, "logging_level", None)
    if level is None and os.environ.get("MEGATRON_LOGGING_LEVEL"):
        level = int(os.environ["MEGATRON_LOGGING_LEVEL"])
    if level is not None:
        logging.getLogger().setLevel(level)
    return level


def build_timers(args):
    """megatron-core's Timers at --timing-log-level / --timing-log-option (timers above the level
    are no-op dummies, so level 0 adds no synchronisation)."""
    from megatron.core.timers import Timers

    return Timers(args.timing_log_level, args.timing_log_option)


def timer_names(args) -> list:
    names = []
    if args.timing_log_level >= 1:
        names += TIMERS_LEVEL_1
    if args.timing_log_level >= 2:
        names += TIMERS_LEVEL_2
    return names


def write_timers(timers, args, writer, iteration):
    """Once per log interval, on every rank (the values are reduced over ranks): with
    --log-timers-to-tensorboard each timer's maximum over ranks, averaged over the interval, as
    '<name>-time' (Megatron's Timers.write, here through any of our writers: TensorBoard, W&B or
    both); then megatron-core's Timers.log line on the last rank, which resets them."""
    names = timer_names(args)
    if not names:
        return
    if args.log_timers_to_tensorboard:
        started = timers._timers  # megatron-core keeps created timers here (no public accessor)
        local = torch.tensor([started[n].elapsed(reset=False) if n in started else 0.0
                              for n in names], dtype=torch.float64)
        device = torch.cuda.current_device() if torch.cuda.is_available() else torch.device("cpu")
        local = local.to(device)
        torch.distributed.all_reduce(local, op=torch.distributed.ReduceOp.MAX)
        if writer is not None:
            for name, value in zip(names, local.cpu().tolist()):
                if value > 0.0:
                    writer.add_scalar(name + "-time", value / args.log_interval, iteration)
    timers.log(names, normalizer=args.log_interval, reset=True)


def params_l2_norm(model) -> float:
    """Megatron's calc_params_l2_norm: L2 norm over every parameter once (tensor-parallel
    duplicates and shared embeddings skipped), dense parameters reduced over the model-parallel
    group, expert parameters over the expert tensor-model-pipeline group. Read from the model's
    own parameters (Megatron reads the optimizer's fp32 main copy under --bf16: the same values
    rounded to bf16)."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.module import param_is_not_shared
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

    dense, expert = [], []
    for chunk in model:
        for param in chunk.parameters():
            if not param_is_not_tensor_parallel_duplicate(param):
                continue
            if not getattr(param, "allreduce", True):
                expert.append(param.detach().float())
            elif param_is_not_shared(param):
                dense.append(param.detach().float())
    device = dense[0].device if dense else torch.device("cpu")

    def norm_2(tensors):
        if not tensors:
            return torch.zeros((), dtype=torch.float32, device=device)
        return torch.stack([torch.sum(t * t) for t in tensors]).sum()

    dense_2, expert_2 = norm_2(dense), norm_2(expert).to(device)
    dense_group = ps.get_model_parallel_group()
    expert_group = ps.get_expert_tensor_model_pipeline_parallel_group()
    if torch.distributed.get_process_group_ranks(dense_group) == \
            torch.distributed.get_process_group_ranks(expert_group):
        total = dense_2 + expert_2
        torch.distributed.all_reduce(total, group=dense_group)
    else:
        torch.distributed.all_reduce(dense_2, group=dense_group)
        torch.distributed.all_reduce(expert_2, group=expert_group)
        total = dense_2 + expert_2
    return total.item() ** 0.5


def memory_scalars() -> dict:
    """Megatron's memory scalars (CUDA allocator). On a CPU there is no device allocator: the
    process's peak resident set size is written instead, under its own name."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        stats = torch.cuda.memory_stats()
        return {"mem-reserved-bytes": stats["reserved_bytes.all.current"],
                "mem-allocated-bytes": stats["allocated_bytes.all.current"],
                "mem-max-allocated-bytes": stats["allocated_bytes.all.peak"],
                "mem-allocated-count": stats["allocation.all.current"]}
    import resource

    return {"mem-max-rss-bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def validation_ppl(loss: float) -> float:
    """Megatron's evaluate_and_print_results: exp(min(20, loss))."""
    import math

    return math.exp(min(20.0, loss))

