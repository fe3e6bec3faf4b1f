"""Megatron-layout checkpoints in megatron-core's torch_dist format, written atomically.

Layout (what Megatron-LM tools expect)::

    <save>/latest_checkpointed_iteration.txt     "100"
    <save>/iter_0000100/                         dist_checkpointing output (metadata.json, .metadata,
                                                 __<rank>_<i>.distcp, common.pt)

A save goes to ``<save>/iter_0000100.tmp`` and is renamed into place only after every rank
finished writing; the tracker file is then replaced atomically. A crash or kill during a save
leaves the previous checkpoint and the tracker pointing at it untouched.

Model and optimizer state are sharded tensors, so a checkpoint saved with one TP/EP/PP layout
loads into another (megatron-core resharding). Per-rank RNG state is restored only when the
layout is unchanged (it has no meaning across layouts; a note says so).
"""

from __future__ import annotations

import functools
import os
import random
import shutil
import time
import warnings

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from megatron.core import dist_checkpointing, tensor_parallel
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.dist_checkpointing.serialization import (
    get_default_load_sharded_strategy,
)

from megatron_moe.models.builder import unwrap

TRACKER = "latest_checkpointed_iteration.txt"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message names the path and what is wrong."""


def checkpoint_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def read_tracker(root: str) -> int | None:
    """The iteration in ``latest_checkpointed_iteration.txt``, or None if there is no tracker."""
    path = os.path.join(root, TRACKER)
    if not os.path.isfile(path):
        return None
    text = open(path).read().strip()
    if text == "release":
        raise CheckpointError(f"{path}: 'release' checkpoints are not supported; "
                              f"load an iter_XXXXXXX checkpoint")
    try:
        return int(text)
    except ValueError:
        raise CheckpointError(f"{path}: expected an iteration number, found {text!r}") from None


def parallel_layout(args) -> dict:
    return dict(tp=args.tensor_model_parallel_size, pp=args.pipeline_model_parallel_size,
                ep=args.expert_model_parallel_size, etp=args.expert_tensor_parallel_size,
                cp=args.context_parallel_size, world=args.world_size)


def _rng_state() -> dict:
    return dict(random=random.getstate(), np=np.random.get_state(), torch=torch.get_rng_state(),
                cuda=torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
                tracker=tensor_parallel.get_cuda_rng_tracker().get_states())


def _set_rng_state(state: dict):
    random.setstate(state["random"])
    np.random.set_state(state["np"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def _optimizer_metadata(args) -> dict:
    # Optimizer state keyed by model-space parameter names with no ``chained_<i>.`` prefix, and the
    # distributed optimizer in its fully reshardable format: a resume may change TP/EP/PP/DP even
    # when that changes how many optimizers megatron-core chains (EP=1 has one, EP>1 two).
    metadata = {"chained_optim_avoid_prefix": True}
    if args.use_distributed_optimizer:
        metadata["distrib_optim_sharding_type"] = "fully_reshardable"
    return metadata


def model_keys(model) -> list:
    return ["model"] if len(model) == 1 else [f"model{i}" for i in range(len(model))]


def _sharded_state(model, optimizer, args, *, include_optimizer: bool, include_rng: bool,
                   is_loading: bool, rng=None) -> dict:
    # Megatron's keys: "model", or "model0", "model1", ... with virtual pipeline stages
    # Megatron's sharded-state metadata: megatron-core ties an MTP stage's copy of the embedding
    # over the data-parallel group it names (gpt_model.sharded_state_dict, MTP off stage 0)
    from megatron.core import parallel_state

    metadata = {"dp_cp_group": parallel_state.get_data_parallel_group(with_context_parallel=True)}
    state = {key: unwrap(chunk).sharded_state_dict(metadata=metadata)
             for key, chunk in zip(model_keys(model), model)}
    if include_optimizer and optimizer is not None:
        model_sd = state["model"] if len(model) == 1 else dict(state)
        state["optimizer"] = optimizer.sharded_state_dict(
            model_sd, is_loading=is_loading, metadata=_optimizer_metadata(args))
    if include_rng:
        rank, world = dist.get_rank(), dist.get_world_size()
        state["rng_state"] = ShardedObject("rng_state", rng if rng is not None else _rng_state(),
                                           (world,), (rank,), replica_id=0)
    return state


TEST_SAVE_DELAY_ENV = "MEGATRON_MOE_TEST_SAVE_DELAY"   # tests only: seconds (module doc)

_async_queue = None      # megatron-core's AsyncCallsQueue, created by the first --async-save


def _fsync_dir(path: str):
    """Make a rename/replace inside ``path`` durable (POSIX: the directory entry is data too)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree_files(path: str, names=None):
    for name in names if names is not None else os.listdir(path):
        full = os.path.join(path, name)
        if os.path.isfile(full):
            with open(full, "rb") as f:
                os.fsync(f.fileno())


