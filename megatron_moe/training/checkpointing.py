"""Megatron-layout checkpoints in megatron-core's torch_dist format, written atomically.

Layout (what Megatron-LM tools expect)::

    <save>/latest_checkpointed_iteration.txt     "100"
    <save>/iter_0000100/                         dist_checkpointing output (metadata.json, .metadata,
                                                 __<rank>_<i>.distcp, common.pt) and our
                                                 megatron_moe_checksums.json (checkpoint_manifest.py)

A save goes to ``<save>/iter_0000100.tmp`` and is renamed into place only after every rank
finished writing and the files' checksums are in the manifest; the tracker file is then replaced
atomically. A crash or kill during a save leaves the previous checkpoint and the tracker pointing
at it untouched; so does a full disk (checked before writing; a failed write removes the
``.tmp``). A load verifies every file against the manifest first and compares the model's shapes
with the checkpoint's, so damage names the file and another configuration names its flags.

Model and optimizer state are sharded tensors, so a checkpoint saved with one TP/EP/PP layout
loads into another (megatron-core resharding). Per-rank RNG state is restored only when the
layout is unchanged (it has no meaning across layouts; a note says so).
"""

from __future__ import annotations

import functools
import os
import random
import shutil
import threading
import warnings
from typing import NamedTuple

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
from megatron_moe.training import checkpoint_manifest as manifest
from megatron_moe.training import fsdp_dtensor_checkpoint
from megatron_moe.training import progress_log

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


_async_queue = None      # megatron-core's AsyncCallsQueue, created by the first --async-save
_async_pending = []      # (save root, .tmp dir, bytes needed) of each scheduled async save, in order


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


