"""Token dispatch on megatron-core's dispatchers, with our fused permute kernels and all-to-all.

megatron-core's ``MoEAlltoAllTokenDispatcher`` / ``MoEAllGatherTokenDispatcher`` call four
functions by module-level name: ``permute``, ``unpermute``, ``sort_chunks_by_idxs`` (moe_utils) and
``all_to_all`` (tensor_parallel). Their call sites (splits bookkeeping, capacity, TP/EP grouping)
stay megatron-core's; an :class:`ExchangeConfig` chooses what those names run
(:func:`dispatcher_bindings`), and every MoE layer (megatron_moe/moe/layer.py, ``exchange=``) binds
them only while its own stages run (megatron_moe/compat/dispatch.py ``DispatcherScope``):

* :func:`sort_chunks_by_idxs` for every MoE model: the chunk sort with a launch count that does not
  grow with the local experts (bit-identical to megatron-core's, tests/test_launch_counts.py),
* on megatron-core 0.16 without fusion, its 0.17 argsort permute (compat/dispatch.py
  ``argsort_permute``: no host wait per layer),
* ``kernels.permute`` / ``kernels.unpermute`` with ``--moe-permute-fusion`` (Triton on GPU, a fused
  index path on CPU; bit-identical to megatron-core's unfused path, see tests/test_dispatcher.py),
* ``megatron_moe.comm.all_to_all`` with ``--moe-a2a-algorithm`` other than ``flat``, with
  ``--moe-a2a-compression`` (hierarchical / pipe all-to-all, compression), or with
  ``--moe-ep-link-gbps`` (the emulated link, comm/link.py, must see megatron-core's exchanges too).

The same exchange drives the layer's own middles: the chunked, overlapped dispatch -> experts ->
combine (``--moe-a2a-overlap-degree`` > 1 or ``--moe-a2a-schedule fastermoe``,
megatron_moe/moe/chunked.py) and the balanced layer's replica dispatch (``--moe-balance-policy``),
so the flags apply under every policy. :func:`permute_fns` is the permute pair those middles use.

megatron-core's own ``--moe-permute-fusion`` needs Transformer Engine; ours is a different
implementation behind the same flag, so megatron-core's config flag stays False.
"""

from __future__ import annotations

import dataclasses
import functools

import torch


@dataclasses.dataclass(frozen=True)
class ExchangeConfig:
    """How an MoE layer exchanges tokens (injected into every MoE layer, megatron_moe/moe/layer.py):
    one choice for every middle of the layer (megatron-core's dispatcher, the chunked pipeline, the
    replica dispatch). ``own_all_to_all``: megatron-core's dispatcher sends through
    megatron_moe.comm (another algorithm, compression, or the emulated link must see its
    exchanges too)."""
    algorithm: str = "flat"
    compression: str = "none"
    permute_fusion: bool = False
    overlap_degree: int = 1
    schedule: str = "schemoe"
    own_all_to_all: bool = False

    @property
    def chunked(self) -> bool:
        return self.overlap_degree > 1 or self.schedule == "fastermoe"


def exchange_from_args(args) -> ExchangeConfig:
    algorithm = getattr(args, "moe_a2a_algorithm", "flat") or "flat"
    compression = getattr(args, "moe_a2a_compression", "none") or "none"
    return ExchangeConfig(
        algorithm, compression, bool(getattr(args, "moe_permute_fusion", False)),
        int(getattr(args, "moe_a2a_overlap_degree", 1) or 1),
        getattr(args, "moe_a2a_schedule", "schemoe") or "schemoe",
        own_all_to_all=(algorithm != "flat" or compression != "none"
                        or getattr(args, "moe_ep_link_gbps", None) is not None))


