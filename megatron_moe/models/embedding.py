"""Partitioned word embeddings: megatron-core's vocab-parallel table, or MoESys's hidden split.

``--embedding-partition vocab`` (default) keeps megatron-core's ``VocabParallelEmbedding``: rows
split across the tensor-parallel group, which must see identical input ids.

``--embedding-partition hidden`` is MoESys's data-parallel scheme (design/moesys.md, section 2.7):
the [V, H] table is split by hidden COLUMNS across a group of ranks that see *different* data;
rank q stores ``W[:, q*H/P:(q+1)*H/P]`` ([V, H/P]). One lookup is

1. all-to-all #1 (ids): every rank sends its ids to every rank (an all-gather in effect; the
   lengths are exchanged first, so ranks may hold different numbers of tokens);
2. local lookup: rank q gathers its column slice for every rank's ids;
3. all-to-all #2 (rows): slice (q, p) goes back to rank p, which concatenates the P slices of
   its own tokens along hidden into full [n_p, H] rows.

Backward is all-to-all #3 (the reverse of #2): each rank's output gradient is split into P column
blocks, block q goes to rank q, and rank q scatter-adds them into its shard's gradient. That
gradient is already the SUM over every rank's tokens, so the dense all-reduce of the embedding
gradient disappears, and per-rank embedding memory (param, grad, optimizer) drops to V*H/P.

Gradient semantics (what DDP must do with the shard): megatron-core DDP averages dense gradients
over data parallel (scale 1/DP, then sum). The shard is marked ``allreduce = False``, the
attribute megatron-core uses for expert parameters, so DDP puts it in the expert buffers: it is
scaled by 1/DP and summed over the *expert-data-parallel* group, the optimizer puts it in the
expert optimizer (grad norm summed over the expert-model-parallel group, distributed-optimizer
sharding over expert-data-parallel). All of that is exactly right when the partition group is the
expert-model-parallel (EP) group with TP = CP = ETP = 1: shard grad = sum over the EP group's
tokens, summed again over the expert-data-parallel replicas = sum over all DP ranks, times 1/DP =
the DP average a replicated embedding gets. When EP = DP (MoESys's setting) the EP group *is* the
DP group and the expert-data-parallel group has one rank: no embedding all-reduce at all. Any
other group would be reduced over the wrong ranks, so ``partition_word_embeddings`` refuses it.

Tied input/output embeddings are rejected (``--untie-embeddings-and-output-weights`` is
required): the output layer would need the full [V, H] table or a [tokens x V] partial-logit
reduction across ranks, which costs more than the embedding saves.

Checkpoints hold the full logical [V, H] table: ``sharded_state_dict`` describes the shard as
columns [q*H/P, (q+1)*H/P) of the global ``...word_embeddings.weight`` (the same key and global
shape as megatron-core's vocab-parallel table), so dist_checkpointing reshards between hidden, vocab
and replicated layouts. ``state_dict()`` returns the full table too (a collective over the
partition group: call it on every rank of the group), and ``load_state_dict`` takes either the
full table or this rank's [V, H/P] shard.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core.tensor_parallel.mappings import all_to_all

from megatron_moe.flags.exclusions import Exclusion

# torch >= 2.13 renames all_gather_into_tensor (same arguments); older torch has only the old name
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

EMBEDDING_PARTITIONS = ("vocab", "hidden")
PARTITION_GROUPS = ("auto", "ep", "dp")


# --- command line ---------------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    g = parser.add_argument_group("embedding partition")
    g.add_argument("--embedding-partition", choices=EMBEDDING_PARTITIONS, default="vocab",
                   help="vocab: megatron-core's VocabParallelEmbedding (rows split over tensor "
                        "parallel). hidden: MoESys's column split over data-parallel ranks with "
                        "all-to-all lookups; removes the embedding-gradient all-reduce when "
                        "--expert-model-parallel-size equals the data-parallel size.")
    g.add_argument("--embedding-partition-group", choices=PARTITION_GROUPS, default="auto",
                   help="Ranks that split the table for --embedding-partition hidden. ep: the "
                        "expert-model-parallel group (shards are replicated and all-reduced over "
                        "expert-data-parallel, like experts). dp: the whole data-parallel group "
                        "(needs --expert-model-parallel-size == data-parallel size). auto: ep "
                        "(which is the whole DP group whenever dp is allowed).")
    return parser


def validate_args(args) -> None:
    """Reject configurations the hidden split cannot serve; ValueError names the flag."""
    if getattr(args, "embedding_partition", "vocab") != "hidden":
        return
    if not getattr(args, "untie_embeddings_and_output_weights", False):
        raise ValueError(
            "--embedding-partition hidden needs --untie-embeddings-and-output-weights: a tied "
            "output layer would need the full [V, H] table on every rank")
    ep = getattr(args, "expert_model_parallel_size", 1) or 1
    dp = getattr(args, "data_parallel_size", None)
    group = getattr(args, "embedding_partition_group", "auto")
    if group == "dp" and dp is not None and ep != dp:
        raise ValueError(
            f"--embedding-partition-group dp needs --expert-model-parallel-size == data-parallel "
            f"size (got EP={ep}, DP={dp}): megatron-core DDP reduces allreduce=False parameters "
            f"over the expert-data-parallel group, which would mix different column shards; use "
            f"--embedding-partition-group ep (shards replicated over expert-data-parallel)")
    hidden = getattr(args, "hidden_size", None)
    if hidden is not None and hidden % ep != 0:
        raise ValueError(f"--hidden-size ({hidden}) is not divisible by the embedding partition "
                         f"size (--expert-model-parallel-size {ep}) for --embedding-partition "
                         f"hidden")


def setting(args):
    """``--embedding-partition hidden`` when on (megatron_moe/features.py checks ``EXCLUDES``)."""
    return "--embedding-partition hidden" if getattr(args, "embedding_partition", "vocab") == "hidden" \
        else None


_PEERS = ("the column split spans ranks with different data; tensor/context/expert-tensor peers "
          "share or split one sequence and would count its gradient twice")
EXCLUDES = (
    Exclusion("--tensor-model-parallel-size", _PEERS, needs_one=True),
    Exclusion("--context-parallel-size", _PEERS, needs_one=True),
    Exclusion("--expert-tensor-parallel-size", _PEERS, needs_one=True),
    Exclusion("--mtp-num-layers", "multi-token prediction reuses the tied embedding"),
)


# --- the module -----------------------------------------------------------------------------------
def _group_ranks(group) -> list[int]:
    return dist.get_process_group_ranks(group) if group is not None else list(
        range(dist.get_world_size()))


def _default_group():
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        return parallel_state.get_data_parallel_group()
    return dist.group.WORLD


class HiddenPartitionedEmbedding(torch.nn.Module):
    """[V, H] embedding split by hidden columns over ``group``; see the module docstring.

    Args:
        num_embeddings: V (megatron's padded vocabulary size when swapped into a model).
        embedding_dim: H; must be divisible by the group size.
        group: the ranks sharing the table (default: megatron-core's data-parallel group, or
            WORLD before parallel_state is initialised). Every rank of the group must call
            forward the same number of times (it is a collective).
        replica_group: ranks that hold the SAME shard (expert-data-parallel when the partition
            group is the EP group); only used for the checkpoint replica id. None: no replicas.
        init_method: applied to the full logical table, generated in row chunks with a CPU
            generator seeded by ``seed``, so every partitioning of the same seed gives the same
            logical table. Default: normal(0, 0.02), Megatron's init.
        full_weight: copy the columns of this [V, H] tensor instead (used by the model swap).
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, group=None, *,
                 replica_group=None, init_method=None, seed: int = 1234, full_weight=None,
                 params_dtype: torch.dtype = torch.float32, device=None):
        super().__init__()
        self.group = group if group is not None else _default_group()
        self.replica_group = replica_group
        self.world = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        if embedding_dim % self.world != 0:
            raise ValueError(
                f"hidden-partitioned embedding: embedding_dim (--hidden-size {embedding_dim}) is "
                f"not divisible by the partition group size {self.world}; choose a hidden size "
                f"that is a multiple of it or use --embedding-partition vocab")
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.shard_dim = embedding_dim // self.world
        self.col_start = self.rank * self.shard_dim
        device = device if device is not None else (
            torch.cuda.current_device() if torch.cuda.is_available() else "cpu")
        weight = torch.empty(num_embeddings, self.shard_dim, dtype=params_dtype, device=device)
        with torch.no_grad():
            if full_weight is not None:
                if tuple(full_weight.shape) != (num_embeddings, embedding_dim):
                    raise ValueError(f"full_weight has shape {tuple(full_weight.shape)}, expected "
                                     f"({num_embeddings}, {embedding_dim})")
                weight.copy_(self._columns(full_weight))
            else:
                self._init_shard(weight, init_method, seed)
        self.weight = torch.nn.Parameter(weight)
        # Its gradient is complete after backward (summed over the group): DDP must not average
        # it over data parallel. megatron-core routes allreduce=False params to the expert
        # buffers/optimizer; see the module docstring for why that is exactly right.
        self.weight.allreduce = False
        self.weight.tensor_model_parallel = False
        self.weight.hidden_partitioned = True
        self.register_load_state_dict_pre_hook(HiddenPartitionedEmbedding._load_hook)
        self.register_state_dict_post_hook(HiddenPartitionedEmbedding._full_state_hook)

    # -- init ---------------------------------------------------------------------------------------
    def _columns(self, full: torch.Tensor) -> torch.Tensor:
        return full[:, self.col_start:self.col_start + self.shard_dim]

    def _init_shard(self, weight, init_method, seed, rows_per_chunk: int = 8192):
        gen = torch.Generator(device="cpu").manual_seed(seed)
        for start in range(0, self.num_embeddings, rows_per_chunk):
            rows = min(rows_per_chunk, self.num_embeddings - start)
            if init_method is None:
                block = torch.randn(rows, self.embedding_dim, generator=gen) * 0.02
            else:
                block = torch.empty(rows, self.embedding_dim)
                with torch.random.fork_rng(devices=[]):
                    torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=gen)))
                    init_method(block)
            weight[start:start + rows].copy_(self._columns(block))

    # -- forward ------------------------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        ids = input_ids.reshape(-1)
        n_local = ids.numel()
        if self.world == 1:
            return F.embedding(ids, self.weight).view(*input_ids.shape, self.embedding_dim)
        # token counts of every rank (ranks may hold different numbers of tokens)
        counts = torch.empty(self.world, dtype=torch.int64, device=ids.device)
        _all_gather(counts, torch.tensor([n_local], device=ids.device), group=self.group)
        counts = counts.tolist()
        # all-to-all #1: my ids to every rank; I receive every rank's ids, in rank order
        all_ids = ids.new_empty(sum(counts))
        dist.all_to_all_single(all_ids, ids.repeat(self.world), output_split_sizes=counts,
                               input_split_sizes=[n_local] * self.world, group=self.group)
        # local lookup of my column slice for all ranks' tokens; autograd scatter-adds its grad
        local = F.embedding(all_ids, self.weight)                       # [sum(counts), H/P]
        # all-to-all #2 (its backward is #3): slice for rank p's tokens goes to rank p
        mine = all_to_all(self.group, local, [n_local] * self.world, counts)  # [P*n, H/P]
        out = mine.view(self.world, n_local, self.shard_dim).transpose(0, 1)
        return out.reshape(*input_ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, columns "
                f"[{self.col_start}, {self.col_start + self.shard_dim}) of {self.world} ranks")

    # -- checkpoints --------------------------------------------------------------------------------
    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
        """The shard as columns of the global [V, H] ``<prefix>weight`` (reshardable)."""
        from megatron.core.dist_checkpointing.mapping import ShardedTensor

        replica = dist.get_rank(self.replica_group) if self.replica_group is not None else 0
        key = f"{prefix}weight"
        sharded = ShardedTensor.from_rank_offsets(
            key, self.weight, *sharded_offsets,
            (len(sharded_offsets) + 1, self.rank, self.world),
            replica_id=(0, 0, replica), prepend_axis_num=len(sharded_offsets),
            allow_shape_mismatch=True)
        return {key: sharded}

    def full_weight(self) -> torch.Tensor:
        """The full [V, H] table, gathered over the group (a collective; no autograd)."""
        w = self.weight.detach()
        if self.world == 1:
            return w.clone()
        parts = torch.empty(self.world * w.shape[0], w.shape[1], dtype=w.dtype, device=w.device)
        _all_gather(parts, w.contiguous(), group=self.group)
        parts = parts.view(self.world, self.num_embeddings, self.shard_dim)
        return parts.permute(1, 0, 2).reshape(self.num_embeddings, self.embedding_dim)

    @staticmethod
    def _full_state_hook(module, state_dict, prefix, local_metadata):
        key = prefix + "weight"
        value = state_dict.get(key)
        # keep_vars=True callers (megatron-core's param maps) want the Parameter itself
        if value is not None and not isinstance(value, torch.nn.Parameter) \
                and not getattr(module, "_local_state_dict", False):
            state_dict[key] = module.full_weight()

    def local_state_dict(self, *args, **kwargs):
        """state_dict with this rank's [V, H/P] shard (no collective)."""
        self._local_state_dict = True
        try:
            return self.state_dict(*args, **kwargs)
        finally:
            self._local_state_dict = False

    @staticmethod
    def _load_hook(self, state_dict, prefix, local_metadata, strict, missing_keys,
                   unexpected_keys, error_msgs):
        key = prefix + "weight"
        value = state_dict.get(key)
        if value is None or not torch.is_tensor(value):
            return
        if tuple(value.shape) == (self.num_embeddings, self.embedding_dim) and \
                self.shard_dim != self.embedding_dim:
            state_dict[key] = self._columns(value).contiguous()  # a full (logical) table
        elif tuple(value.shape) != (self.num_embeddings, self.shard_dim):
            error_msgs.append(
                f"{key}: expected the full table ({self.num_embeddings}, {self.embedding_dim}) or "
                f"this rank's shard ({self.num_embeddings}, {self.shard_dim}), got "
                f"{tuple(value.shape)}")