def save_checkpoint(iteration, model, optimizer, scheduler, args, consumed_train_samples,
                    consumed_valid_samples=0, extra_state: dict | None = None,
                    sharded_strategy=None, train_data_iterator=None):
    """Write ``<save>/iter_XXXXXXX`` atomically (``.tmp`` then rename, then the tracker).

    With ``--async-save`` the shards are written in the background (megatron-core's
    AsyncCallsQueue); the rename and tracker update run as the request's finalisation, on every
    rank, once all ranks finished writing (``finalize_async_save``). A save waits for the previous
    async save first, so at most one is in flight.

    ``sharded_strategy``: a megatron-core torch_dist save strategy other than the default (the HF
    import's streaming one, megatron_moe/hf/megatron_side.py).

    ``train_data_iterator``: the training reader(s), whose buffered micro-batches go into the
    checkpoint when megatron-core's rerun state machine asks for one to re-run an iteration.
    """
    from megatron_moe.compat.checkpoint import quiet_mcore_async_notice, wait_writer_ready

    root = args.save
    final_dir = checkpoint_dir(root, iteration)
    tmp_dir = final_dir + ".tmp"
    finalize_async_save(blocking=True)
    wait_writer_ready()
    quiet_mcore_async_notice()
    fsdp_dtensor = args.ckpt_format == "fsdp_dtensor"   # Megatron-FSDP's format
    if fsdp_dtensor:
        state = fsdp_dtensor_checkpoint.build_state(
            model, optimizer, args, include_optimizer=not args.no_save_optim,
            include_rng=not args.no_save_rng, is_loading=False, rng_state=_rng_state())
    else:
        state = _sharded_state(model, optimizer, args, include_optimizer=not args.no_save_optim,
                               include_rng=not args.no_save_rng, is_loading=False)
        from megatron_moe.training import result_validation

        rerun_state = result_validation.checkpoint_state(train_data_iterator)
        if rerun_state is not None:   # Megatron-LM's key: common part + one sharded object per rank
            state["rerun_state_machine"] = rerun_state
    needed = _prepare_save_dir(root, tmp_dir, state)
    common = dict(
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
    commit = functools.partial(_commit, root, iteration, tmp_dir, final_dir,
                               retain=getattr(args, "save_retain_interval", None),
                               log_progress=getattr(args, "log_progress", False),
                               async_save=getattr(args, "async_save", False))
    if fsdp_dtensor:
        try:
            fsdp_dtensor_checkpoint.save(state, common, tmp_dir, model, args)
            commit()
        except (Exception, CheckpointException) as exc:
            _save_failed(exc, root, tmp_dir, needed)
        return
    state.update(common)
    if getattr(args, "async_save", False):
        global _async_queue
        from megatron_moe.compat.checkpoint import async_save_kwargs

        try:
            request = dist_checkpointing.save(state, tmp_dir, strategy, async_sharded_save=True,
                                              **async_save_kwargs(),
                                              **checkpoint_options.save_kwargs(args))
        except (Exception, CheckpointException) as exc:
            _save_failed(exc, root, tmp_dir, needed)
        request.finalize_fns.append(commit)
        if _async_queue is None:   # --use-persistent-ckpt-worker: one long-lived writer process
            _async_queue = checkpoint_options.async_queue(args)
        _async_pending.append((root, tmp_dir, needed))
        _async_queue.schedule_async_request(request)
        return
    try:
        dist_checkpointing.save(state, tmp_dir, strategy, **checkpoint_options.save_kwargs(args))
        commit()
    except (Exception, CheckpointException) as exc:  # torch DCP's error is a BaseException
        _save_failed(exc, root, tmp_dir, needed)


def finalize_async_save(blocking: bool = False) -> list:
    """Finish the async saves whose writes are done (all of them when ``blocking``); a
    collective: every rank calls it at the same points (each iteration, before a save, at exit).
    Returns the finalised call ids. A write that failed (a full disk) raises CheckpointError
    here, on every rank, after its partial ``.tmp`` is removed."""
    global _async_queue
    if _async_queue is None:
        return []
    try:
        done = _async_queue.maybe_finalize_async_calls(blocking=blocking)
    except (Exception, CheckpointException) as exc:
        root, tmp_dir, needed = _async_pending[0]
        _async_queue = None   # its failed call is not retried; the run stops on this error
        _async_pending.clear()
        _save_failed(exc, root, tmp_dir, needed)
    del _async_pending[:len(done)]   # the queue finalises its calls in order
    return done


def async_save_pending() -> bool:
    return _async_queue is not None and _async_queue.get_num_unfinalized_calls() > 0


# --- disk space ------------------------------------------------------------------------------------
def _free_bytes(path: str) -> int:
    return shutil.disk_usage(path).free


def _size(n: int) -> str:
    """Bytes, exact for scripts and scaled for people: '1364643 bytes (1.30 MiB)'."""
    scaled, unit = float(n), "B"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if scaled < 1024 or unit == "TiB":
            break
        scaled /= 1024
    return f"{n} bytes" if unit == "B" else f"{n} bytes ({scaled:.2f} {unit})"


def _state_bytes(state) -> int:
    """The tensor bytes this rank writes: its main replicas (each shard is written once)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, is_main_replica
    from torch.distributed.tensor import DTensor

    # fsdp_dtensor: each rank writes its DTensor shards
    return sum(v.data.numel() * v.data.element_size() for v in nested_values(state)
               if isinstance(v, ShardedTensor) and isinstance(v.data, torch.Tensor)
               and is_main_replica(v.replica_id)) + \
        sum(v.to_local().numel() * v.element_size() for v in nested_values(state)
            if isinstance(v, DTensor))


def _last_checkpoint(root: str) -> str:
    """Names the checkpoint a failed save leaves in place (the tracker's)."""
    try:
        last = read_tracker(root)
    except CheckpointError:
        last = None
    if last is None or not os.path.isdir(checkpoint_dir(root, last)):
        return f"no earlier checkpoint under {root}"
    return f"the last checkpoint, {checkpoint_dir(root, last)} (iteration {last}), is kept"


def _prepare_save_dir(root: str, tmp_dir: str, state) -> int:
    """A fresh ``.tmp`` (rank 0), after checking the file system has room for the save: about the
    tracker's previous checkpoint's size, or, for a run's first save, the state's tensor bytes
    (every rank's main replicas). A collective; the same verdict on every rank. Returns the
    bytes needed."""
    sizes = [None] * dist.get_world_size()
    dist.all_gather_object(sizes, _state_bytes(state))
    verdict = None
    if dist.get_rank() == 0:
        try:
            os.makedirs(root, exist_ok=True)
            shutil.rmtree(tmp_dir, ignore_errors=True)  # leftover of a killed save
            last = read_tracker(root)
            previous = manifest.total_bytes(checkpoint_dir(root, last)) if last is not None \
                else None
            needed = previous or sum(sizes)
            free = _free_bytes(root)
            if needed > free:
                verdict = ("full", needed, free)
            else:
                os.makedirs(tmp_dir)
                verdict = ("ok", needed, free)
        except (OSError, CheckpointError) as exc:   # every rank must hear of it, not wait
            verdict = ("error", f"{type(exc).__name__}: {exc}", 0)
    kind, needed, free = _from_rank0(verdict)
    if kind == "error":
        raise CheckpointError(f"{tmp_dir}: cannot start the save ({needed})")
    if kind == "full":
        raise CheckpointError(
            f"{tmp_dir}: not enough disk space for this checkpoint: it needs about "
            f"{_size(needed)}, {_size(free)} are free; nothing was written, "
            f"{_last_checkpoint(root)}")
    return needed


def _is_disk_full(exc) -> bool:
    """ENOSPC anywhere in the error: its causes, or torch DCP's per-rank failures."""
    import errno

    seen, todo = set(), [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, tuple):   # megatron-core's WRAPPED_EXCEPTION: (exception, traceback)
            todo.extend(x for x in e if isinstance(x, BaseException))
            continue
        if (isinstance(e, OSError) and e.errno == errno.ENOSPC) or \
                "No space left on device" in str(e):
            return True
        todo += [e.__cause__, e.__context__, getattr(e, "exc", None)]
        todo += list((getattr(e, "failures", None) or {}).values())
    return False


def _save_failed(exc, root: str, tmp_dir: str, needed: int):
    """Remove the partial ``.tmp`` and raise one CheckpointError naming the path, the space it
    needed and what is free, and the checkpoint kept. Every rank raises; rank 0 removes."""
    if dist.get_rank() == 0:
        shutil.rmtree(tmp_dir, ignore_errors=True)
    free = _free_bytes(root) if os.path.isdir(root) else 0
    # megatron-core 0.16 keeps the writer's OSError (ENOSPC) in the chain; 0.19 passes on only
    # "error: <class 'OSError'>", so there a disk still short of the save's size says it
    space = f"it needs about {_size(needed)}, {_size(free)} are free once the partial save is removed"
    what = (f"no space left on device: {space}" if _is_disk_full(exc) or needed > free else
            f"the save failed ({_describe_load_error(exc)}); {space}")
    raise CheckpointError(f"{tmp_dir}: {what}; removed {os.path.basename(tmp_dir)}, "
                          f"{_last_checkpoint(root)}") from None


def _from_rank0(value):
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


# --- checksums --------------------------------------------------------------------------------------
def _write_checksums(tmp_dir: str, iteration: int):
    """A collective: every rank checksums its share of the saved files (striped over the ranks,
    so a large checkpoint is read in parallel), rank 0 writes the manifest into ``.tmp``."""
    rank, world = dist.get_rank(), dist.get_world_size()
    names = _from_rank0(manifest.listed_files(tmp_dir) if rank == 0 else None)
    parts = [None] * world
    dist.all_gather_object(parts, manifest.checksum_files(tmp_dir, names[rank::world]))
    if rank == 0:
        manifest.write_manifest(tmp_dir, {k: v for part in parts for k, v in part.items()},
                                iteration)


def verify_checkpoint(ckpt: str) -> list | None:
    """A collective: every file of ``ckpt`` against its manifest, striped over the ranks. Returns
    the problems (one line each, naming the file; empty: verified), or None when the checkpoint
    has no manifest (saved before checksums)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    found = None
    if rank == 0:
        try:
            found = ("manifest", manifest.read_manifest(ckpt))
        except manifest.ManifestError as exc:
            found = ("problem", str(exc))
    kind, value = _from_rank0(found)
    if kind == "problem":
        return [value]
    if value is None:
        return None
    names = sorted(value["files"])
    parts = [None] * world
    dist.all_gather_object(parts, manifest.check_files(ckpt, value, names[rank::world]))
    return sorted(p for part in parts for p in part)


def _previous_good(root: str, iteration: int) -> str:
    """Offers the newest earlier checkpoint under ``root`` that verifies (a collective)."""
    earlier = [it for it in _from_rank0(manifest.iterations_in(root) if dist.get_rank() == 0
                                        else None) if it < iteration]
    for it in reversed(earlier):
        problems = verify_checkpoint(checkpoint_dir(root, it))
        if problems is None:
            return (f"the previous checkpoint {checkpoint_dir(root, it)} was saved before "
                    f"checksums (cannot be verified): --ckpt-step {it} loads it")
        if not problems:
            return (f"the previous checkpoint {checkpoint_dir(root, it)} verifies: resume from "
                    f"it with --ckpt-step {it}")
    return f"no earlier checkpoint under {root} verifies"


def _commit(root, iteration, tmp_dir, final_dir, retain=None, log_progress=False,
            async_save=False):
    """Every rank's shards are on disk: checksum them, rename into place, then move the tracker
    (rank 0), then retire the checkpoint the tracker named before (--save-retain-interval)."""
    dist.barrier()
    _write_checksums(tmp_dir, iteration)
    if dist.get_rank() == 0:
        # shard files are fsynced by megatron-core's writer; the common files are not
        _fsync_tree_files(tmp_dir, [n for n in os.listdir(tmp_dir) if not n.endswith(".distcp")])
        _fsync_dir(tmp_dir)
        _rename_into_place(root, tmp_dir, final_dir)
        previous = _tracked_iteration(root)
        _write_tracker(root, iteration)
        if log_progress and async_save:
            progress_log.append(root, f"Saved async checkpoint\tIteration: {iteration}",
                                barrier=False)
        retired = retired_iteration(previous, iteration, retain)
        if retired is not None:
            _delete_in_background(root, retired, log_progress)
    dist.barrier()


# --- --save-retain-interval -----------------------------------------------------------------------
def retired_iteration(previous, iteration, retain):
    """Megatron-LM's rule, applied once the tracker names ``iteration``: the checkpoint it named
    before (``previous``) is deleted unless it is a multiple of ``retain`` (or there is none, or it
    is this one, re-saved). Only ever the previous one: a checkpoint the tracker never named (a
    crashed save's leftovers, another run's) is not touched, and the tracker's is never deleted."""
    if retain is None or not previous or previous == iteration or previous % retain == 0:
        return None
    return previous


def _tracked_iteration(root):
    try:
        return read_tracker(root)
    except CheckpointError:   # a tracker we cannot read names nothing to retire
        return None


_deletion = None   # the background deletion in flight (at most one), a thread


def _delete_in_background(root, iteration, log_progress):
    """Delete ``iter_<iteration>`` in a thread, as Megatron-LM does, so training goes on; a
    symbolic link is left alone (Megatron's rule) and a failure is reported, never fatal."""
    global _deletion
    path = checkpoint_dir(root, iteration)
    if os.path.islink(path):
        print(f"  skipping deleting checkpoint from iteration {iteration:7d} at {root} since it "
              f"is a symbolic link", flush=True)
        return
    wait_for_deletion()

    def delete():
        try:
            shutil.rmtree(path)
        except OSError as exc:
            print(f"  encountered exception \"{exc}\" when trying to delete checkpoint from "
                  f"iteration {iteration:7d} at {root}", flush=True)
            return
        print(f"  successfully deleted checkpoint from iteration {iteration:7d} at {root}",
              flush=True)
        if log_progress:
            progress_log.append(root, f"Deleted checkpoint\tIteration: {iteration}",
                                barrier=False)

    _deletion = threading.Thread(target=delete, name=f"delete-{os.path.basename(path)}")
    _deletion.start()


def wait_for_deletion():
    """The background deletion, if any, finished (before the next one, and at the end of a run)."""
    global _deletion
    if _deletion is not None:
        _deletion.join()
        _deletion = None


# _rename_into_place and _write_tracker are separate steps so that the crash tests can slow each
# one down and kill the job between them.
def _rename_into_place(root, tmp_dir, final_dir):
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


def _write_tracker(root, iteration):
    tracker_tmp = os.path.join(root, TRACKER + ".tmp")
    with open(tracker_tmp, "w") as f:
        f.write(str(iteration))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tracker_tmp, os.path.join(root, TRACKER))
    _fsync_dir(root)


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


def _short_shards(ckpt: str) -> str:
    """For a checkpoint without checksums: the shard files shorter than the byte ranges torch
    DCP's .metadata gives them ("" when none is, or the metadata is unreadable)."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        storage = FileSystemReader(ckpt).read_metadata().storage_data
    except Exception:
        return ""
    needs = {}
    for where in storage.values():
        needs[where.relative_path] = max(needs.get(where.relative_path, 0),
                                         where.offset + where.length)
    short = []
    for name, need in sorted(needs.items()):
        path = os.path.join(ckpt, name)
        size = os.path.getsize(path) if os.path.isfile(path) else None
        if size is None or size < need:
            short.append(f"{path}: " + ("missing" if size is None else
                                        f"truncated: {size} bytes, its tensors need {need}"))
    more = f" (and {len(short) - 1} more file(s))" if len(short) > 1 else ""
    return f"{short[0]}{more}:" if short else ""


def _unreadable(verified: bool) -> str:
    # a checkpoint whose files match their checksums is intact: what fails is this run's reading
    return ("its files match their checksums, yet it does not load into this model" if verified
            else "checkpoint is corrupt or incomplete")


# dest, flag: the arguments that decide a parameter's shape or presence (values as saved, after
# validate_args filled the derived ones such as --ffn-hidden-size)
_SHAPE_FLAGS = (
    ("num_layers", "--num-layers"), ("hidden_size", "--hidden-size"),
    ("ffn_hidden_size", "--ffn-hidden-size"), ("num_attention_heads", "--num-attention-heads"),
    ("num_query_groups", "--num-query-groups"), ("kv_channels", "--kv-channels"),
    ("padded_vocab_size", "--vocab-size (padded)"),
    ("max_position_embeddings", "--max-position-embeddings"),
    ("position_embedding_type", "--position-embedding-type"),
    ("normalization", "--normalization"), ("swiglu", "--swiglu"),
    ("untie_embeddings_and_output_weights", "--untie-embeddings-and-output-weights"),
    ("add_bias_linear", "--add-bias-linear"), ("add_qkv_bias", "--add-qkv-bias"),
    ("qk_layernorm", "--qk-layernorm"), ("num_experts", "--num-experts"),
    ("moe_ffn_hidden_size", "--moe-ffn-hidden-size"),
    ("moe_shared_expert_intermediate_size", "--moe-shared-expert-intermediate-size"),
    ("moe_shared_expert_gate", "--moe-shared-expert-gate"), ("moe_layer_freq", "--moe-layer-freq"),
    ("moe_router_enable_expert_bias", "--moe-router-enable-expert-bias"),
    ("multi_latent_attention", "--multi-latent-attention"), ("q_lora_rank", "--q-lora-rank"),
    ("kv_lora_rank", "--kv-lora-rank"), ("qk_head_dim", "--qk-head-dim"),
    ("qk_pos_emb_head_dim", "--qk-pos-emb-head-dim"), ("v_head_dim", "--v-head-dim"),
    ("mtp_num_layers", "--mtp-num-layers"),
)


def _model_mismatch(model_sd, ckpt: str, stored_args, args) -> str | None:
    """Before megatron-core's load: do this model's tensors have the checkpoint's global shapes?
    A collective (ranks hold different tensors; all raise or none). Names the flags whose saved
    and current values differ, and one tensor's two shapes."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    shapes, missing = [], []
    try:
        stored = FileSystemReader(ckpt).read_metadata().state_dict_metadata
    except Exception:
        stored = None   # the load itself reports an unreadable checkpoint
    for sh in nested_values(model_sd) if stored is not None else ():
        # the vocabulary rows may differ by design (keep_checkpoint_vocab_padding)
        if not isinstance(sh, ShardedTensor) or sh.allow_shape_mismatch:
            continue
        meta = stored.get(sh.key)
        if meta is None:
            missing.append(sh.key)
        elif isinstance(meta, TensorStorageMetadata) and tuple(meta.size) != tuple(sh.global_shape):
            shapes.append((sh.key, list(meta.size), list(sh.global_shape)))
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, (shapes, missing))
    shapes = sorted({(k, tuple(a), tuple(b)) for part in parts for k, a, b in part[0]})
    missing = sorted({k for part in parts for k in part[1]})
    if not shapes and not missing:
        return None
    flags = []
    for dest, flag in _SHAPE_FLAGS:
        if stored_args is not None and hasattr(stored_args, dest) and hasattr(args, dest):
            saved, now = getattr(stored_args, dest), getattr(args, dest)
            if saved != now:
                flags.append(f"{flag} {saved} in the checkpoint, {now} on this command line")
    details = []
    if shapes:
        key, saved, now = shapes[0]
        details.append(f"{len(shapes)} tensor(s) differ in shape, e.g. {key}: {list(saved)} in the "
                       f"checkpoint, {list(now)} in this model")
    if missing:
        details.append(f"{len(missing)} tensor(s) of this model are not in the checkpoint, e.g. "
                       f"{missing[0]}")
    what = "; ".join(flags) if flags else "; ".join(details)
    also = f" ({'; '.join(details)})" if flags else ""
    return (f"{ckpt} holds a model of another configuration: {what}{also}; run with the "
            f"checkpoint's values (tools/checkpoint_info.py {ckpt} lists its args)")