def dispatcher_bindings(exchange: ExchangeConfig, dropless_topk: int = 0) -> dict:
    """What megatron-core's token dispatcher's module-level names run inside a layer with this
    exchange (megatron_moe/compat/dispatch.py ``DispatcherScope``), adapted to the installed
    megatron-core's call contracts. ``dropless_topk``: the layer's top-k when its all-to-all
    dispatcher keeps every routed token (no capacity, no padding), so each token is permuted to
    exactly that many rows (:func:`rows_gathered_permute`); 0 otherwise."""
    from megatron_moe.compat.dispatch import (adapt_all_to_all, adapt_permute, adapt_unpermute,
                                              argsort_permute, mcore_permute, mcore_unpermute)

    names = {"sort_chunks_by_idxs": sort_chunks_by_idxs}
    if exchange.permute_fusion:
        names["permute"] = adapt_permute(_fused_permute)
        names["unpermute"] = adapt_unpermute(_fused_unpermute)
    else:
        permute = argsort_permute()   # megatron-core 0.16: no data-sized permute
        if dropless_topk:
            names["permute"] = adapt_permute(rows_gathered_permute(permute or mcore_permute,
                                                                   dropless_topk))
            names["unpermute"] = adapt_unpermute(rows_summed_unpermute(mcore_unpermute,
                                                                      dropless_topk))
        elif permute is not None:
            names["permute"] = permute
    if exchange.own_all_to_all:
        names["all_to_all"] = adapt_all_to_all(functools.partial(
            _pluggable_all_to_all, algorithm=exchange.algorithm,
            compression=exchange.compression, ranks_per_node=None))  # per EP group from the topology
    return names


def permute_fns():
    """The (permute, unpermute) pair megatron-core's token dispatcher runs now, under megatron-core
    0.16's call contract: inside an MoE layer's stage that is its exchange's (kernels.permute /
    kernels.unpermute with ``--moe-permute-fusion``), else megatron-core's. Looked up at call time,
    so whatever a layer's scope binds (a benchmark's timer too) is what runs."""
    from megatron_moe.compat.dispatch import permute_v016, token_dispatcher_module

    td = token_dispatcher_module()
    return permute_v016(td.permute), td.unpermute  # megatron-core 0.16's call contract, any version


class _GatherRows(torch.autograd.Function):
    """``tokens.index_select(0, sorted_indices)`` where every token is among the indices exactly
    ``topk`` times (dropless routing), with a backward that sums each token's rows without atomic
    adds. index_select's own backward is ``index_add_``: one atomic add per routed row, slow in
    bf16 (1.09 ms per MoE layer per micro-batch of the perf section's fine-grained model on the
    H200, docs/gpu_runs/2026-11-29-h200: 4% of its iteration). Here a stable argsort of the indices
    puts each token's rows next to each other (in the order index_add_ visits them: by expert),
    one gather reads them and a sum over top-k adds them: deterministic, and each sum rounds once
    (index_add_ in bf16 rounds at every add)."""

    backwards = 0   # how many backwards ran (the tests' proof that this path trained)

    @staticmethod
    def forward(ctx, tokens, sorted_indices, topk):
        ctx.save_for_backward(sorted_indices)
        ctx.topk = topk
        return tokens.index_select(0, sorted_indices)

    @staticmethod
    def backward(ctx, grad):
        (sorted_indices,) = ctx.saved_tensors
        by_token = sorted_indices.argsort(stable=True)
        rows = grad.index_select(0, by_token)
        _GatherRows.backwards += 1
        return rows.view(-1, ctx.topk, *grad.shape[1:]).sum(1), None, None


