"""``ReplicaPlacement``: the MoE layer (megatron_moe/moe/layer.py) with lightweight expert replication.

Injected into the one MoE layer as its ``placement`` by ``balance.install``. The router, the
experts (``SequentialMLP``) and the shared experts are megatron-core's; only the token dispatch is
ours (all-to-all over the EP group with autograd), because a token whose source
rank holds a replica of its expert must be computed there and never sent:

1. route (megatron-core router, aux losses unchanged); all-gather the local per-expert counts over
   the EP group -> C[D, E] (the planner's statistics and the all-to-all split sizes); permute the
   (token, expert) pairs expert-major with the token dispatcher's ``permute`` (megatron-core's, or
   ours with ``--moe-permute-fusion``: the layer's exchange binds it);
2. the placement's dispatch matrix ``send[e, src, dst]`` (``policies.base.dispatch_matrix``) says where
   every (token, expert) pair is computed: Pro-Prophet/FasterMoE placements keep pairs whose expert
   has a replica (or the owner) on this rank local and send the others to the owner; FlexMoE
   placements keep what fits the local vExperts and spread the overflow over the other replicas.
   The all_to_all of tokens and probs is issued asynchronously (the scheduler plans the next
   iteration while it is in flight) on ``megatron_moe.comm`` with ``--moe-a2a-algorithm`` and
   ``--moe-a2a-compression`` (tokens compressed both ways; probs, one float per row, exact);
3. each computed expert runs once on [its local pairs ; pairs received from each source rank]:
   owned experts with their own parameters, replicas with ``torch.func.functional_call`` on the
   Trans'd tensors; the probs are passed as the expert's per-token scale exactly as SequentialMLP.
   With grouped experts (``--moe-grouped-gemm`` on the local path) all of them are one grouped
   call per linear, the replicas extra groups of it;
4. the outputs go back (reverse all_to_all, same algorithm and compressor) and are summed per token
   with the dispatcher's ``unpermute``.

Every collective goes through megatron_moe/comm/ on the data's device (docs/comm.md).

These are the layer's stages (megatron-core's names): 1 is ``preprocess`` (the plan stays on the
layer's ``LayerBalance`` until ``postprocess``), 2 ``dispatch``, 3 ``routed_experts_compute``, 4
``combine`` (the reverse all_to_all) and ``postprocess`` (unpermute, shared experts added).

With an empty placement this is plain EP (tested against the stock layer).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np
import torch

from megatron_moe import comm
from megatron_moe.balance.cost_model import a2a_crosses
from megatron_moe.balance.placement import LayerBalance
from megatron_moe.moe.dispatcher import permute_fns
from megatron_moe.moe.grouped_experts import GroupedSequentialMLP

__all__ = ["ReplicaPlacement"]


class ReplicaPlacement:
    """The placement injected into megatron_moe.moe.layer.MoELayer (``placement=``) under
    ``--moe-balance-policy`` / ``--moe-routing-trace-dir``: attaches the layer's ``LayerBalance``
    (the replicas, Trans / Agg, the counts) and runs the layer's dispatch -> experts -> combine
    middle by the placement's dispatch matrix. Stateless: one instance serves every layer."""

    @staticmethod
    def supported(layer, pg_collection) -> bool:
        config = layer.config
        return (pg_collection.tp.size() == 1
                and getattr(pg_collection, "expt_tp", pg_collection.tp).size() == 1
                and not config.moe_latent_size and hasattr(layer.experts, "local_experts")
                and not getattr(layer, "shared_expert_overlap", False)
                and not config.moe_pad_expert_input_to_capacity)

    def attach(self, layer, pg_collection) -> Optional[LayerBalance]:
        """The layer's balance runtime, or None where the replica dispatch cannot run (the layer is
        then megatron-core's; BalanceManager refuses it under a policy)."""
        if not self.supported(layer, pg_collection):
            return None
        return LayerBalance(layer.experts, layer.layer_number, layer.config.num_moe_experts,
                            layer.ep_group)

    # --- the layer's stages (megatron_moe/moe/layer.py), each marked hot path for comm.strict ---
    def begin(self, layer):
        st = layer.balance
        if st.layer_number is None:
            st.layer_number = layer.layer_number
        if st.scheduler is not None:
            st.scheduler.on_layer_forward(st, layer.training)
        else:
            st.begin_forward(None, layer.training)

    def preprocess(self, layer, hidden_states, probs, routing_map):
        with comm.strict.hot_path():
            return _plan(layer, hidden_states, probs, routing_map)

    def dispatch(self, layer, perm_x, pprobs):
        with comm.strict.hot_path():
            return _dispatch_pairs(layer, perm_x, pprobs)

    def compute(self, layer, comp_x, comp_p):
        with comm.strict.hot_path():
            return _compute_pairs(layer, comp_x, comp_p), None

    def combine(self, layer, all_y):
        with comm.strict.hot_path():
            return _combine_pairs(layer, all_y)

    def postprocess(self, layer, perm_y, shared_expert_output):
        with comm.strict.hot_path():
            plan, layer.balance.plan = layer.balance.plan, None
            out = plan.unpermute(perm_y, plan.sorted_idx, torch.Size((plan.rows, perm_y.shape[-1])))
            out = out.to(plan.dtype).view(plan.shape)
            if shared_expert_output is not None:
                out = out + shared_expert_output
            if layer.balance.scheduler is not None:
                layer.balance.scheduler.after_layer_forward(layer.balance)
            return out