# megatron-core's OptimizerParamScheduler._check_and_set names -> the flags they come from
_SCHEDULE_FLAGS = {
    "learning rate": "--lr", "minimum learning rate": "--min-lr",
    "warmup iterations": "--lr-warmup-iters (in samples: x --global-batch-size)",
    "total number of iterations": "--lr-decay-iters (in samples: x --global-batch-size)",
    "learning rate decay style": "--lr-decay-style",
    "start weight decay": "--start-weight-decay", "end weight decay": "--end-weight-decay",
    "total number of weight decay iterations": "--train-iters (in samples: x --global-batch-size)",
    "weight decay incr style": "--weight-decay-incr-style",
}


def _schedule_mismatch(exc) -> str:
    """Megatron's rule without either flag: the command line's schedule must equal the
    checkpoint's. Its assertion, said with the flag."""
    import re

    found = re.search(r"class input value (.*) and checkpoint ?value (.*) for (.*) do not match",
                      str(exc))
    what = (f"{_SCHEDULE_FLAGS.get(found[3], found[3])} is {found[1]} on this command line, "
            f"{found[2]} in the checkpoint's schedule" if found else str(exc))
    return (f"{what}; pass --override-opt_param-scheduler to train with this command line's "
            f"schedule or --use-checkpoint-opt_param-scheduler to keep the checkpoint's")


