"""The megatron-core side of a conversion: one process, an unsharded GPTModel, our checkpoints.

A ``torch_dist`` checkpoint stores global tensors with their offsets, so it is independent of the
TP/EP/PP layout that wrote it: megatron-core reshards at load. The converter therefore builds the
model once, unsharded (TP=EP=PP=1, one gloo rank, megatron-core's local layer spec with our MLA
core attention and the MTP block, as training builds them on CPU), and reads or
writes the checkpoint through megatron_moe.training.checkpointing -- the exact code training uses. Loading
a checkpoint saved at EP=k gathers every expert of every rank (dist_checkpointing reads all
shards), which is why an export can never miss experts.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import math
import socket

import torch

# Features of ours that change communication or placement, never the weights: off in the
# conversion model (no spec hooks but MLA's), so a checkpoint trained with them converts.
_RUNTIME_ONLY = dict(moe_token_dispatcher_type="allgather", moe_grouped_gemm=False,
                     moe_expert_capacity_factor=None, moe_pad_expert_input_to_capacity=False,
                     sequence_parallel=False, use_distributed_optimizer=False,
                     overlap_grad_reduce=False, overlap_param_gather=False)


def init_single_process():
    """A one-rank gloo group and megatron-core's parallel state with every size 1."""
    from megatron_moe.compat import quiet_known_warnings

    quiet_known_warnings()
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_moe.compat import apply_cpu_shims
    if not dist.is_initialized():
        with socket.socket() as sock:  # a free port for this one-rank group
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0,
                                world_size=1, timeout=datetime.timedelta(minutes=30))
    apply_cpu_shims()
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel()
    from megatron.core import tensor_parallel

    tensor_parallel.model_parallel_cuda_manual_seed(1234)


def finish():
    import torch.distributed as dist
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def conversion_args(args) -> argparse.Namespace:
    """``args`` with every parallel size 1 and runtime-only features off. Weights keep the
    checkpoint's dtype (args.params_dtype: what --bf16/--fp16 training stores), so nothing is
    rounded; no mixed-precision wrapper is built."""
    a = copy.copy(args)
    a.tensor_model_parallel_size = a.pipeline_model_parallel_size = 1
    a.expert_model_parallel_size = a.expert_tensor_parallel_size = 1
    a.context_parallel_size = 1
    a.world_size, a.rank, a.data_parallel_size = 1, 0, 1
    a.bf16 = a.fp16 = False
    a.use_cpu_initialization = True
    for key, value in _RUNTIME_ONLY.items():
        if hasattr(a, key):
            setattr(a, key, value)
    return a


