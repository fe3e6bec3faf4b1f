"""The chunked middle of the MoE layer (``--moe-a2a-overlap-degree`` > 1, ``--moe-a2a-schedule fastermoe``).

megatron-core's ``MoELayer`` runs one dispatch all-to-all, the local experts, and one combine
all-to-all back to back. With a chunked exchange (megatron_moe/moe/dispatcher.py ``ExchangeConfig``)
the layer keeps megatron-core's router, permutation (``dispatch_preprocess`` /
``combine_postprocess``) and expert modules, and replaces the middle with
:func:`megatron_moe.comm.chunked_moe_exchange`: ScheMoE's OptSche order (or FasterMoE's group-wise
ring with ``--moe-a2a-schedule fastermoe``), so chunk i's all-to-all overlaps the expert compute of
chunk i-1. Every token still meets the same expert with the same weights, so output and gradients
equal the plain layer (tested in tests/test_comm_layer.py).

Limits (checked in :func:`validate_args`): tensor parallel 1 and expert tensor parallel 1, no
pad-to-capacity, no shared-expert overlap, not combined with ``--moe-balance-policy``.
Routing probabilities (one float per row) travel in a separate unchunked all-to-all: it is tiny and
they are needed by every chunk's expert compute (megatron-core applies them inside the experts).
"""

from __future__ import annotations

import torch

from megatron_moe import comm
from megatron_moe.compat.dispatch import order_after_dispatcher_host_copy
from megatron_moe.moe.layer import CoreStages


class ChunkedMiddle(CoreStages):
    """The layer's middle (megatron_moe/moe/layer.py) with a chunked exchange: megatron-core's
    ``preprocess`` / ``postprocess`` (permutation, unpermutation), no exchange at ``dispatch``, the
    chunked pipeline of dispatch -> experts -> combine at ``compute``, nothing left at ``combine``.
    The routing map travels from ``preprocess`` to ``compute`` on the layer (``chunk_routing_map``):
    the split sizes are read from it."""

    @staticmethod
    def applies(layer) -> bool:
        td = layer.token_dispatcher
        return (getattr(td, "ep_size", 1) > 1 and getattr(td, "tp_size", 1) == 1
                and not getattr(td, "drop_and_pad", False) and hasattr(td, "input_splits"))

    def preprocess(self, layer, hidden_states, probs, routing_map):
        layer.chunk_routing_map = routing_map
        return super().preprocess(layer, hidden_states, probs, routing_map)

    def dispatch(self, layer, tokens, probs):
        return tokens, probs

    def compute(self, layer, tokens, probs):
        routing_map, layer.chunk_routing_map = layer.chunk_routing_map, None
        return _chunked_experts(layer, tokens, probs, routing_map), None

    def combine(self, layer, output):
        return output


def split_counts(td, routing_map):
    """Rows this rank sends and receives, ``[ep rank][local expert]`` each, as host lists, in one
    host read: the send counts (permute sorts rows by global expert id) and megatron-core's
    received counts (``num_global_tokens_per_local_expert``; its ``output_splits`` with one local
    expert) travel in one concatenated tensor. Where megatron-core already copied its counts to
    the host (its dtoh point, CUDA without permute fusion) they ride along in a small non-blocking
    host-to-device copy, queued after megatron-core's side-stream copy, instead of a second
    device-to-host read."""
    ep, local = td.ep_size, td.num_local_experts
    sent = routing_map.sum(dim=0)
    got = torch.as_tensor(td.num_global_tokens_per_local_expert if local > 1 else td.output_splits)
    if got.device != sent.device:
        order_after_dispatcher_host_copy(td)
        got = got.to(sent.device, non_blocking=True)
    got = got.reshape(-1).to(sent.dtype)
    counts = torch.cat([sent, got]).tolist()
    send, recv = counts[:ep * local], counts[ep * local:]
    return ([send[i * local:(i + 1) * local] for i in range(ep)],
            [recv[i * local:(i + 1) * local] for i in range(ep)])