def _schedule_bounds_to_param_groups(optimizer, scheduler):
    """The loaded optimizer state restored each param group's ``max_lr``/``min_lr`` from the
    checkpoint, and megatron-core's scheduler reads a group's bounds before its own: with
    --override-opt_param-scheduler the run trained at the checkpoint's LR (Megatron-LM's
    issue #1138; its load_checkpoint now re-applies the command line's bounds). The groups take
    the scheduler's bounds: the command line's with --override-opt_param-scheduler, the
    checkpoint's with --use-checkpoint-opt_param-scheduler (also when the optimizer state was
    not loaded). Only the groups on the default schedule (megatron-core's ``default_config``:
    max_lr = --lr); a group with its own LR (--decoupled-lr; 0.19's MuP scaling)
    keeps it."""
    for group in optimizer.param_groups:
        if group.get("default_config", True) and not group.get("is_decoupled_lr", False):
            group["max_lr"], group["min_lr"] = scheduler.max_lr, scheduler.min_lr
    scheduler.step(0)


def _decoupled_lr_change(saved_args, args) -> str:
    """--decoupled-lr / --decoupled-min-lr against the checkpoint's (its optimizer state holds
    their param groups): a change is refused before the load, one line naming the flag
    (megatron-core 0.16 would train on at the checkpoint's values, 0.19 fails to pair the groups,
    and adding or dropping the flag changes the number of groups); '' when they agree."""
    def bounds(a):
        if getattr(a, "decoupled_lr", None) is None:
            return None
        low = getattr(a, "decoupled_min_lr", None)
        return a.decoupled_lr, (a.min_lr if low is None else low)

    if saved_args is None:
        return ""
    saved, wanted = bounds(saved_args), bounds(args)
    if saved == wanted:
        return ""
    if saved is None:
        return "trained without --decoupled-lr; it cannot be added on resume (or pass --no-load-optim)"
    if wanted is None:
        return (f"trained with --decoupled-lr {saved[0]}; pass it to resume (or "
                f"--no-load-optim)")
    flag, i = ("--decoupled-lr", 0) if saved[0] != wanted[0] else ("--decoupled-min-lr", 1)
    return (f"{flag} is {wanted[i]} on this command line, {saved[i]} in the checkpoint (a change "
            f"of the decoupled LR on resume is not supported; or pass --no-load-optim)")