def rows_gathered_permute(permute, topk):
    """A permute (megatron-core 0.16's call contract) that takes the routed pairs' order and
    permuted probs from ``permute`` and moves the tokens with :class:`_GatherRows`: when
    ``num_out_tokens`` is the host integer tokens x ``topk`` (megatron-core's dropless all-to-all
    dispatcher sets exactly that); any other call is ``permute``'s own. ``permute`` gets
    zero-width tokens, so its own row copy moves nothing."""

    def rows_gathered(tokens, routing_map, probs=None, num_out_tokens=None, fused=False,
                      drop_and_pad=False):
        if (fused or drop_and_pad or not isinstance(num_out_tokens, int)
                or num_out_tokens != tokens.shape[0] * topk or tokens.dim() != 2):
            return permute(tokens, routing_map, probs=probs, num_out_tokens=num_out_tokens,
                           fused=fused, drop_and_pad=drop_and_pad)
        _, permuted_probs, sorted_indices = permute(
            tokens.new_empty(tokens.shape[0], 0), routing_map, probs=probs,
            num_out_tokens=num_out_tokens)
        return _GatherRows.apply(tokens, sorted_indices, topk), permuted_probs, sorted_indices

    return rows_gathered


class _SumRows(torch.autograd.Function):
    """The inverse of :class:`_GatherRows`: each token's ``topk`` rows of ``permuted`` summed back
    into its place, where megatron-core's unpermute scatter-adds them (``scatter_add_``, or
    ``index_add_`` in deterministic mode: atomic adds of bf16 rows, 3% of the fine-grained perf
    model's device time on the H200, 2026-11-29). Here a stable argsort of the indices puts each
    token's rows next to each other (by expert, the order the CPU's scatter visits them), one gather
    reads them and a sum over top-k adds them: no atomics, deterministic, each sum rounded once. Its
    backward copies each token's gradient to its rows (a gather)."""

    forwards = 0   # how many forwards ran (the tests' proof that this path trained)

    @staticmethod
    def forward(ctx, permuted, sorted_indices, topk):
        ctx.save_for_backward(sorted_indices)
        by_token = sorted_indices.argsort(stable=True)
        _SumRows.forwards += 1
        rows = permuted.index_select(0, by_token)
        return rows.view(-1, topk, *permuted.shape[1:]).sum(1)

    @staticmethod
    def backward(ctx, grad):
        (sorted_indices,) = ctx.saved_tensors
        return grad.index_select(0, sorted_indices), None, None


def rows_summed_unpermute(unpermute, topk):
    """An unpermute (megatron-core 0.16's call contract) that sums each token's rows with
    :class:`_SumRows` when every token has exactly ``topk`` of them and no probabilities are
    applied here (megatron-core's dropless all-to-all dispatcher: its experts weigh the rows);
    any other call is ``unpermute``'s own."""

    def rows_summed(permuted_tokens, sorted_indices, restore_shape, probs=None, routing_map=None,
                    fused=False, drop_and_pad=False):
        if (fused or drop_and_pad or probs is not None or permuted_tokens.dim() != 2
                or sorted_indices.numel() != restore_shape[0] * topk):
            return unpermute(permuted_tokens, sorted_indices, restore_shape, probs=probs,
                             routing_map=routing_map, fused=fused, drop_and_pad=drop_and_pad)
        return _SumRows.apply(permuted_tokens, sorted_indices, topk)

    return rows_summed


def add_arguments(parser):
    group = parser.add_argument_group("moe dispatch")
    group.add_argument("--moe-permute-fusion", action="store_true",
                       help="Fused permute / unpermute+combine kernels (kernels/).")
    return parser


def validate_args(args):
    from megatron_moe.moe.chunked import validate_args as chunked_validate_args

    chunked_validate_args(args)


def _fused_permute(*args, fused=False, **kwargs):
    import kernels

    return kernels.permute(*args, **kwargs)


def _fused_unpermute(*args, fused=False, **kwargs):
    import kernels

    return kernels.unpermute(*args, **kwargs)