def _test_delay() -> float:
    return float(os.environ.get(TEST_SAVE_DELAY_ENV, "0") or 0)


def save_checkpoint(iteration, model, optimizer, scheduler, args, consumed_train_samples,
                    consumed_valid_samples=0, extra_state: dict | None = None,
                    sharded_strategy=None):
    """Write ``<save>/iter_XXXXXXX`` atomically (``.tmp`` then rename, then the tracker).

    With ``--async-save`` the shards are written in the background (megatron-core's
    AsyncCallsQueue); the rename and tracker update run as the request's finalisation, on every
    rank, once all ranks finished writing (``finalize_async_save``). A save waits for the previous
    async save first, so at most one is in flight.

    ``sharded_strategy``: a megatron-core torch_dist save strategy other than the default (the HF
    import's streaming one, megatron_moe/hf/megatron_side.py).
    """
    from megatron_moe.compat.checkpoint import (install_test_write_delay,
                                                quiet_mcore_async_notice, wait_writer_ready)

    root = args.save
    final_dir = checkpoint_dir(root, iteration)
    tmp_dir = final_dir + ".tmp"
    rank = dist.get_rank()
    finalize_async_save(blocking=True)
    delay = _test_delay()
    if delay:
        install_test_write_delay(delay)
    wait_writer_ready()
    quiet_mcore_async_notice()
    if rank == 0:
        os.makedirs(root, exist_ok=True)
        shutil.rmtree(tmp_dir, ignore_errors=True)  # leftover of a killed save
        os.makedirs(tmp_dir)
    dist.barrier()
    state = _sharded_state(model, optimizer, args, include_optimizer=not args.no_save_optim,
                           include_rng=not args.no_save_rng, is_loading=False)
    state.update(
        iteration=iteration,
        checkpoint_version=3.0,
        args=_portable_args(args),
        parallel_layout=parallel_layout(args),
        consumed_train_samples=consumed_train_samples,
        consumed_valid_samples=consumed_valid_samples,
        opt_param_scheduler=scheduler.state_dict() if scheduler is not None else None,
        extra_state=extra_state or {},
        has_optimizer=not args.no_save_optim and optimizer is not None,
        optimizer_count=_optimizer_count(optimizer),
        has_rng=not args.no_save_rng,
    )
    from megatron_moe.compat import checkpoint_options   # Megatron's housekeeping flags

    strategy = sharded_strategy or checkpoint_options.save_strategy(args)
    commit = functools.partial(_commit, root, iteration, tmp_dir, final_dir, delay)
    if getattr(args, "async_save", False):
        global _async_queue
        from megatron_moe.compat.checkpoint import async_save_kwargs

        request = dist_checkpointing.save(state, tmp_dir, strategy, async_sharded_save=True,
                                          **async_save_kwargs(), **checkpoint_options.save_kwargs(args))
        request.finalize_fns.append(commit)
        if _async_queue is None:   # --use-persistent-ckpt-worker: one long-lived writer process
            _async_queue = checkpoint_options.async_queue(args)
        _async_queue.schedule_async_request(request)
        return
    dist_checkpointing.save(state, tmp_dir, strategy, **checkpoint_options.save_kwargs(args))
    commit()