def _optimizer_count(optimizer) -> int:
    return len(getattr(optimizer, "chained_optimizers", [optimizer])) if optimizer is not None else 0


def _portable_args(args):
    """args without the per-rank fields, so every rank's common state is identical."""
    import argparse

    values = {k: v for k, v in vars(args).items() if k not in ("rank", "local_rank")}
    return argparse.Namespace(**values)


def iteration_to_load(args, root: str | None = None) -> int | None:
    """The iteration ``root`` (default ``--load``) would resume (its tracker's, or
    ``--ckpt-step``); None when it holds no checkpoint."""
    root = args.load if root is None else root
    iteration = read_tracker(root) if os.path.isdir(root) else None
    if getattr(args, "ckpt_step", None) is not None:   # Megatron's --ckpt-step: not the tracker's
        iteration = args.ckpt_step
    return iteration


class CheckpointSource(NamedTuple):
    flag: str                 # the flag that named the directory (error messages say it)
    root: str | None
    iteration: int | None     # None: nothing to load
    finetune: bool            # weights only; iteration, optimizer, scheduler and RNG start fresh


def checkpoint_source(args) -> CheckpointSource:
    """What load_checkpoint reads: the checkpoint under ``--load``; when ``--load`` holds none
    (no tracker: Megatron-LM's checkpoint_exists), the one under ``--pretrained-checkpoint``,
    loaded as with ``--finetune`` (Megatron-LM's load_checkpoint). The next launch with the same
    flags resumes the finetune's own checkpoint under ``--load``. A CheckpointError names the
    flag."""
    from megatron_moe.training.checkpoint_args import has_checkpoint

    pretrained = getattr(args, "pretrained_checkpoint", None)
    if pretrained is not None and not has_checkpoint(args.load):
        if not has_checkpoint(pretrained):
            raise CheckpointError(f"--pretrained-checkpoint: no checkpoint under {pretrained} "
                                  f"(no {TRACKER})" + ("" if args.load is None else
                                                       f" nor under --load {args.load}"))
        source = CheckpointSource("--pretrained-checkpoint", pretrained, None, True)
    elif args.load is None:
        return CheckpointSource("--load", None, None, args.finetune)
    else:
        source = CheckpointSource("--load", args.load, None, args.finetune)
    try:
        return source._replace(iteration=iteration_to_load(args, source.root))
    except CheckpointError as exc:   # an unreadable tracker
        raise CheckpointError(f"{source.flag}: {exc}") from None