# --- model integration ----------------------------------------------------------------------------
def _partition_groups(which: str):
    """(partition group, replica group) for megatron-core DDP; see the module docstring."""
    from megatron.core import parallel_state as ps

    for name, size in (("--tensor-model-parallel-size", ps.get_tensor_model_parallel_world_size()),
                       ("--context-parallel-size", ps.get_context_parallel_world_size()),
                       ("--expert-tensor-parallel-size",
                        ps.get_expert_tensor_parallel_world_size())):
        if size != 1:
            raise ValueError(f"--embedding-partition hidden needs {name} 1 (got {size})")
    ep_group = ps.get_expert_model_parallel_group()
    edp_group = ps.get_expert_data_parallel_group()
    dp_group = ps.get_data_parallel_group()
    if which in ("auto", "ep"):
        return ep_group, edp_group
    if which == "dp":
        if sorted(_group_ranks(dp_group)) != sorted(_group_ranks(ep_group)):
            raise ValueError(
                f"--embedding-partition-group dp needs the data-parallel group to equal the "
                f"expert-model-parallel group (EP={ep_group.size()}, DP={dp_group.size()}): "
                f"megatron-core DDP reduces allreduce=False params over expert-data-parallel; use "
                f"--embedding-partition-group ep")
        return dp_group, edp_group
    raise ValueError(f"--embedding-partition-group: unknown value {which!r}; "
                     f"choose from {PARTITION_GROUPS}")