def finalize_async_save(blocking: bool = False) -> list:
    """Finish the async saves whose writes are done (all of them when ``blocking``); a
    collective: every rank calls it at the same points (each iteration, before a save, at exit).
    Returns the finalised call ids."""
    if _async_queue is None:
        return []
    return _async_queue.maybe_finalize_async_calls(blocking=blocking)


def async_save_pending() -> bool:
    return _async_queue is not None and _async_queue.get_num_unfinalized_calls() > 0


def _commit(root, iteration, tmp_dir, final_dir, delay=0.0):
    """Every rank's shards are on disk: rename into place, then move the tracker (rank 0)."""
    dist.barrier()
    if dist.get_rank() == 0:
        # shard files are fsynced by megatron-core's writer; the common files are not
        _fsync_tree_files(tmp_dir, [n for n in os.listdir(tmp_dir) if not n.endswith(".distcp")])
        _fsync_dir(tmp_dir)
        if delay:
            time.sleep(delay)   # tests: complete but not renamed
        if os.path.exists(final_dir):  # re-saving an iteration: keep the old one until replaced
            old = final_dir + ".old"
            shutil.rmtree(old, ignore_errors=True)
            os.rename(final_dir, old)
            os.rename(tmp_dir, final_dir)
            _fsync_dir(root)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp_dir, final_dir)
            _fsync_dir(root)
        if delay:
            time.sleep(delay)   # tests: renamed, tracker not yet moved
        tracker_tmp = os.path.join(root, TRACKER + ".tmp")
        with open(tracker_tmp, "w") as f:
            f.write(str(iteration))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tracker_tmp, os.path.join(root, TRACKER))
        _fsync_dir(root)
    dist.barrier()


def _describe_load_error(exc) -> str:
    """The first rank's underlying error from torch DCP's CheckpointException, else the error."""
    failures = getattr(exc, "failures", None)
    if failures:
        rank, failure = sorted(failures.items())[0]
        inner = getattr(failure, "exc", failure)
        if isinstance(inner, tuple):  # (exception, traceback frames)
            inner = inner[0]
        return f"rank {rank}: {type(inner).__name__}: {str(inner)[:200]}".rstrip(": ")
    return f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"


def _optimizer_count(optimizer) -> int:
    return len(getattr(optimizer, "chained_optimizers", [optimizer])) if optimizer is not None else 0


def _portable_args(args):
    """args without the per-rank fields, so every rank's common state is identical."""
    import argparse

    values = {k: v for k, v in vars(args).items() if k not in ("rank", "local_rank")}
    return argparse.Namespace(**values)


def _load_iteration(args) -> int | None:
    root = args.load
    iteration = read_tracker(root) if os.path.isdir(root) else None
    if getattr(args, "ckpt_step", None) is not None:   # Megatron's --ckpt-step: not the tracker's
        iteration = args.ckpt_step
    return iteration


def keep_checkpoint_vocab_padding(args):
    """Before the model is built: the padded vocabulary of the checkpoint under ``--load``.

    The padding rule (a multiple of --make-vocab-size-divisible-by x TP) gives another size at
    another TP; megatron-core then loads the embedding and output layer with a shape mismatch
    (they allow it) and leaves the extra rows at their random init, which changes every softmax.
    The trained size is right whenever TP divides it."""
    if not args.load:
        return
    iteration = _load_iteration(args)
    if iteration is None or not os.path.isdir(checkpoint_dir(args.load, iteration)):
        return
    try:
        common = dist_checkpointing.load_common_state_dict(checkpoint_dir(args.load, iteration))
    except (Exception, CheckpointException):  # megatron-core >= 0.19 reads it through torch DCP
        return  # load_checkpoint reports an unreadable checkpoint with its directory
    stored = getattr(common.get("args"), "padded_vocab_size", None)
    if stored and stored != args.padded_vocab_size:
        if stored % args.tensor_model_parallel_size:
            raise CheckpointError(
                f"{checkpoint_dir(args.load, iteration)}: its padded vocabulary ({stored}) does "
                f"not divide into --tensor-model-parallel-size {args.tensor_model_parallel_size} "
                f"shards")
        args.padded_vocab_size = stored