def keep_checkpoint_vocab_padding(args):
    """Before the model is built: the padded vocabulary of the checkpoint to load
    (checkpoint_source: ``--load``'s or ``--pretrained-checkpoint``'s).

    The padding rule (a multiple of --make-vocab-size-divisible-by x TP) gives another size at
    another TP; megatron-core then loads the embedding and output layer with a shape mismatch
    (they allow it) and leaves the extra rows at their random init, which changes every softmax.
    The trained size is right whenever TP divides it."""
    root, iteration = checkpoint_source(args)[1:3]
    if iteration is None or not os.path.isdir(checkpoint_dir(root, iteration)):
        return
    try:
        common = read_common(checkpoint_dir(root, iteration))
    except (Exception, CheckpointException):  # megatron-core >= 0.19 reads it through torch DCP
        return  # load_checkpoint reports an unreadable checkpoint with its directory
    stored = getattr(common.get("args"), "padded_vocab_size", None)
    if stored and stored != args.padded_vocab_size:
        if stored % args.tensor_model_parallel_size:
            raise CheckpointError(
                f"{checkpoint_dir(root, iteration)}: its padded vocabulary ({stored}) does "
                f"not divide into --tensor-model-parallel-size {args.tensor_model_parallel_size} "
                f"shards")
        args.padded_vocab_size = stored


