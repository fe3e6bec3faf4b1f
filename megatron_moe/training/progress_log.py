"""--log-progress: Megatron-LM's ``<save>/progress.txt``, one tab-separated line per event.

    2026-11-29 06:40:00\tJob ID: 123\t# GPUs: 8\tStarting job
    2026-11-29 06:45:00\tJob ID: 123\t# GPUs: 8\tSaved checkpoint\tIteration: 200\tJob throughput: 310.2 TFLOP/s/GPU\tCumulative throughput: 305.9 TFLOP/s/GPU\tFloating-point operations: 1.23e+18\tTokens (in billions): 0.82
    ...\tSaving async checkpoint\tIteration: 400\t...   (--async-save: when scheduled)
    ...\tSaved async checkpoint\tIteration: 400          (when it is complete)
    ...\tDeleted checkpoint\tIteration: 200              (--save-retain-interval)

Job throughput: model FLOPs of this job's iterations per second of this job (since its start)
per GPU. Cumulative throughput: since the first "Starting job" after which every line has this
world size, with the FLOPs of the last checkpoint saved before it. FLOPs are the one count of
megatron_moe/flops.py, summed over the run's iterations and carried in checkpoints
(``num_floating_point_operations_so_far``). The format, the fields and the reading of the file are
Megatron-LM's (megatron/training: append_to_progress_log, get_start_time_from_progress_log,
compute_throughputs_and_append_to_progress_log), so its tools read ours.
"""

from __future__ import annotations

import os
import time
from datetime import datetime

import torch.distributed as dist

PROGRESS_FILE = "progress.txt"
_TIME_FORMAT = "%Y-%m-%d %H:%M:%S"


def append(save_dir: str | None, text: str, barrier: bool = True) -> None:
    """One line from rank 0 (after a barrier of every rank when ``barrier``)."""
    if save_dir is None:
        return
    if barrier and dist.is_initialized():
        dist.barrier()
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    world = dist.get_world_size() if dist.is_initialized() else 1
    os.makedirs(save_dir, exist_ok=True)
    with open(os.path.join(save_dir, PROGRESS_FILE), "a+") as f:
        f.write(f"{datetime.now().strftime(_TIME_FORMAT)}\tJob ID: "
                f"{os.getenv('SLURM_JOB_ID', '')}\t# GPUs: {world}\t{text}\n")


def _field(token: str, kind):
    return kind(token.split(": ")[1])


def start_of_this_world_size(save_dir: str, world_size: int) -> tuple[datetime, float]:
    """(time, FLOPs so far) at the first "Starting job" of the jobs with this world size since the
    last change of world size; the FLOPs are those of the last checkpoint committed before it."""
    start_time = start_flops = None
    latest, uncommitted = 0.0, None
    with open(os.path.join(save_dir, PROGRESS_FILE)) as f:
        for line in f:
            tokens = line.strip().split("\t")
            if len(tokens) < 4:
                continue
            event = tokens[3]
            if event == "Saved checkpoint":
                latest = _field(tokens[7], float)
            elif event == "Saving async checkpoint":
                uncommitted = _field(tokens[7], float)   # committed by its "Saved async" line
            elif event == "Saved async checkpoint" and uncommitted is not None:
                latest, uncommitted = uncommitted, None
            if _field(tokens[2], int) != world_size:
                start_time = start_flops = None
                continue
            if event == "Starting job" and start_time is None:
                start_time, start_flops = tokens[0], latest
    if start_time is None:
        raise ValueError(f"{os.path.join(save_dir, PROGRESS_FILE)}: no 'Starting job' line with "
                         f"# GPUs: {world_size}")
    return datetime.strptime(start_time, _TIME_FORMAT), start_flops


class ProgressLog:
    """The job's lines: its start, and each checkpoint save with the throughputs so far."""

    def __init__(self, args, job_start_s: float, flops_at_job_start: float = 0.0):
        self.args = args
        self.job_start_s = job_start_s
        self.flops_at_job_start = flops_at_job_start

    def job_started(self):
        append(self.args.save, "Starting job")

    def checkpoint_saved(self, iteration: int, flops_so_far: float):
        """After a save (sync: complete; --async-save: scheduled). Every rank calls it."""
        args = self.args
        if dist.is_initialized():
            dist.barrier()
            if dist.get_rank() != 0:
                return
        per_gpu = 1e12 * args.world_size
        job = (flops_so_far - self.flops_at_job_start) / ((time.time() - self.job_start_s) * per_gpu)
        start, start_flops = start_of_this_world_size(args.save, args.world_size)
        elapsed = (datetime.now() - start).total_seconds()
        # the file's times are whole seconds: a job saving within its first second has no span
        cumulative = (flops_so_far - start_flops) / (elapsed * per_gpu) if elapsed > 0 else 0.0
        tokens = args.consumed_train_samples * args.seq_length
        what = "Saving async checkpoint" if args.async_save else "Saved checkpoint"
        append(args.save, f"{what}\tIteration: {iteration}\t"
                          f"Job throughput: {job:.1f} TFLOP/s/GPU\t"
                          f"Cumulative throughput: {cumulative:.1f} TFLOP/s/GPU\t"
                          f"Floating-point operations: {flops_so_far:.2e}\t"
                          f"Tokens (in billions): {tokens / 10**9:.2f}", barrier=False)
