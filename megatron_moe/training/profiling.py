"""Megatron-LM's profiling flags (``megatron/training/training.py`` ``train``, core_v0.19.0).

``--profile`` on the ranks of ``--profile-ranks`` (all ranks when empty):

* with ``--use-pytorch-profiler``: one ``torch.profiler.profile`` for the run, stepped at the top
  of every loop pass, with Megatron's schedule ``wait=max(start - 1, 0), warmup=1 if start > 0,
  active=end - start, repeat=1``: the steps of iterations ``start .. end - 1`` (1-based) are
  recorded and written as a Chrome trace to ``<--tensorboard-dir>/../torch_profile/rank-<R>.json.gz``
  (TensorBoard's profiler plugin reads it); the profiler stops after iteration ``end``.
  ``--pytorch-profiler-collect-shapes`` / ``--pytorch-profiler-collect-callstack`` are torch's
  ``record_shapes`` / ``with_stack``.
* without it: the CUDA profiler API (``cudaProfilerStart`` when ``start`` iterations are done,
  ``cudaProfilerStop`` after iteration ``end``) for ``nsys profile --capture-range=cudaProfilerApi``;
  ``--record-shapes`` adds torch's NVTX ranges with shapes (``emit_nvtx``). It needs CUDA: on a
  host without one it is refused at parse time (Megatron's call would fail in the loop).

``--nvtx-ranges`` with ``--profile``: megatron-core's own NVTX ranges (its transformer layer,
attention, MLP, pipeline schedule and p2p regions; ``megatron.core.utils.configure_nvtx_profiling``)
are switched on when iteration ``start`` begins and off after iteration ``end`` (Megatron-LM's
train loop), for nsys or the torch profiler's CUDA timeline. The ranges are ``torch.cuda.nvtx``:
CUDA only, refused on a CPU at parse time.

``--record-memory-history`` on the same ranks (``--profile-ranks``, with or without ``--profile``):
the CUDA caching allocator records its allocation history (torch's ``_record_memory_history``,
from the start of training), and a snapshot is written at the first iteration and every
``--log-interval`` iterations to ``--memory-snapshot-path`` with ``_<rank>`` before its extension
(Megatron's training_log), for PyTorch's memory_viz. CUDA only: refused on a CPU at parse time.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from megatron.core.utils import configure_nvtx_profiling


def add_arguments(parser):
    from megatron_moe.flags import add_megatron_argument

    g = parser.add_argument_group("profiling (Megatron-LM's)")
    add_megatron_argument(g, "--profile",
                          help="Profile iterations --profile-step-start..--profile-step-end: torch "
                               "profiler with --use-pytorch-profiler, else the CUDA profiler API "
                               "for nsys (GPU only).")
    add_megatron_argument(g, "--profile-step-start", help="Iteration to start profiling at.")
    add_megatron_argument(g, "--profile-step-end", help="Iteration to stop profiling after.")
    add_megatron_argument(g, "--profile-ranks",
                          help="Global ranks to profile (default: all).")
    add_megatron_argument(g, "--use-pytorch-profiler",
                          help="torch.profiler; trace in <--tensorboard-dir>/../torch_profile/.")
    add_megatron_argument(g, "--pytorch-profiler-collect-shapes",
                          help="torch.profiler record_shapes.")
    add_megatron_argument(g, "--pytorch-profiler-collect-callstack",
                          help="torch.profiler with_stack.")
    add_megatron_argument(g, "--record-shapes",
                          help="nsys path: NVTX ranges with tensor shapes (torch emit_nvtx).")
    add_megatron_argument(g, "--nvtx-ranges",
                          help="With --profile: megatron-core's NVTX ranges over the profiled "
                               "iterations (GPU only).")
    add_megatron_argument(g, "--record-memory-history",
                          help="Record the CUDA allocator's history; snapshots each log interval.")
    add_megatron_argument(g, "--memory-snapshot-path",
                          help="Snapshot file; _<rank> is added before its extension.")


def _cuda_available() -> bool:
    return torch.cuda.is_available()


def validate_args(args):
    if args.record_memory_history and not _cuda_available():
        raise ValueError("--record-memory-history records the CUDA caching allocator's history, "
                         "which needs a GPU")
    if args.nvtx_ranges and not args.profile:
        raise ValueError("--nvtx-ranges needs --profile (the ranges cover the profiled "
                         "iterations, --profile-step-start to --profile-step-end)")
    if args.nvtx_ranges and not _cuda_available():
        raise ValueError("--nvtx-ranges needs CUDA: megatron-core emits torch.cuda.nvtx ranges")
    if not args.profile:
        return
    if args.profile_step_end <= args.profile_step_start or args.profile_step_start < 0:
        raise ValueError(f"--profile-step-start {args.profile_step_start} / --profile-step-end "
                         f"{args.profile_step_end}: need 0 <= start < end")
    if args.use_pytorch_profiler:
        if not args.tensorboard_dir:
            raise ValueError("--use-pytorch-profiler needs --tensorboard-dir (Megatron writes the "
                             "trace to <--tensorboard-dir>/../torch_profile/)")
    elif not _cuda_available():
        raise ValueError("--profile without --use-pytorch-profiler drives the CUDA profiler API "
                         "(nsys), which needs a GPU: add --use-pytorch-profiler on a CPU")


def _profiled_rank(args) -> bool:
    return not args.profile_ranks or dist.get_rank() in args.profile_ranks


def trace_path(args, rank) -> str:
    """Where --use-pytorch-profiler writes rank ``rank``'s trace (Megatron's path)."""
    return os.path.join(args.tensorboard_dir, "..", "torch_profile", f"rank-{rank}.json.gz")


def snapshot_path(args, rank) -> str:
    """Where --record-memory-history writes rank ``rank``'s snapshot (Megatron's name)."""
    base, ext = os.path.splitext(args.memory_snapshot_path)
    return f"{base}_{rank}{ext}"


class MemoryHistory:
    """--record-memory-history on one profiled rank: recording from construction (before the
    first step), a snapshot at the run's first iteration and at each log interval."""

    def __init__(self, args):
        self.args = args
        self.first = True
        # Megatron's settings: up to 100k alloc/free events, each with its Python stack
        torch.cuda.memory._record_memory_history(max_entries=100_000)

    def after_step(self, iteration):
        if self.first or iteration % self.args.log_interval == 0:
            torch.cuda.memory._dump_snapshot(snapshot_path(self.args, dist.get_rank()))
        self.first = False