def swap_word_embeddings(embedding, group=None, replica_group=None) -> HiddenPartitionedEmbedding:
    """Replace ``embedding.word_embeddings`` (a megatron-core LanguageModelEmbedding's
    VocabParallelEmbedding, tensor-parallel size 1) by a HiddenPartitionedEmbedding holding the
    same values; returns the new module. Call before DDP wraps the model."""
    old = embedding.word_embeddings
    weight = old.weight
    if getattr(weight, "hidden_partitioned", False):
        return old
    vocab = getattr(old, "num_embeddings", weight.shape[0])
    if weight.shape[0] != vocab:
        raise ValueError(f"word_embeddings holds {weight.shape[0]} of {vocab} rows (tensor "
                         f"parallel); --embedding-partition hidden needs the full table")
    new = HiddenPartitionedEmbedding(vocab, weight.shape[1], group=group,
                                     replica_group=replica_group, full_weight=weight.detach(),
                                     params_dtype=weight.dtype, device=weight.device)
    for attr in ("is_embedding_or_output_parameter", "sequence_parallel"):
        if hasattr(weight, attr):
            setattr(new.weight, attr, getattr(weight, attr))
    embedding.word_embeddings = new
    return new


def partition_word_embeddings(model, args=None, *, partition: str | None = None,
                              group: str | None = None):
    """Apply ``--embedding-partition`` to a GPTModel/BertModel (unwrapped, before DDP).

    ``vocab`` leaves the model as megatron-core built it. ``hidden`` swaps the word embeddings for
    a HiddenPartitionedEmbedding over the expert-model-parallel group (``--embedding-partition-
    group``); tied output layers and TP/CP/ETP > 1 are rejected with a ValueError naming the flag.
    Returns the model. Pipeline stages without the embedding are left alone.
    """
    partition = partition or getattr(args, "embedding_partition", "vocab")
    group = group or getattr(args, "embedding_partition_group", "auto")
    if partition == "vocab":
        return model
    if partition != "hidden":
        raise ValueError(f"--embedding-partition: unknown value {partition!r}; "
                         f"choose from {EMBEDDING_PARTITIONS}")
    if getattr(model, "share_embeddings_and_output_weights", False):
        raise ValueError("--embedding-partition hidden needs --untie-embeddings-and-output-weights "
                         "(the tied output layer would need the full [V, H] table)")
    if getattr(model, "mtp_process", False):
        raise ValueError("--embedding-partition hidden does not support multi-token prediction")
    if not getattr(model, "pre_process", True) or getattr(model, "embedding", None) is None:
        return model
    part_group, replica_group = _partition_groups(group)
    emb = swap_word_embeddings(model.embedding, part_group, replica_group)
    if dist.get_rank() == 0:
        print(f"> word embedding: hidden-partitioned over {emb.world} rank(s), [V, H/P] = "
              f"[{emb.num_embeddings}, {emb.shard_dim}] per rank; gradient reduced over "
              f"{dist.get_world_size(replica_group)} replica(s)"
              + (" (a 1-rank partition is a replicated table: raise "
                 "--expert-model-parallel-size to split it)" if emb.world == 1 else ""),
              flush=True)
    return model


def embedding_bytes(module) -> dict:
    """Parameter and gradient bytes of the word-embedding weight held by this rank."""
    weight = module.weight
    grad = getattr(weight, "main_grad", None)
    if grad is None:
        grad = weight.grad
    return {"param_bytes": weight.numel() * weight.element_size(),
            "grad_bytes": 0 if grad is None else grad.numel() * grad.element_size(),
            "shape": tuple(weight.shape)}