def build_model(args):
    """An unsharded, uninitialised-weights GPTModel for ``args`` (after conversion_args)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    from megatron_moe.models import attention
    from megatron_moe.models.builder import common_model_kwargs, mtp_block_spec, transformer_config_from_args

    config = transformer_config_from_args(args)
    config.perform_initialization = False  # every weight is overwritten
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False)
    # MLA layers (DeepSeek): the core attention training uses on CPU; the weights are the same
    spec = attention.customize_spec(args, spec)
    model = GPTModel(transformer_layer_spec=spec, rotary_base=args.rotary_base,
                     rotary_percent=getattr(args, "rotary_percent", 1.0),
                     mtp_block_spec=mtp_block_spec(args, config, spec),
                     **common_model_kwargs(args, config, True, True, None))
    model.eval()
    return model


def parameters(model) -> dict:
    """name -> tensor of every weight (no ``_extra_state``)."""
    return {k: v for k, v in model.state_dict().items()
            if torch.is_tensor(v) and not k.endswith("_extra_state")}


def target_world_size(tp: int, pp: int, ep: int, etp: int) -> int:
    """The smallest world where the dense (TP x PP) and expert (ETP x EP x PP) grids both fit."""
    return math.lcm(tp * pp, etp * ep * pp)


def read_parameter(ckpt_dir: str, entry, shape, dtype) -> torch.Tensor:
    """One parameter of a torch_dist checkpoint, read on its own.

    ``entry`` is the parameter's item of megatron-core's ``sharded_state_dict()`` (a model built
    on the meta device is enough): a ShardedTensor (checkpoint key, global offset) or a
    ShardedTensorFactory (e.g. SwiGLU's fc1, stored as separate gate and up tensors), built here
    on empty storage and merged back with the factory's own merge function. Each region is read
    with torch DCP and a planner that asks for exactly that region, whatever the layout that wrote
    it. (megatron-core's own load call cannot do this in a one-rank group: it expects every
    fragment of a key at once, i.e. the whole stacked tensor.)
    """
    import copy

    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    if isinstance(entry, ShardedTensor):
        return _read_region(ckpt_dir, entry, dtype).reshape(shape)
    factory = copy.copy(entry)
    factory.data = torch.empty(shape, dtype=dtype)
    built = factory.build()

    def read_all(x):
        if isinstance(x, ShardedTensor):
            return _read_region(ckpt_dir, x, dtype)
        if isinstance(x, dict):
            return {k: read_all(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return type(x)(read_all(v) for v in x)
        raise TypeError(f"unexpected item {type(x).__name__} in the factory of {entry.key}")

    return factory.merge_fn(read_all(built)).reshape(shape)


def _read_region(ckpt_dir, sh_ten, dtype):
    import torch.distributed.checkpoint as dcp

    if sh_ten.flattened_range is not None:
        raise ValueError(f"{sh_ten.key}: flattened (distributed-optimizer) tensors are not weights")
    sizes = (1,) * sh_ten.prepend_axis_num + tuple(sh_ten.local_shape)
    out = torch.empty(sizes, dtype=dtype)
    planner = _region_planner({sh_ten.key: tuple(sh_ten.global_offset)})
    dcp.load({sh_ten.key: out}, storage_reader=dcp.FileSystemReader(ckpt_dir), planner=planner)
    return out.reshape(sh_ten.local_shape)


def _region_planner_class():
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
    from torch.distributed.checkpoint.planner import LoadPlan
    from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

    class RegionLoadPlanner(DefaultLoadPlanner):
        """Loads each state-dict tensor from the region of the checkpoint's global tensor that
        starts at the given offset (DefaultLoadPlanner always asks for the whole tensor)."""

        def __init__(self, offsets):
            super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
            self.offsets = offsets

        def create_local_plan(self):
            items = []
            for fqn, tensor in self.state_dict.items():
                if fqn not in self.metadata.state_dict_metadata:
                    raise KeyError(f"the checkpoint has no tensor {fqn}")
                chunk = ChunkStorageMetadata(offsets=torch.Size(self.offsets[fqn]),
                                             sizes=tensor.size())
                items += create_read_items_for_chunk_list(
                    fqn, self.metadata.state_dict_metadata[fqn], [chunk])
            return LoadPlan(items)

        def lookup_tensor(self, index):
            # our destination is a plain tensor standing for the region, not a ShardedTensor
            return self.state_dict[index.fqn]

    return RegionLoadPlanner


def _region_planner(offsets):
    return _region_planner_class()(offsets)


# --- streaming write (HF import) ------------------------------------------------------------------
# megatron-core's own torch_dist save (dist_checkpointing.save -> TorchDistSaveShardedStrategy)
# needs every tensor's data when it is called and stages all of it before writing: a whole model
# in memory. The import instead hands dist_checkpointing.save a model built on the meta device
# (names, shapes, dtypes and megatron-core's own sharded_state_dict(), no storage) and a strategy
# that differs from megatron-core's in one point only: torch DCP asks the save planner for each
# chunk's data as the writer reaches it (SavePlanner.resolve_data), and that is where the chunk is
# produced from the HF shards, written, and dropped. Everything else -- keys, global offsets,
# SwiGLU's gate/up factory, the layer/expert stacking, the common state, metadata.json -- is
# megatron-core's own code on the meta model, so the files are those megatron-core writes; one
# writer thread keeps the plan's order and DCP's serial loader resolves one item at a time (the
# overlapping loader DCP uses when CUDA is present resolves ahead until 10 MB are in flight).

def chunk_index(sharded_state_dict) -> dict:
    """(checkpoint key, global offset) -> (parameter name, entry, path) for every tensor chunk a
    save of ``sharded_state_dict`` (the model's, on any device) writes. ``path`` locates the chunk
    inside a ShardedTensorFactory's build (None: the parameter is the chunk)."""
    import copy

    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    index = {}
    for name, entry in sharded_state_dict.items():
        if isinstance(entry, ShardedTensor):
            index[(entry.key, tuple(entry.global_offset))] = (name, entry, None)
        elif isinstance(entry, ShardedTensorFactory):
            for path, sh_ten in _walk(copy.copy(entry).build()):
                index[(sh_ten.key, tuple(sh_ten.global_offset))] = (name, entry, path)
    return index


def _walk(x, path=()):
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    if isinstance(x, ShardedTensor):
        yield path, x
    elif isinstance(x, dict):
        for k, v in x.items():
            yield from _walk(v, path + (k,))
    elif isinstance(x, (list, tuple)):
        for i, v in enumerate(x):
            yield from _walk(v, path + (i,))
    else:
        raise TypeError(f"unexpected item {type(x).__name__} in a sharded tensor factory")


class ChunkProducer:
    """The data of one checkpoint chunk, made on demand: ``produce(name)`` gives the full
    parameter (the HF tensors merged); a factory's chunk is cut from it by the factory's own
    build. The last parameter is kept, so gate and up of one expert (two chunks, written one
    after the other) read the HF tensors once. ``chunks`` counts what was produced."""

    def __init__(self, index: dict, produce):
        self.index, self.produce = index, produce
        self.chunks = 0
        self._last = (None, None)

    def __call__(self, key, offset):
        import copy

        name, entry, path = self.index[(key, tuple(offset))]
        if self._last[0] != name:
            self._last = (None, None)  # drop the previous parameter before reading the next
            self._last = (name, self.produce(name))
        data = self._last[1]
        if path is not None:
            factory = copy.copy(entry)
            factory.data = data
            built = factory.build()
            for step in path:
                built = built[step]
            data = built.data
        self.chunks += 1
        return data


def streaming_save_strategy(producer: ChunkProducer):
    """A megatron-core torch_dist save strategy whose tensor data comes from ``producer`` while
    torch DCP writes (see the comment above)."""
    import torch.distributed.checkpoint as dcp
    from megatron.core.dist_checkpointing.strategies.torch import (
        MCoreSavePlanner, TorchDistSaveShardedStrategy, _replace_state_dict_keys_with_sharded_keys,
        mcore_to_pyt_state_dict)
    from torch.distributed.checkpoint.planner import WriteItemType

    class StreamingPlanner(MCoreSavePlanner):
        def resolve_data(self, write_item):
            if write_item.type == WriteItemType.BYTE_IO:  # ShardedObjects (common state, ...)
                return super().resolve_data(write_item)
            data = producer(write_item.index.fqn, write_item.index.offset)
            # DCP's chunk of a layer-stacked key has the stacking axes as leading 1s
            return data.reshape(write_item.tensor_data.chunk.sizes).contiguous()

    class StreamingSaveStrategy(TorchDistSaveShardedStrategy):
        def save(self, sharded_state_dict, checkpoint_dir):
            flat, _, _ = _replace_state_dict_keys_with_sharded_keys(
                sharded_state_dict, self.keep_only_main_replica)
            pyt_state_dict = mcore_to_pyt_state_dict(flat, False)  # meta tensors: metadata only
            writer = dcp.FileSystemWriter(str(checkpoint_dir), single_file_per_rank=True,
                                          sync_files=True, thread_count=1)
            planner = StreamingPlanner(dedup_replicated_tensors=not self.keep_only_main_replica,
                                       flatten_state_dict=False)
            dcp.save(pyt_state_dict, storage_writer=writer, planner=planner)

    return StreamingSaveStrategy("torch_dist", 1)