class Profiler:
    """Megatron's profiling around the training loop of one profiled rank."""

    def __init__(self, args):
        self.args = args
        self.prof = None
        self.nvtx = None
        self.cuda_profiling = False
        self.nvtx_ranges = False
        self.stopped = False

    def _start_torch_profiler(self):
        args, rank = self.args, dist.get_rank()

        def write_trace(prof):
            path = trace_path(args, rank)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            prof.export_chrome_trace(path)

        start, end = args.profile_step_start, args.profile_step_end
        self.prof = torch.profiler.profile(
            schedule=torch.profiler.schedule(wait=max(start - 1, 0), warmup=1 if start > 0 else 0,
                                             active=end - start, repeat=1),
            on_trace_ready=write_trace,
            record_shapes=args.pytorch_profiler_collect_shapes,
            with_stack=args.pytorch_profiler_collect_callstack)
        self.prof.start()

    def before_step(self, iteration):
        """Top of a loop pass, ``iteration`` iterations done (Megatron steps the profiler here)."""
        if self.stopped:
            return
        if self.args.nvtx_ranges and iteration == self.args.profile_step_start:
            configure_nvtx_profiling(True)
            self.nvtx_ranges = True
        if self.args.use_pytorch_profiler:
            if self.prof is None:
                self._start_torch_profiler()
            self.prof.step()
        elif iteration == self.args.profile_step_start:
            torch.cuda.check_error(torch.cuda.cudart().cudaProfilerStart())
            self.cuda_profiling = True
            if self.args.record_shapes:
                self.nvtx = torch.autograd.profiler.emit_nvtx(record_shapes=True)
                self.nvtx.__enter__()

    def after_step(self, iteration):
        if iteration == self.args.profile_step_end:
            self.close()

    def close(self):
        if self.stopped:
            return
        self.stopped = True
        if self.nvtx_ranges:
            configure_nvtx_profiling(False)
        if self.prof is not None:
            self.prof.stop()
        elif self.cuda_profiling:
            torch.cuda.check_error(torch.cuda.cudart().cudaProfilerStop())
            if self.nvtx is not None:
                self.nvtx.__exit__(None, None, None)


class Profiling:
    """This rank's profiling run hooks: the profiler and/or the memory history."""

    def __init__(self, args):
        self.parts = [part(args) for on, part in ((args.profile, Profiler),
                                                   (args.record_memory_history, MemoryHistory))
                      if on]

    def before_step(self, iteration):
        for part in self.parts:
            if hasattr(part, "before_step"):
                part.before_step(iteration)

    def after_step(self, iteration):
        for part in self.parts:
            part.after_step(iteration)

    def close(self):
        for part in self.parts:
            if hasattr(part, "close"):
                part.close()


def run_hooks(args, model, optimizer, tracker):
    if (getattr(args, "profile", False) or getattr(args, "record_memory_history", False)) \
            and _profiled_rank(args):
        return Profiling(args)
    return None