def load_checkpoint(model, optimizer, scheduler, args):
    """Load the latest checkpoint under ``--load`` (or ``--pretrained-checkpoint``'s:
    checkpoint_source).

    Returns (iteration, consumed_train_samples, consumed_valid_samples, extra_state); iteration 0
    when ``--load`` holds no checkpoint yet (Megatron's behaviour: the same launch script starts a
    run and resumes it).
    """
    _, root, iteration, finetune = checkpoint_source(args)
    if iteration is None:
        if dist.get_rank() == 0:
            print(f" WARNING: no {TRACKER} under --load {root}; starting from scratch", flush=True)
        return 0, 0, 0, {}
    ckpt = checkpoint_dir(root, iteration)
    if not os.path.isdir(ckpt):
        raise CheckpointError(f"{os.path.join(root, TRACKER)} points at iteration {iteration}, "
                              f"but {ckpt} does not exist")
    problems = verify_checkpoint(ckpt)
    if problems:
        more = f" (and {len(problems) - 1} more file(s))" if len(problems) > 1 else ""
        raise CheckpointError(f"{problems[0]}{more}; {_previous_good(root, iteration)}")
    if problems is None and dist.get_rank() == 0:
        print(f" note: {ckpt} has no {manifest.MANIFEST} (saved before checkpoints carried "
              f"checksums): loading it without verifying its files", flush=True)
    verified = problems is not None
    if fsdp_dtensor_checkpoint.is_fsdp_dtensor(ckpt) and not _megatron_fsdp_wrapped(model):
        return _load_fsdp_dtensor_weights(model, optimizer, scheduler, args, ckpt, verified,
                                          finetune)
    fsdp_dtensor = _check_format(ckpt, args)
    try:
        common = read_common(ckpt)
    except (Exception, CheckpointException) as exc:  # 0.19 reads it through torch DCP
        raise CheckpointError(f"{ckpt}: {_unreadable(verified)}: cannot read its common state "
                              f"({_describe_load_error(exc)})") from None
    same_layout = common.get("parallel_layout") == parallel_layout(args)
    load_rng = not args.no_load_rng and not finetune and common.get("has_rng", False)
    if load_rng and not same_layout:
        load_rng = False
        if dist.get_rank() == 0:
            print(f" note: parallel layout changed {common.get('parallel_layout')} -> "
                  f"{parallel_layout(args)}; RNG state is not restored", flush=True)
    load_optim = (not args.no_load_optim and not finetune and optimizer is not None
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
    changed = _decoupled_lr_change(common.get("args"), args) if load_optim else ""
    if changed:   # the optimizer state's param groups are the checkpoint's
        raise CheckpointError(f"{ckpt}: {changed}")
    if fsdp_dtensor:
        state = _load_fsdp_dtensor(model, optimizer, args, ckpt, verified, common, load_optim,
                                   load_rng)
        return _restore(state, model, optimizer, scheduler, args, ckpt, root, finetune,
                        load_optim, load_rng, rerun_template=None, fsdp_dtensor=True)
    sharded = _sharded_state(model, optimizer, args, include_optimizer=load_optim,
                             include_rng=load_rng, is_loading=True)
    # megatron-core's rerun state machine (a re-run pending: Megatron-LM's rerun checkpoint), only
    # into the same layout, as Megatron-LM
    rerun_template = None
    if not finetune and same_layout:
        from megatron_moe.training import result_validation

        rerun_template = result_validation.checkpoint_template(common.get("rerun_state_machine"))
        if rerun_template is not None:
            sharded["rerun_state_machine"] = rerun_template
    elif not same_layout and "rerun_state_machine" in common and dist.get_rank() == 0:
        print("Job sharding has changed: Rerun state will be ignored", flush=True)
    # every model chunk's tensors ("model", or "model0", "model1", ... with virtual stages)
    mismatch = _model_mismatch({key: sharded[key] for key in model_keys(model)}, ckpt,
                               common.get("args"), args)
    if mismatch:
        raise CheckpointError(mismatch)
    try:
        with warnings.catch_warnings():  # torch DCP deprecation notices on every rank
            warnings.simplefilter("ignore")
            from megatron_moe.compat import checkpoint_options  # --dist-ckpt-strictness, ...

            state = checkpoint_options.loaded_state(dist_checkpointing.load(
                sharded, ckpt, get_default_load_sharded_strategy(ckpt),
                **checkpoint_options.load_kwargs(args)))
    except (Exception, CheckpointException) as exc:  # torch DCP's error is a BaseException
        short = "" if verified else _short_shards(ckpt)
        if short:   # torch DCP raised on every rank: the search for an older one is collective
            raise CheckpointError(f"{short} {_unreadable(verified)}; "
                                  f"{_previous_good(root, iteration)}") from None
        raise CheckpointError(f"{ckpt}: {_unreadable(verified)} "
                              f"({_describe_load_error(exc)})") from None
    return _restore(state, model, optimizer, scheduler, args, ckpt, root, finetune, load_optim,
                    load_rng, rerun_template)


def read_common(ckpt: str) -> dict:
    """The run state beside the tensors (args, iteration, ...) of either format, read locally."""
    if fsdp_dtensor_checkpoint.is_fsdp_dtensor(ckpt):
        return fsdp_dtensor_checkpoint.load_common(ckpt)
    return dist_checkpointing.load_common_state_dict(ckpt)


def _check_format(ckpt: str, args) -> bool:
    """True for an fsdp_dtensor checkpoint; a CheckpointError when it is not the format
    --ckpt-format asks for (Megatron-FSDP's and torch_dist's do not load into each other)."""
    fsdp_dtensor = fsdp_dtensor_checkpoint.is_fsdp_dtensor(ckpt)
    if fsdp_dtensor != (args.ckpt_format == "fsdp_dtensor"):
        saved = "fsdp_dtensor (Megatron-FSDP's)" if fsdp_dtensor else "torch_dist"
        raise CheckpointError(f"{ckpt} is a {saved} checkpoint; this run has --ckpt-format "
                              f"{args.ckpt_format}: resume it with the format it was saved in")
    return fsdp_dtensor


def _load_fsdp_dtensor(model, optimizer, args, ckpt, verified, common, load_optim,
                       load_rng) -> dict:
    state = fsdp_dtensor_checkpoint.build_state(
        model, optimizer, args, include_optimizer=load_optim, include_rng=load_rng,
        is_loading=True, rng_state=_rng_state())
    strict = getattr(args, "strict_fsdp_dtensor_load", True)
    try:
        loaded = fsdp_dtensor_checkpoint.load(state, ckpt, model, args, strict=strict)
    except (Exception, CheckpointException) as exc:  # torch DCP's error is a BaseException
        raise CheckpointError(f"{ckpt}: {_unreadable(verified)} ({_describe_load_error(exc)})"
                              + ("" if not strict else "; --no-strict-fsdp-dtensor-load loads "
                                 "what it holds")) from None
    loaded.update(common)
    if load_rng:
        loaded["rng_state"] = fsdp_dtensor_checkpoint.rank_rng_state(loaded["rng_state"])
    return loaded


def _megatron_fsdp_wrapped(model) -> bool:
    """Whether the chunks are Megatron-FSDP's (training with --use-megatron-fsdp); the inference
    tools build a bare model whatever flags the checkpoint stored."""
    from megatron.core.distributed import FullyShardedDataParallel

    return any(isinstance(chunk, FullyShardedDataParallel) for chunk in model)


def _load_fsdp_dtensor_weights(model, optimizer, scheduler, args, ckpt, verified, finetune):
    """An fsdp_dtensor checkpoint into a model without Megatron-FSDP: its weights only
    (fsdp_dtensor_checkpoint.load_model_weights), for the inference tools (no optimizer, no
    scheduler) and --finetune / --pretrained-checkpoint. A resume is refused in one line: the
    optimizer state is in Megatron-FSDP's own sharding, which only Megatron-FSDP reads back
    (Megatron-LM's rule too)."""
    if not (finetune or (optimizer is None and scheduler is None)):
        raise CheckpointError(
            f"{ckpt} is a fsdp_dtensor (Megatron-FSDP's) checkpoint; this run has no "
            f"--use-megatron-fsdp: resume it with --use-megatron-fsdp --ckpt-format fsdp_dtensor, "
            f"or load its weights only with --finetune or --pretrained-checkpoint (optimizer, "
            f"schedule and RNG start fresh)")
    try:
        common = read_common(ckpt)
        filled = fsdp_dtensor_checkpoint.load_model_weights(
            model, ckpt, strict=getattr(args, "strict_fsdp_dtensor_load", True))
    except (Exception, CheckpointException) as exc:  # torch DCP's error is a BaseException
        raise CheckpointError(f"{ckpt}: {_unreadable(verified)} ({_describe_load_error(exc)})"
                              ) from None
    if dist.get_rank() == 0:
        print(f" loaded the weights of the fsdp_dtensor checkpoint {ckpt} ({filled} tensors on "
              f"rank 0) into a model without Megatron-FSDP"
              + (" for finetuning (iteration 0; optimizer, scheduler and RNG state not loaded)"
                 if finetune else ""), flush=True)
    if finetune:
        return 0, 0, 0, {}
    return (common["iteration"], common.get("consumed_train_samples", 0),
            common.get("consumed_valid_samples", 0), common.get("extra_state", {}))


def _restore(state, model, optimizer, scheduler, args, ckpt, root, finetune, load_optim,
             load_rng, rerun_template, fsdp_dtensor=False):
    """The loaded ``state`` into the model, optimizer, scheduler, RNG and rerun machine."""
    for key, chunk in zip(model_keys(model), model):
        if fsdp_dtensor:   # Megatron-FSDP's wrapper maps its own keys; DCP filled its shards
            chunk.load_state_dict(state[key], strict=getattr(args, "strict_fsdp_dtensor_load",
                                                             True))
        else:
            unwrap(chunk).load_state_dict(state[key], strict=True)
    if load_optim:
        from megatron_moe.compat import checkpoint as compat_checkpoint

        compat_checkpoint.align_loaded_param_group_bounds(state["optimizer"], args.lr, args.min_lr)
        optimizer.load_state_dict(state["optimizer"])
    if (scheduler is not None and state.get("opt_param_scheduler") and not args.no_load_optim
            and not finetune):
        try:
            scheduler.load_state_dict(state["opt_param_scheduler"])
        except AssertionError as exc:  # megatron-core's check that the schedule flags match
            raise CheckpointError(f"{ckpt}: {_schedule_mismatch(exc)}") from None
        if optimizer is not None and (args.override_opt_param_scheduler
                                      or args.use_checkpoint_opt_param_scheduler):
            _schedule_bounds_to_param_groups(optimizer, scheduler)
    if load_rng and state.get("rng_state") is not None:
        _set_rng_state(state["rng_state"])
    if rerun_template is not None:
        from megatron_moe.training import result_validation

        result_validation.machine().load_state_dict(state["rerun_state_machine"])
    if finetune:
        if dist.get_rank() == 0:
            print(f" loaded the weights of {ckpt} for finetuning (iteration 0; optimizer, "
                  f"scheduler and RNG state not loaded)", flush=True)
        return 0, 0, 0, {}
    if dist.get_rank() == 0:
        print(f" successfully loaded checkpoint from {root} at iteration {state['iteration']}",
              flush=True)
    return (state["iteration"], state["consumed_train_samples"],
            state.get("consumed_valid_samples", 0), state.get("extra_state", {}))