@dataclasses.dataclass
class _Plan:
    """One forward's plan of a layer, from ``preprocess`` to ``postprocess``: where each (token,
    expert) pair is computed, on the host (split sizes) and as device index arrays."""
    shape: torch.Size
    dtype: torch.dtype       # the hidden states'
    probs_dtype: torch.dtype # the router's: the permuted outputs are summed in it
    rows: int                # tokens of this micro-batch
    perm_rows: int           # (token, expert) pairs of this micro-batch
    send: np.ndarray         # [E, src, dst] pairs computed on dst
    in_splits: list
    out_splits: list
    lsel: torch.Tensor       # permuted rows computed here
    rsel: torch.Tensor       # permuted rows sent, by destination then expert
    index: torch.Tensor      # [local pairs ; received rows] -> compute order
    segments: list           # (expert, rows) in compute order
    nloc: int
    exchange: bool           # whether any pair crosses ranks (else every rank skips the a2a)
    sorted_idx: torch.Tensor
    unpermute: object
    owner: np.ndarray


def _plan(layer, hidden_states, probs, routing_map):
    """Gather the counts, plan the dispatch, permute the pairs expert-major. Returns the permuted
    rows and probs; the plan stays on the layer's balance runtime until ``postprocess``."""
    st = layer.balance
    shape = hidden_states.shape
    x = hidden_states.reshape(-1, shape[-1])
    D, r, E, L = st.D, st.rank, st.num_experts, st.num_local
    local_counts = routing_map.sum(dim=0).to(torch.int64).reshape(1, E)
    # counts gathered on the data's device; the planner and the split sizes need them on the host
    C = (comm.all_gather_rows(local_counts, layer.ep_group) if D > 1 else local_counts).cpu()
    if layer.training:
        st.counts += C.to(torch.float64)
    send = st._active_placement.dispatch(C.numpy())     # [E, src, dst] inputs computed on dst
    owner = np.arange(E) // L

    # (token, expert) pairs in expert-major order (the exchange's permute); of expert e's
    # pairs the first send[e, r, r] stay here, the rest go to the other ranks in ascending order
    permute, unpermute = permute_fns()   # the layer's exchange scope is bound
    # num_out_tokens from the host counts: megatron-core >= 0.17's permute would read it back
    perm_x, pprobs, sorted_idx = permute(x, routing_map, probs=probs,
                                         num_out_tokens=int(C.numpy()[r].sum()))[:3]
    row = send[:, r, :]                                  # [E, D]
    order = [r] + [d for d in range(D) if d != r]
    dst = np.repeat(np.tile(order, E), row[:, order].reshape(-1))
    is_local = dst == r
    lsel_np = np.nonzero(is_local)[0]
    rem = np.nonzero(~is_local)[0]
    rsel_np = rem[np.argsort(dst[rem], kind="stable")]   # by dst, then expert
    segments, index_np = _compute_order(st, send, int(lsel_np.size), owner)
    # the three index arrays reach the device in one copy (non-blocking from pinned memory on CUDA)
    lsel, rsel, index = _to_device([lsel_np, rsel_np, index_np], x.device)
    # every rank holds the same all-gathered C, hence the same send matrix: when no pair crosses
    # ranks anywhere (every hot expert replicated where its inputs are) all ranks skip the
    # dispatch and combine exchanges and their backward together; the rows exchanged are empty
    # either way, so the result is identical, minus 3 collectives (6 with their backward) each a
    # synchronisation of every rank
    st.plan = _Plan(shape=shape, dtype=hidden_states.dtype, probs_dtype=probs.dtype, rows=x.shape[0],
                    perm_rows=perm_x.shape[0], send=send,
                    in_splits=[0 if d == r else int(row[:, d].sum()) for d in range(D)],
                    out_splits=[0 if d == r else int(send[:, d, r].sum()) for d in range(D)],
                    lsel=lsel, rsel=rsel, index=index, segments=segments, nloc=int(lsel_np.size),
                    exchange=D > 1 and crosses_ranks(send), sorted_idx=sorted_idx,
                    unpermute=unpermute, owner=owner)
    return perm_x, pprobs


