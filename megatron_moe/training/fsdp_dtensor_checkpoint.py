"""Megatron-LM's ``fsdp_dtensor`` checkpoint format, the one Megatron-FSDP saves and loads
(``--use-megatron-fsdp --ckpt-format fsdp_dtensor``; Megatron-LM's
``megatron/training/checkpointing.py``, core_v0.16.1 / core_v0.19.0).

``iter_XXXXXXX/`` holds one torch.distributed.checkpoint (DCP) save: the model's parameters as the
DTensor shards Megatron-FSDP keeps (``model``, ``model0``, ...), the distributed optimizer's
state in its ``fsdp_dtensor`` form (one DTensor per parameter and moment), and as pickled
objects the args, iteration, scheduler, RNG states (Megatron's ``"(pp, tp)"`` key, one entry per
data-parallel rank) and the run state the torch_dist path keeps in ``common.pt``. Before DCP sees
them the state dicts pass megatron-core's own preprocessing, as Megatron-LM's do: SwiGLU's fused
``linear_fc1`` split into its ``_w`` / ``_v`` halves and expert keys renumbered to global expert
indices, so a checkpoint moves between data- and expert-parallel sizes.

The save is atomic as every save here (``.tmp``, checksums, rename, tracker;
training/checkpointing.py); a load verifies the checksums first.
"""

from __future__ import annotations

import os
import re
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import default_planner

# What a torch_dist checkpoint keeps in common.pt; here they are DCP's pickled objects
COMMON_KEYS = ("iteration", "checkpoint_version", "args", "parallel_layout",
               "consumed_train_samples", "consumed_valid_samples", "opt_param_scheduler",
               "extra_state", "has_optimizer", "optimizer_count", "has_rng")


def is_fsdp_dtensor(ckpt: str) -> bool:
    """A DCP save without megatron-core's dist_checkpointing metadata (metadata.json)."""
    return (os.path.isfile(os.path.join(ckpt, ".metadata"))
            and not os.path.isfile(os.path.join(ckpt, "metadata.json")))


def _optimizer_metadata() -> dict:
    # Megatron-LM's _build_sharded_state_dict_metadata for fsdp_dtensor
    from megatron.core import parallel_state

    return {"distrib_optim_sharding_type": "fsdp_dtensor", "singleton_local_shards": False,
            "chained_optim_avoid_prefix": True,
            "dp_cp_group": parallel_state.get_data_parallel_group(with_context_parallel=True)}


def _rng_key() -> str:
    from megatron.core import parallel_state

    return (f"({parallel_state.get_pipeline_model_parallel_rank()}, "
            f"{parallel_state.get_tensor_model_parallel_rank()})")


def _rng_states(rng_state: dict) -> dict:
    """Megatron-LM's layout: ``{"(pp, tp)": [state of each data-parallel rank]}`` (it gathers
    over data-parallel ranks with --data-parallel-random-init; always here, so a resume restores
    every rank's own generators: ranks of one data-parallel group draw different dropout masks
    once their data differ)."""
    from megatron.core import parallel_state

    group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    states = [None] * dist.get_world_size(group)
    dist.all_gather_object(states, rng_state, group=group)
    return {_rng_key(): states}


def _model_states(model) -> dict:
    from megatron_moe.training.checkpointing import model_keys

    return {key: chunk.state_dict_for_save_checkpoint()
            for key, chunk in zip(model_keys(model), model)}


class _ParamLookup:
    """A Megatron-FSDP chunk for megatron-core's ``handle_swiglu_in_state_dict``, which looks a
    model-state key up as ``module.<key>`` from the chunk, but an optimizer-state key (named from
    the chunk's own ``named_parameters``) with its first ``module.`` removed: one level short. A
    name that does not resolve from the chunk resolves from its wrapped module."""

    def __init__(self, chunk):
        self.chunk = chunk

    def __getattr__(self, name):   # config, named_modules, ... (megatron-core 0.19 reads more)
        return getattr(self.chunk, name)

    def get_parameter(self, name):
        try:
            return self.chunk.get_parameter(name)
        except AttributeError:
            return self.chunk.module.get_parameter(name)