def sort_chunks_by_idxs(input, split_sizes, sorted_idxs, probs=None, fused=False):
    """megatron-core's ``moe_utils.sort_chunks_by_idxs`` (same contract, same result bit for bit)
    with a launch count that does not grow with the number of chunks (local experts x EP ranks).

    megatron-core splits ``input`` into one chunk per (rank, local expert) and concatenates them in
    ``sorted_idxs`` order: one slice per chunk, and a backward that slices the gradient per chunk.
    Here one row index is built on the device from the chunk sizes (no host read: the total is
    ``input``'s row count, the repeat's ``output_size``) and applied with one ``index_select`` per
    tensor; its backward is one ``index_select`` with the inverse permutation (each row receives
    exactly one gradient row: a gather, where autograd's own backward of ``index_select`` is an
    atomic ``index_add``, 14% of the device time in the H200 profile). With one source rank
    (expert and tensor parallel size 1) megatron-core's order is the identity and nothing moves:
    the tensors are returned as they are (megatron-core copies them). Written by hand because
    megatron-core's only constant-launch version is Transformer Engine's fused kernel
    (``fused=True``, passed on)."""
    from megatron.core.transformer.moe import moe_utils

    if fused:
        return moe_utils.sort_chunks_by_idxs(input, split_sizes, sorted_idxs, probs, fused=True)
    if _identity_order(sorted_idxs):
        return input, probs
    # the sizes and order are host tensors (megatron-core's dtoh copy): one small host-to-device copy
    meta = torch.stack([torch.as_tensor(split_sizes, dtype=torch.int64).reshape(-1),
                        torch.as_tensor(sorted_idxs, dtype=torch.int64).reshape(-1)])
    sizes, order = meta.to(input.device, non_blocking=True).unbind(0)
    new_sizes = sizes.index_select(0, order)
    # output chunk j is input chunk order[j]: its rows shift by (input start - output start)
    shift = (sizes.cumsum(0) - sizes).index_select(0, order) - (new_sizes.cumsum(0) - new_sizes)
    rows = input.shape[0]
    positions = torch.arange(rows, device=input.device)
    index = positions + torch.repeat_interleave(shift, new_sizes, output_size=rows)
    inverse = torch.empty_like(index).scatter_(0, index, positions)
    out = _PermuteRows.apply(input, index, inverse)
    return out, (_PermuteRows.apply(probs, index, inverse) if probs is not None else None)


def _identity_order(order) -> bool:
    """Whether a chunk order (megatron-core's host tensor) keeps every chunk in place. Read only
    from the host (a device tensor is never inspected here)."""
    if torch.is_tensor(order):
        if order.device.type != "cpu":
            return False
        flat = order.reshape(-1)
        return torch.equal(flat, torch.arange(flat.numel(), dtype=flat.dtype))
    flat = list(order)
    return flat == list(range(len(flat)))


class _PermuteRows(torch.autograd.Function):
    """``x[index]`` for a permutation ``index`` of the rows; backward ``grad[inverse]``."""

    @staticmethod
    def forward(ctx, x, index, inverse):
        ctx.save_for_backward(inverse)
        return x.index_select(0, index)

    @staticmethod
    def backward(ctx, grad):
        (inverse,) = ctx.saved_tensors
        return grad.index_select(0, inverse), None, None


def _pluggable_all_to_all(group, input_, output_split_sizes=None, input_split_sizes=None, *,
                          algorithm, compression, ranks_per_node):
    from megatron_moe import comm

    return comm.all_to_all(input_, output_split_sizes, input_split_sizes, group,
                           algorithm=algorithm, ranks_per_node=ranks_per_node,
                           compression=compression)


def customize_spec(args, spec):
    """Called by model.gpt_layer_spec: every MoE layer becomes megatron_moe.moe.layer.MoELayer with
    the exchange chosen by the flags."""
    if not getattr(args, "num_experts", None):
        return spec
    from megatron_moe.moe.layer import use_layer

    exchange = exchange_from_args(args)
    what = (f"--moe-a2a-overlap-degree {exchange.overlap_degree}" if exchange.chunked
            else "the MoE exchange (--moe-permute-fusion, --moe-a2a-algorithm)")
    return use_layer(spec, what, exchange=exchange)