def _chunked_experts(layer, tokens, probs, routing_map):
    from megatron_moe.moe.dispatcher import sort_chunks_by_idxs   # constant launches per chunk

    td, xc = layer.token_dispatcher, layer.exchange
    ep, local = td.ep_size, td.num_local_experts
    send, recv = split_counts(td, routing_map)
    send_rows, recv_rows = [sum(r) for r in send], [sum(r) for r in recv]
    group = td.ep_group
    recv_probs = comm.all_to_all(probs, recv_rows, send_rows, group, algorithm=xc.algorithm)
    sort_idx = td.sort_input_by_local_experts
    restore_idx = td.restore_output_by_local_experts

    def expert_fn(rows, splits, recv_index):
        # rows: (source rank, local expert) blocks of this chunk; the experts want expert-major
        chunk_probs = recv_probs.index_select(0, recv_index)
        sizes = torch.tensor([s for row in splits for s in row])
        if local > 1:
            rows, chunk_probs = sort_chunks_by_idxs(rows, sizes, sort_idx, probs=chunk_probs)
        per_expert = sizes.reshape(ep, local).sum(dim=0)
        out, bias = layer.experts(rows, per_expert, chunk_probs)
        assert bias is None, "mlp bias is not supported by the chunked MoE layer"
        if local > 1:
            out, _ = sort_chunks_by_idxs(out, sizes.reshape(ep, local).t().ravel(), restore_idx)
        return out

    return comm.chunked_moe_exchange(
        tokens, send, recv, expert_fn, group, degree=xc.overlap_degree, order=xc.schedule,
        algorithm=xc.algorithm, compression=xc.compression, pass_recv_index=True)


def validate_args(args):
    """Raise ValueError naming the flag when the chunked layer cannot run this configuration."""
    degree = getattr(args, "moe_a2a_overlap_degree", 1)
    if degree <= 1 and getattr(args, "moe_a2a_schedule", "schemoe") == "schemoe":
        return
    if not getattr(args, "num_experts", None):
        return
    need = {"--tensor-model-parallel-size": getattr(args, "tensor_model_parallel_size", 1),
            "--expert-tensor-parallel-size": getattr(args, "expert_tensor_parallel_size", 1) or 1}
    for flag, value in need.items():
        if value != 1:
            raise ValueError(f"--moe-a2a-overlap-degree {degree}: needs {flag} 1 (got {value})")
    if getattr(args, "moe_pad_expert_input_to_capacity", False):
        raise ValueError(f"--moe-a2a-overlap-degree {degree}: not supported with "
                         "--moe-pad-expert-input-to-capacity")
    if getattr(args, "moe_shared_expert_overlap", False):
        raise ValueError(f"--moe-a2a-overlap-degree {degree}: not supported with "
                         "--moe-shared-expert-overlap")
    if getattr(args, "overlap_moe_expert_parallel_comm", False):
        raise ValueError(f"--moe-a2a-overlap-degree {degree}: cannot be combined with "
                         "--overlap-moe-expert-parallel-comm (megatron-core's overlapped schedule "
                         "needs the exchange in the dispatch and combine stages; the chunked "
                         "middle runs it inside the experts' stage)")
    if getattr(args, "moe_balance_policy", "none") not in (None, "none"):
        raise ValueError(f"--moe-a2a-overlap-degree {degree}: cannot be combined with "
                         f"--moe-balance-policy {args.moe_balance_policy}")
    ep = getattr(args, "expert_model_parallel_size", 1)
    if getattr(args, "moe_a2a_schedule", "schemoe") == "fastermoe" and ep % max(degree, 1):
        raise ValueError(f"--moe-a2a-overlap-degree {degree}: with --moe-a2a-schedule fastermoe it "
                         f"is the number of rank groups and must divide "
                         f"--expert-model-parallel-size {ep}")
    if getattr(args, "moe_token_dispatcher_type", "alltoall") != "alltoall":
        raise ValueError(f"--moe-a2a-overlap-degree {degree}: needs --moe-token-dispatcher-type "
                         "alltoall")
