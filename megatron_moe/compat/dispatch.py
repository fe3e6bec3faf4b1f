"""Call contracts of the megatron-core functions the dispatchers call by name, and their rebinding
inside ``megatron.core.transformer.moe.token_dispatcher`` (chosen by moe/dispatcher.py).

permute / unpermute (``moe_utils``):
    <= 0.16: ``permute(...) -> (tokens, probs, sorted_indices)``.
    >= 0.17: ``permute(..., tokens_per_expert=None, align_size=...)`` returns
        ``(tokens, probs, sorted_indices, pad_offsets, tokens_per_expert)``; ``unpermute`` takes
        ``pad_offsets``. Only TE's fused permute-and-pad kernel fills pad_offsets (FP8/FP4
        alignment); megatron-core's unfused path returns ``None`` and passes tokens_per_expert
        through, and ``adapt_permute`` does exactly the same around our kernels.
sort_chunks_by_idxs (``moe_utils``), 0.16 to 0.19:
    ``sort_chunks_by_idxs(input, split_sizes, sorted_idxs, probs=None, fused=False)
    -> (output, permuted_probs)``; the alltoall dispatcher passes host tensors as split sizes and
    order (its dtoh copy) and ``fused=config.moe_permute_fusion`` (TE's kernel).
all_to_all (``tensor_parallel.mappings``):
    >= 0.18: the alltoall dispatcher passes ``use_nccl_stream=`` (run on a side NCCL stream so the
        shared experts overlap); ``adapt_all_to_all`` accepts and drops it: ours runs on the current
        stream (correct, without that overlap).
"""

import functools

import torch

from megatron_moe.compat.versions import mcore_at_least


def adapt_permute(fn):
    """Wrap a permute with megatron-core 0.16's contract for the installed megatron-core."""
    if not mcore_at_least("0.17"):
        return fn

    @functools.wraps(fn)
    def permute(*args, tokens_per_expert=None, align_size=0, **kwargs):
        tokens, probs, sorted_indices = fn(*args, **kwargs)
        return tokens, probs, sorted_indices, None, tokens_per_expert

    return permute


def adapt_unpermute(fn):
    """Wrap an unpermute with megatron-core 0.16's contract for the installed megatron-core."""
    if not mcore_at_least("0.17"):
        return fn

    @functools.wraps(fn)
    def unpermute(*args, pad_offsets=None, **kwargs):
        if pad_offsets is not None:  # only TE's fused permute-and-pad produces these
            raise NotImplementedError("unpermute with pad_offsets (TE fused permute-and-pad) is not "
                                      "supported by --moe-permute-fusion's kernels")
        return fn(*args, **kwargs)

    return unpermute


def adapt_all_to_all(fn):
    """Wrap an ``all_to_all(group, input, output_splits, input_splits)`` for megatron-core's call."""
    if not mcore_at_least("0.18"):
        return fn

    @functools.wraps(fn)
    def all_to_all(*args, use_nccl_stream=False, **kwargs):
        return fn(*args, **kwargs)

    return all_to_all



def permute_v016(fn):
    """The inverse of ``adapt_permute``: a permute with the installed megatron-core's contract
    (e.g. ``token_dispatcher.permute``, whatever is bound there) called with 0.16's:
    ``(tokens, probs, sorted_indices)``; from 0.17 the unfused path requires ``num_out_tokens``
    (0.16 ignored it there and kept every routed pair, which is the count filled in)."""
    if not mcore_at_least("0.17"):
        return fn

    @functools.wraps(fn)
    def permute(tokens, routing_map, probs=None, num_out_tokens=None, drop_and_pad=False, **kwargs):
        if num_out_tokens is None and not drop_and_pad:
            num_out_tokens = int(routing_map.bool().sum())
        return fn(tokens, routing_map, probs=probs, num_out_tokens=num_out_tokens,
                  drop_and_pad=drop_and_pad, **kwargs)[:3]

    return permute


def permute_by_argsort(tokens, routing_map, probs, num_out_tokens: int):
    """The routed (expert, token) pairs of ``routing_map`` [tokens, experts] in megatron-core's
    order (by expert, then token) without a data-sized op: the pairs come first in a stable
    descending argsort of the transposed map, and there are ``num_out_tokens`` of them (dropless:
    tokens x top-k). megatron-core's method from 0.17; 0.16 used ``masked_select``, whose output
    size is the data's (on CUDA a host wait). Returns (tokens, probs, sorted_indices)."""
    num_tokens = routing_map.shape[0]
    flat = routing_map.bool().T.contiguous().reshape(-1)
    chosen = flat.argsort(descending=True, stable=True)[:num_out_tokens]
    sorted_indices = chosen % num_tokens
    permuted_probs = None if probs is None else probs.T.contiguous().reshape(-1)[chosen]
    return tokens.index_select(0, sorted_indices), permuted_probs, sorted_indices


def argsort_permute():
    """For megatron-core <= 0.16 (None from 0.17, which permutes this way itself): its ``permute``
    with the dropless case (a host-integer count, no fusion, no padding) done by
    :func:`permute_by_argsort`: the alltoall dispatcher's permute runs once per MoE layer per
    micro-batch, and 0.16's ``masked_select`` made each a host wait (two with probs). Same pairs in
    the same order, so forward and backward are bit-identical; every other case is megatron-core's.
    Bound by moe/dispatcher.py ``dispatcher_bindings``."""
    if mcore_at_least("0.17"):
        return None
    from megatron.core.transformer.moe import moe_utils

    mcore = moe_utils.permute   # the module's own, never the dispatcher's rebound name

    def permute(tokens, routing_map, probs=None, num_out_tokens=None, fused=False,
                drop_and_pad=False):
        if fused or drop_and_pad or not isinstance(num_out_tokens, int):
            return mcore(tokens, routing_map, probs=probs, num_out_tokens=num_out_tokens,
                         fused=fused, drop_and_pad=drop_and_pad)
        return permute_by_argsort(tokens, routing_map, probs, num_out_tokens)

    return permute