def _preprocess(args, state: dict, model) -> dict:
    """Megatron-LM's preprocess_fsdp_dtensor_state_dict, with megatron-core's helpers."""
    from megatron.core.distributed.fsdp.src.megatron_fsdp.uneven_dtensor import (
        preprocess_state_dict_for_uneven_dtensor)
    from megatron.core.transformer import fsdp_dtensor_checkpoint as fsdp_ckpt

    from megatron_moe.training.checkpointing import model_keys

    state = dict(state)
    for index, key in enumerate(model_keys(model)):
        fsdp_ckpt.handle_fp8_extra_state_case(state[key])
        if args.swiglu:
            optimizer_state = state.get("optimizer") if index == 0 else None
            state[key], optimizer_state = fsdp_ckpt.handle_swiglu_in_state_dict(
                _ParamLookup(model[index]), state[key], optimizer_state)
            if optimizer_state is not None:
                state["optimizer"] = optimizer_state
        if args.num_experts:
            state[key] = fsdp_ckpt.handle_experts_in_state_dict(state[key], args.num_experts)
    preprocess_state_dict_for_uneven_dtensor(state)
    return state


def _same_entries_on_every_rank(optimizer, optimizer_state: dict) -> dict:
    """The optimizer's fsdp_dtensor state with an entry for every parameter, in one order.

    Megatron-FSDP shards each layer's flat buffer evenly, so a small parameter (a norm's weight)
    can lie wholly on one rank; the others hold an empty shard, which megatron-core's distributed
    optimizer gives no Adam state (it skips them when it initialises state for a load, too). Its
    DTensor preprocessing then runs one collective per stored moment, so ranks with different
    entries, or the same in another order, wait on each other forever. Each missing entry gets
    empty moments of the parameter's DTensor layout (no bytes are stored for it; the rank that
    holds the shard stores its own), and the entries are sorted by name."""
    import torch

    entries = optimizer_state["state"]
    # Adam steps every parameter together: any entry's step is the empty ones' (torch's Adam
    # needs one in every entry it is given back)
    steps = [entry["step"] for entry in entries.values() if "step" in entry]
    step = steps[0].clone() if steps else torch.zeros((), dtype=torch.float32)
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        for group in inner.optimizer.param_groups:
            for param in group["params"]:
                name = inner._param_name(param)
                if name not in entries:
                    entries[name] = {"step": step.clone(), "exp_avg": torch.zeros_like(param),
                                     "exp_avg_sq": torch.zeros_like(param)}
    optimizer_state["state"] = dict(sorted(entries.items()))
    return optimizer_state


def build_state(model, optimizer, args, *, include_optimizer: bool, include_rng: bool,
                is_loading: bool, rng_state=None) -> dict:
    state = _model_states(model)
    if include_optimizer and optimizer is not None:
        state["optimizer"] = _same_entries_on_every_rank(optimizer, optimizer.sharded_state_dict(
            state, is_loading=is_loading, metadata=_optimizer_metadata()))
    if include_rng:
        state["rng_state"] = _rng_states(rng_state)
    return state


def save(state: dict, common: dict, tmp_dir: str, model, args):
    """DCP-save the preprocessed state and the common objects into ``tmp_dir`` (every rank)."""
    full = _preprocess(args, state, model)
    full.update(common)
    with warnings.catch_warnings():   # torch DCP's deprecation notices, on every rank
        warnings.simplefilter("ignore")
        dcp.save(full, storage_writer=dcp.FileSystemWriter(tmp_dir))