def _dispatch_pairs(layer, perm_x, pprobs):
    """Send the pairs computed elsewhere (asynchronously: the scheduler plans ahead while they are
    in flight); returns this rank's pairs and probs in compute order."""
    st, plan = layer.balance, layer.balance.plan
    D, r, E, owner, send = st.D, st.rank, st.num_experts, plan.owner, plan.send
    send_x = perm_x.index_select(0, plan.rsel)   # index_select: its backward is a fast index_add
    send_p = pprobs.index_select(0, plan.rsel)
    if plan.exchange:
        recv_x, recv_p = _dispatch(layer.ep_group, send_x, send_p, plan.out_splits,
                                   plan.in_splits, st, layer.exchange)
    else:
        if D > 1:
            st.a2a_skipped += 1
            _dispatch_skipped(st)
        recv_x, recv_p = send_x, send_p
    st.a2a_rows_recv += int(sum(plan.out_splits))
    st.a2a_rows_recv_replica += int(sum(send[e, d, r] for e in range(E) if owner[e] != r
                                        for d in range(D) if d != r))
    all_x = torch.cat([perm_x.index_select(0, plan.lsel), recv_x])
    all_p = torch.cat([pprobs.index_select(0, plan.lsel), recv_p])
    return all_x.index_select(0, plan.index), all_p.index_select(0, plan.index)


def _compute_pairs(layer, comp_x, comp_p):
    """Every expert computed here on its pairs; the outputs back in [local pairs ; received rows]
    order."""
    st, plan = layer.balance, layer.balance.plan
    if st.scheduler is not None:
        st.scheduler.before_expert_compute(st)
    else:
        st.wait_trans(None)
    if layer.config.moe_apply_probs_on_input:       # as SequentialMLP
        comp_x = (comp_p.unsqueeze(-1) * comp_x).to(comp_x.dtype)
        comp_p = torch.ones_like(comp_p)
    comp_y = _compute(layer, plan.segments, comp_x, comp_p, plan.owner)
    if comp_y is None:
        comp_y = comp_x.new_zeros(0, plan.shape[-1])
    all_y = torch.zeros(comp_x.shape[0], comp_y.shape[-1], dtype=comp_y.dtype, device=comp_y.device)
    return all_y.index_copy(0, plan.index, comp_y)


def _combine_pairs(layer, all_y):
    """Return the received rows' outputs to their source ranks; every pair's output back in the
    permuted (expert-major) order, for the exchange's unpermute in ``postprocess``."""
    plan = layer.balance.plan
    loc_y, back_y = all_y[:plan.nloc], all_y[plan.nloc:]
    if plan.exchange:
        got_y = comm.all_to_all(back_y, plan.in_splits, plan.out_splits, layer.ep_group,
                                algorithm=layer.exchange.algorithm,
                                compression=layer.exchange.compression)
    else:
        got_y = back_y
    perm_y = torch.zeros(plan.perm_rows, all_y.shape[-1], dtype=plan.probs_dtype, device=all_y.device)
    return perm_y.index_copy(0, torch.cat([plan.lsel, plan.rsel]),
                             torch.cat([loc_y, got_y]).to(plan.probs_dtype))