def load_checkpoint(model, optimizer, scheduler, args):
    """Load the latest checkpoint under ``--load``.

    Returns (iteration, consumed_train_samples, consumed_valid_samples, extra_state); iteration 0
    when ``--load`` holds no checkpoint yet (Megatron's behaviour: the same launch script starts a
    run and resumes it).
    """
    root = args.load
    iteration = _load_iteration(args)
    if iteration is None:
        if dist.get_rank() == 0:
            print(f" WARNING: no {TRACKER} under --load {root}; starting from scratch", flush=True)
        return 0, 0, 0, {}
    ckpt = checkpoint_dir(root, iteration)
    if not os.path.isdir(ckpt):
        raise CheckpointError(f"{os.path.join(root, TRACKER)} points at iteration {iteration}, "
                              f"but {ckpt} does not exist")
    try:
        common = dist_checkpointing.load_common_state_dict(ckpt)
    except (Exception, CheckpointException) as exc:  # 0.19 reads it through torch DCP
        raise CheckpointError(f"{ckpt}: checkpoint is corrupt or incomplete: cannot read its "
                              f"common state ({_describe_load_error(exc)})") from None
    same_layout = common.get("parallel_layout") == parallel_layout(args)
    load_rng = not args.no_load_rng and not args.finetune and common.get("has_rng", False)
    if load_rng and not same_layout:
        load_rng = False
        if dist.get_rank() == 0:
            print(f" note: parallel layout changed {common.get('parallel_layout')} -> "
                  f"{parallel_layout(args)}; RNG state is not restored", flush=True)
    load_optim = (not args.no_load_optim and not args.finetune and optimizer is not None
                  and common.get("has_optimizer", False))
    if load_optim and common.get("optimizer_count") != _optimizer_count(optimizer):
        # megatron-core chains one optimizer per parameter class (dense, expert) and merges them
        # when EP=1; its optimizer checkpoint cannot cross that change. Weights still load.
        load_optim = False
        if dist.get_rank() == 0:
            print(f" WARNING: {ckpt} was saved with {common.get('optimizer_count')} chained "
                  f"optimizer(s), this layout has {_optimizer_count(optimizer)} (EP=1 <-> EP>1); "
                  f"Adam state is re-initialised; weights and the LR schedule are loaded",
                  flush=True)
    sharded = _sharded_state(model, optimizer, args, include_optimizer=load_optim,
                             include_rng=load_rng, is_loading=True)
    try:
        with warnings.catch_warnings():  # torch DCP deprecation notices on every rank
            warnings.simplefilter("ignore")
            from megatron_moe.compat import checkpoint_options  # --dist-ckpt-strictness, ...

            state = checkpoint_options.loaded_state(dist_checkpointing.load(
                sharded, ckpt, get_default_load_sharded_strategy(ckpt),
                **checkpoint_options.load_kwargs(args)))
    except (Exception, CheckpointException) as exc:  # torch DCP's error is a BaseException
        raise CheckpointError(f"{ckpt}: checkpoint is corrupt or incomplete "
                              f"({_describe_load_error(exc)})") from None
    for key, chunk in zip(model_keys(model), model):
        unwrap(chunk).load_state_dict(state[key], strict=True)
    if load_optim:
        optimizer.load_state_dict(state["optimizer"])
    if (scheduler is not None and state.get("opt_param_scheduler") and not args.no_load_optim
            and not args.finetune):
        try:
            scheduler.load_state_dict(state["opt_param_scheduler"])
        except AssertionError as exc:  # megatron-core's check that the schedule flags match
            raise CheckpointError(
                f"{ckpt}: {exc}; pass --override-opt_param-scheduler to use this run's flags or "
                f"--use-checkpoint-opt_param-scheduler to keep the checkpoint's schedule") from None
    if load_rng:
        _set_rng_state(state["rng_state"])
    if args.finetune:
        return 0, 0, 0, {}
    if dist.get_rank() == 0:
        print(f" successfully loaded checkpoint from {root} at iteration {iteration}", flush=True)
    return (state["iteration"], state["consumed_train_samples"],
            state.get("consumed_valid_samples", 0), state.get("extra_state", {}))