def load_common(ckpt: str) -> dict:
    """The pickled objects of an fsdp_dtensor checkpoint (what torch_dist keeps in common.pt).
    DCP stored nested dicts flattened (``parallel_layout.tp``): read those entries and nest
    them again."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    reader = dcp.FileSystemReader(ckpt)
    stored = reader.read_metadata().state_dict_metadata
    flat = {key: None for key, meta in stored.items()
            if key.split(".", 1)[0] in COMMON_KEYS and isinstance(meta, BytesStorageMetadata)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(flat, storage_reader=reader, no_dist=True,   # any rank, alone
                 planner=default_planner.DefaultLoadPlanner(allow_partial_load=True))
    common: dict = {}
    for key, value in flat.items():
        *parents, leaf = key.split(".")
        node = common
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return common


def load(state: dict, ckpt: str, model, args, strict: bool) -> dict:
    """Load ``state`` (build_state's, is_loading) in place from ``ckpt`` and return it: its
    model and optimizer entries are what the model and optimizer load (DCP reads the
    preprocessed copy, whose split SwiGLU halves are views of those tensors and whose other
    entries are the same objects, so the load fills the originals)."""
    full = _preprocess(args, state, model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(full, storage_reader=dcp.FileSystemReader(ckpt),
                 planner=default_planner.DefaultLoadPlanner(allow_partial_load=not strict))
    return state


def rank_rng_state(loaded_rng: dict):
    """This rank's generators from Megatron's ``{"(pp, tp)": [per data-parallel rank]}``."""
    from megatron.core import parallel_state

    states = loaded_rng.get(_rng_key())
    if states is None:
        return None
    rank = parallel_state.get_data_parallel_rank(with_context_parallel=True)
    return states[rank] if rank < len(states) else states[0]


# --- the model weights without Megatron-FSDP: inference, conversion, a weights-only load ---------
#
# Megatron-LM reads this format only back into Megatron-FSDP. Every stored model tensor is a
# DTensor whose global shape is the whole (tensor-parallel-unsharded) parameter, so torch DCP reads
# any of them into a plain tensor of that shape whatever the layout that wrote it; what the writer
# changed on the way in (_preprocess) is undone here by name, and the model's own tensor-parallel
# attributes say which slice of the whole tensor a rank keeps.

# megatron-core's SwiGLU split (handle_swiglu_in_state_dict): a fused fc1 weight or bias stored as
# its gate (``_w``) and up (``_v``) halves, each the whole tensor over the tensor-parallel ranks
_SWIGLU = re.compile(r"\.linear_fc1\.(weight|bias)\d*_[wv]$")
# the two expert layouts megatron-core names (its get_expert_index_from_key): TEGroupedMLP's
# ``experts.linear_fc1.weight3`` and SequentialMLP's ``experts.local_experts.3.linear_fc1.weight``,
# one expert's tensor of the same shape in both; names here use the second, so a checkpoint
# trained with grouped GEMM loads into a model built without it (the converter builds one)
_GROUPED = re.compile(r"\.mlp\.experts\.linear_fc(\d)\.(weight|bias)(\d+)$")
_SEQUENTIAL = re.compile(r"\.mlp\.experts\.local_experts\.(\d+)\.")
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")


def _canonical(name: str) -> str:
    return _GROUPED.sub(r".mlp.experts.local_experts.\3.linear_fc\1.\2", name)


class ModelWeights:
    """The model tensors of an fsdp_dtensor checkpoint by plain megatron-core name (an unsharded
    model's: global layer and expert numbers, SwiGLU's fc1 whole), read as whole tensors."""

    def __init__(self, ckpt: str):
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        self.ckpt = ckpt
        stored = dcp.FileSystemReader(ckpt).read_metadata().state_dict_metadata
        chunks = {key.split(".", 1)[0] for key in stored if key.startswith("model")}
        # Megatron-FSDP runs without pipeline stages here (megatron_fsdp.EXCLUDES): one chunk
        if chunks != {"model"}:
            raise ValueError(f"{ckpt}: model chunks {sorted(chunks)}; an fsdp_dtensor "
                             f"checkpoint of one chunk ('model') is expected")
        self.meta = {}     # stored key -> TensorStorageMetadata
        self.keys = {}     # name -> (stored key,) or (gate key, up key)
        for key, meta in stored.items():
            if not key.startswith("model.") or not isinstance(meta, TensorStorageMetadata):
                continue
            self.meta[key] = meta
            # the wrappers' prefixes: FullyShardedDataParallel's ``module.`` (and a
            # Float16Module's, where one was under it)
            name = key[len("model."):]
            while name.startswith("module."):
                name = name[len("module."):]
            if _SWIGLU.search(name):
                half = 0 if name.endswith("_w") else 1
                name = name[:-2]
                parts = list(self.keys.get(_canonical(name), (None, None)))
                parts[half] = key
                self.keys[_canonical(name)] = tuple(parts)
            else:
                self.keys[_canonical(name)] = (key,)
        broken = [name for name, parts in self.keys.items() if None in parts]
        if broken:
            raise ValueError(f"{ckpt}: SwiGLU's {broken[0]} has one of its _w / _v halves only")

    def shape(self, name: str) -> torch.Size:
        parts = self.keys[_canonical(name)]
        sizes = [self.meta[key].size for key in parts]
        return torch.Size([sum(s[0] for s in sizes), *sizes[0][1:]])

    def nbytes(self, name: str) -> int:
        return sum(self.meta[key].size.numel() * self.meta[key].properties.dtype.itemsize
                   for key in self.keys[_canonical(name)])

    def read(self, names) -> dict:
        """{name: whole tensor} of ``names`` (in the stored dtype), in one DCP read on this
        process alone (no collective: any rank, any world size)."""
        flat = {}
        for name in names:
            for key in self.keys[_canonical(name)]:
                meta = self.meta[key]
                flat[key] = torch.empty(meta.size, dtype=meta.properties.dtype)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.load(flat, storage_reader=dcp.FileSystemReader(self.ckpt), no_dist=True,
                     planner=default_planner.DefaultLoadPlanner(allow_partial_load=True))
        # SwiGLU: the unsharded fused fc1 is [gate; up] (megatron-core's layout)
        return {name: torch.cat([flat[key] for key in self.keys[_canonical(name)]])
                for name in names}


def _global_name(local: str, layer_numbers: dict, expert_offset: int) -> str:
    """The unsharded model's name of this rank's parameter ``local``: the global layer number
    (a pipeline stage numbers its layers from 0) and the global expert number (megatron-core's
    renumbering, handle_experts_in_state_dict: an expert-parallel rank numbers its experts from
    0)."""
    name = _canonical(local)
    match = _LAYER.match(name)
    if match:
        name = f"decoder.layers.{layer_numbers[int(match.group(1))]}." + name[match.end():]
    return _SEQUENTIAL.sub(
        lambda m: f".mlp.experts.local_experts.{int(m.group(1)) + expert_offset}.", name)


def _tp_slice(name: str, whole, param, swiglu: bool):
    """This rank's slice of ``whole`` for ``param`` (megatron-core's tensor-parallel attributes
    say its dimension; experts use the expert-tensor-parallel group)."""
    from megatron.core import parallel_state as ps

    if not getattr(param, "tensor_model_parallel", False):
        return whole
    if ".mlp.experts." in name:
        size = ps.get_expert_tensor_parallel_world_size()
        rank = ps.get_expert_tensor_parallel_rank()
    else:
        size, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    if size == 1:
        return whole
    dim = param.partition_dim
    if swiglu and ".linear_fc1." in name:
        # each rank's fused fc1 is [its gate rows; its up rows] (megatron-core's SwiGLU layout)
        gate, up = whole.chunk(2, dim=0)
        return torch.cat([gate.chunk(size, dim)[rank], up.chunk(size, dim)[rank]], dim=0)
    return whole.chunk(size, dim)[rank]


# whole tensors read per DCP call: bounds the host memory a load holds beside the model
READ_BYTES = 1 << 30


def load_model_weights(model, ckpt: str, strict: bool = True) -> int:
    """Fill the plain (not Megatron-FSDP-wrapped) megatron-core model chunks ``model`` of any
    tensor / expert / pipeline layout from the fsdp_dtensor checkpoint ``ckpt``; every tensor of
    their state dicts (``_extra_state`` aside) must be there (ValueError naming the first that
    is not or whose shape differs; not ``strict``: one it lacks keeps its value, as
    --no-strict-fsdp-dtensor-load). Returns the number of tensors filled."""
    from megatron.core.transformer import fsdp_dtensor_checkpoint as fsdp_ckpt
    from megatron.core.transformer.transformer_layer import TransformerLayer

    from megatron_moe.models.builder import unwrap

    weights = ModelWeights(ckpt)
    filled = 0
    for chunk in model:
        module = unwrap(chunk)
        config = module.config
        # megatron-core's TransformerLayer.layer_number is global and from 1
        layer_numbers = {int(name.rsplit(".", 1)[1]): layer.layer_number - 1
                         for name, layer in module.named_modules()
                         if isinstance(layer, TransformerLayer)
                         and name.startswith("decoder.layers.")}
        expert_offset = fsdp_ckpt.get_ep_layer_offset(config.num_moe_experts)
        targets = {name: tensor for name, tensor in module.state_dict(keep_vars=True).items()
                   if torch.is_tensor(tensor) and not name.endswith("_extra_state")}
        names = {}
        for name in list(targets):
            full = _global_name(name, layer_numbers, expert_offset)
            if (full == "output_layer.weight" and full not in weights.keys
                    and getattr(module, "share_embeddings_and_output_weights", False)):
                # a last pipeline stage's copy of the tied embedding (megatron-core keeps it
                # equal to the first stage's; a one-stage model stores only the embedding)
                full = "embedding.word_embeddings.weight"
            if _canonical(full) in weights.keys:
                names[name] = full
            elif strict:
                raise ValueError(f"{ckpt} holds no {full} (this model's {name})")
            else:
                del targets[name]
        batch, size = [], 0
        for i, name in enumerate(targets):
            batch.append(name)
            size += weights.nbytes(names[name])
            if size < READ_BYTES and i + 1 < len(targets):
                continue
            read = weights.read([names[n] for n in batch])
            for local in batch:
                target = targets[local]
                part = _tp_slice(local, read[names[local]], target, config.gated_linear_unit)
                if part.shape != target.shape:
                    raise ValueError(f"{ckpt}: {names[local]} has shape "
                                     f"{tuple(weights.shape(names[local]))}; this model's {local} "
                                     f"is {tuple(target.shape)} on this rank")
                with torch.no_grad():
                    target.copy_(part)
                filled += 1
            batch, size = [], 0
    return filled