def _compute(layer, segments, comp_x, comp_p, owner):
    """Each computed expert on its rows (``segments``: (expert, rows) in row order): owned
    experts with their own parameters, replicas with the Trans'd tensors. With grouped experts
    (--moe-grouped-gemm on the local path) one grouped call, the replicas as extra groups
    stacked with the owned weights (their grads flow back to the Trans'd leaves, so Agg sees
    them as in the loop); else megatron-core's loop, replicas through functional_call."""
    st, r, L = layer.balance, layer.balance.rank, layer.balance.num_local
    if not segments:
        return None
    experts = [layer.experts.local_experts[e - r * L] if owner[e] == r else st.replica_params(e)
               for e, _ in segments]
    if isinstance(layer.experts, GroupedSequentialMLP):
        counts = torch.tensor([k for _, k in segments], dtype=torch.int64)
        return layer.experts.run_groups(experts, comp_x, comp_p, counts)
    outs, start = [], 0
    for expert, (e, k) in zip(experts, segments):
        xe, pe_ = comp_x[start:start + k], comp_p[start:start + k]
        start += k
        if owner[e] == r:
            y, _ = expert(xe, pe_)
        else:
            y, _ = torch.func.functional_call(st.template, expert, (xe, pe_))
        outs.append(y)
    return torch.cat(outs)


def crosses_ranks(send: np.ndarray) -> bool:
    """Whether the dispatch matrix ``send[e, src, dst]`` moves any pair between two ranks."""
    return bool(a2a_crosses(send.sum(axis=0)))   # the cost model's rule: it prices a skipped exchange as 0


def _compute_order(st, send, nloc, owner):
    """The compute order on the host: for each expert computed here, [its local pairs ; the rows
    received for it by source rank], as indices into [local pairs ; received rows]. Returns
    ([(expert, rows)], index array)."""
    D, r, E = st.D, st.rank, st.num_experts
    loc_counts = send[np.arange(E), r, r]
    loc_start = np.concatenate([[0], np.cumsum(loc_counts)])
    recv_start = np.zeros((D, E), dtype=np.int64)        # offset of (source d, expert e) rows
    off = 0
    for d in range(D):
        if d == r:
            continue
        for e in range(E):
            recv_start[d, e] = off
            off += int(send[e, d, r])
    segments, index = [], []
    for e in range(E):
        mine = owner[e] == r
        if not (mine or r in st._active_placement.replica_sets[e]):
            continue
        idx = [np.arange(loc_start[e], loc_start[e + 1])]
        for d in range(D):
            k = int(send[e, d, r]) if d != r else 0
            if k:
                idx.append(nloc + np.arange(recv_start[d, e], recv_start[d, e] + k))
        idx = np.concatenate(idx).astype(np.int64)
        segments.append((e, int(idx.size)))
        index.append(idx)
    return segments, (np.concatenate(index) if index else np.zeros(0, np.int64))


def _to_device(arrays, device):
    """Host int64 index arrays on ``device`` in one host-to-device copy, split there (views). On
    CUDA the host buffer is pinned and the copy non-blocking: the host goes on planning while it
    is in flight, and the stream orders it before the index_selects that use it."""
    host = torch.from_numpy(np.concatenate([a.astype(np.int64, copy=False) for a in arrays]))
    if device.type == "cuda":
        host = host.pin_memory()
    return torch.split(host.to(device, non_blocking=True), [a.size for a in arrays])


def _dispatch(group, send_x, send_p, out_splits, in_splits, st, xc):
    """Dispatch all-to-all of tokens and probs on megatron_moe.comm, async; while it is in flight the
    scheduler may plan ahead (note 2.6: Plan^{j+1} under iteration j's A2A). Tokens use the
    configured compressor, probs (one float per row, needed exactly) go uncompressed."""
    sched, it = st.scheduler, (st.scheduler.iteration if st.scheduler is not None else None)
    hx = comm.all_to_all_async(send_x, out_splits, in_splits, group, algorithm=xc.algorithm,
                               compression=xc.compression)
    hp = comm.all_to_all_async(send_p, out_splits, in_splits, group, algorithm=xc.algorithm)
    st._log("a2a_issue", it, mb=st.forward_count)
    if sched is not None:
        sched.during_dispatch(st)
    recv_x, recv_p = hx.wait(), hp.wait()
    st._log("a2a_wait", it, mb=st.forward_count)
    return recv_x, recv_p


def _dispatch_skipped(st):
    """No pair crosses ranks: the same scheduling points as ``_dispatch`` (plan ahead) without the
    exchange; the log marks it."""
    it = st.scheduler.iteration if st.scheduler is not None else None
    st._log("a2a_issue", it, mb=st.forward_count, skipped=True)
    if st.scheduler is not None:
        st.scheduler.during_dispatch(st)
    st._log("a2a_wait", it, mb=st.forward_count, skipped=True)