def mcore_permute(*args, **kwargs):
    """megatron-core's own ``moe_utils.permute`` under the 0.16 contract (the reference our
    kernels are compared with)."""
    from megatron.core.transformer.moe import moe_utils

    return permute_v016(moe_utils.permute)(*args, **kwargs)


def mcore_unpermute(*args, **kwargs):
    """megatron-core's own ``moe_utils.unpermute`` (the same call under 0.16's contract: 0.17's
    ``pad_offsets`` is only TE's, never passed here)."""
    from megatron.core.transformer.moe import moe_utils

    return moe_utils.unpermute(*args, **kwargs)


def order_after_dispatcher_host_copy(td) -> None:
    """megatron-core's alltoall dispatcher (0.16 to 0.19, ``_maybe_dtoh_and_synchronize``) copies
    its split counts to pinned host memory on a side stream, records ``d2h_event`` and waits for
    it on the host only at its own all-to-all. A caller that reads those host copies without that
    all-to-all (the chunked layer) makes the current stream wait for the event: a host-to-device
    copy of them queued next sees the finished values, with no host wait."""
    event = getattr(td, "d2h_event", None)
    if event is not None and torch.cuda.is_available():
        torch.cuda.current_stream().wait_event(event)


def keep_counts_on_device(td) -> bool:
    """megatron-core's alltoall dispatcher (0.16 to 0.19) copies its split counts and
    ``tokens_per_expert`` to the host at ``cuda_dtoh_point`` and waits for that copy at
    ``cuda_sync_point``, which ``preprocess`` lowers to the earliest point that needs a host
    value; at expert and tensor parallel size 1 that is "before_finish" (SequentialMLP splits
    its input by host counts) or "before_permutation_2" (megatron-core's chunk sort), a host
    wait per MoE layer per micro-batch. With no all-to-all and experts that take device counts
    (grouped experts; our chunk sort leaves the identity order of one rank untouched) nothing
    needs them on the host: "no_sync" as the copy point, ranked first, keeps both off (every
    point ``preprocess`` asks for ranks after it, so the sync point stays "no_sync" and its
    assertion, copy point <= sync point, holds). Returns whether it applied (only the alltoall
    dispatcher has these points)."""
    priority = getattr(td, "cuda_sync_point_priority", None)
    if priority is None or "no_sync" not in priority:
        return False
    td.cuda_sync_point_priority = dict(priority, no_sync=min(priority.values()) - 1)
    td.cuda_dtoh_point = td.cuda_sync_point = "no_sync"
    return True


def drop_kept_graph(td) -> int:
    """megatron-core's dispatchers (0.16 to 0.19) keep tensors of the last forward as attributes
    until the next one overwrites them: the alltoall dispatcher its ``probs``, the allgather one
    its ``local_probs``. Those carry the forward's autograd graph, and through it the
    AccumulateGrad node of every parameter before the router: a node made in one iteration
    outlives it, and a full-iteration CUDA graph's capture then accumulates into a node of the
    default stream (what fails the capture without torch's set_override_stale_capture_stream).
    Each such attribute becomes its detached self (same values, dtype and shape for any later
    reader, no graph). Call once the layer's forward has read them (after ``postprocess``, whose
    ``combine_postprocess`` reads ``probs.dtype``). The number of attributes detached."""
    dropped = 0
    for name, value in list(vars(td).items()):
        if isinstance(value, torch.Tensor) and value.grad_fn is not None:
            setattr(td, name, value.detach())
            dropped += 1
    return dropped


# --- the binding itself ---------------------------------------------------------------------------
# megatron-core's MoEAlltoAllTokenDispatcher / MoEAllGatherTokenDispatcher call permute, unpermute,
# sort_chunks_by_idxs (moe_utils) and all_to_all (tensor_parallel) by module-level name inside
# ``token_dispatcher``: the one seam through which another implementation can run under
# megatron-core's own call sites (splits bookkeeping, capacity, TP/EP grouping) without copying
# them. Those names are bound only while one of our MoE layers runs a stage (DispatcherScope, entered
# by megatron_moe/moe/layer.py), so each layer runs its own exchange and nothing outside it sees a
# change. The names and contracts move between releases: a version concern, so it lives here.


def token_dispatcher_module():
    from megatron.core.transformer.moe import token_dispatcher

    return token_dispatcher


class DispatcherScope:
    """``with scope:`` binds ``names`` (name -> function, adapted with adapt_permute /
    adapt_unpermute / adapt_all_to_all) inside megatron-core's token_dispatcher module and puts back
    what was there on exit (nesting restores in order). A plain class, not a contextlib generator:
    it is entered five times per MoE layer per micro-batch."""

    __slots__ = ("names", "_saved")

    def __init__(self, names: dict):
        self.names = dict(names)
        self._saved = []

    def __enter__(self):
        td = token_dispatcher_module()
        self._saved.append({name: getattr(td, name) for name in self.names})
        for name, fn in self.names.items():
            setattr(td, name, fn)
        return self

    def __exit__(self, *exc):
        td = token_dispatcher_module()
        for name, fn in self._saved.pop().items():
            setattr(td, name, fn)
        return False
