"""All-to-all time formulas for the simulator (flat, hierarchical 2DH, pipe), vectorised over EP groups.

``traffic[g, src, dst]`` is bytes sent from group-local rank src to dst in EP group g.  Group ranks
are contiguous global ranks, laid out node-major (``ranks_per_node`` per node), so a group of P
ranks spans ``P / L`` nodes of ``L = min(P, ranks_per_node)`` ranks each.  The models follow
schemoe.md 2.4-2.5 (the paper's Eqs. 16-17) and move exactly the bytes that
``megatron_moe.comm.wire_stats`` counts for the runtime algorithms (tested in tests/test_sim.py):

* flat (NCCL, one stream): every rank's intra-node send/recvs and inter-node send/recvs share one
  stream, so a rank needs ``t_intra + t_inter`` (Eq. 17), each the slower of its out/in direction,
  plus one message latency per peer.  The collective ends when the slowest rank does.
* pipe (ScheMoE Pipe-A2A): the same messages, intra-node and inter-node on two concurrent
  channels: ``max(t_intra, t_inter)`` (Eq. 16).
* hierarchical (2DH): phase 1 intra-node all-to-all regroups data by destination local index
  (L-1 messages), phase 2 inter-node all-to-all between same-index ranks with node-aggregated
  messages (N-1 messages); phases run back to back.
"""

from __future__ import annotations

import numpy as np

from megatron_moe.balance.cost_model import a2a_crosses

__all__ = ["ALGORITHMS", "alltoall_time"]

ALGORITHMS = ("flat", "hierarchical", "pipe")


def _layout(p: int, rpn: int):
    l = min(p, rpn)
    if p % l:
        raise ValueError(f"sim: EP group size {p} is not a multiple of ranks_per_node {rpn} "
                         "(or a divisor of it)")
    return p // l, l


def _pair_scale(cluster, l: int) -> np.ndarray:
    """[l, l] factor on intra-node transfer times: intra_bw / the local link's rate (NVLink pairs)."""
    return cluster.intra_bw / cluster.local_bw(l)


def _flat_linear(t4: np.ndarray, cluster, algorithm: str, n: int, l: int) -> np.ndarray:
    """flat / pipe without a per-message bandwidth table (``a2a_bw_table``): the same
    formula as the general path from per-rank byte sums only, without [g, P, P] masks (the general
    path's cost dominated 8192-GPU runs; tests/test_sim.py checks both paths agree).

    ``cluster.msg_efficiency`` (a fraction of the link rate by the rank's all-to-all volume) scales
    each rank's transfer time (not its per-message latency): the curve is an all-to-all benchmark's bandwidth as a function of the bytes
    one GPU exchanges in the whole collective (Tutel's ``bandwidth_test.py`` reports
    ``buffer bytes per GPU / time``; the Pro-Prophet artifact looks it up on the busiest rank's
    total bytes), not of the single peer-to-peer message."""
    g = t4.shape[0]
    node_blk = np.einsum("gaiaj->gaij", t4)                   # [g, node, src local, dst local]
    selfb = np.einsum("gaii->gai", node_blk)
    if cluster.intra_pair_bw:
        w = node_blk / cluster.local_bw(l)[None, None]
        ti_out = w.sum(axis=3) - selfb / cluster.local_bw(l).diagonal()[None, None]
        ti_in = w.sum(axis=2) - selfb / cluster.local_bw(l).diagonal()[None, None]
    else:
        ti_out = (node_blk.sum(axis=3) - selfb) / cluster.intra_bw
        ti_in = (node_blk.sum(axis=2) - selfb) / cluster.intra_bw
    e_out = t4.sum(axis=(3, 4)) - node_blk.sum(axis=3)        # inter-node bytes per rank
    e_in = t4.sum(axis=(1, 2)) - node_blk.sum(axis=2)
    out_e, in_e = e_out / cluster.inter_bw, e_in / cluster.inter_bw
    if cluster.node_inter_bw:
        out_e = np.maximum(out_e, e_out.sum(axis=2, keepdims=True) / cluster.node_inter_bw)
        in_e = np.maximum(in_e, e_in.sum(axis=2, keepdims=True) / cluster.node_inter_bw)
    eff = 1.0
    if cluster.msg_efficiency:                                 # by the bytes each rank sends / receives
        eff = cluster.volume_efficiency(np.maximum(node_blk.sum(axis=3) - selfb + e_out,
                                                   node_blk.sum(axis=2) - selfb + e_in))
    t_intra = np.maximum(ti_out, ti_in) / eff + (l - 1) * cluster.intra_lat
    t_inter = np.maximum(out_e, in_e) / eff + (n - 1) * l * cluster.inter_lat
    t = t_intra + t_inter if algorithm == "flat" else np.maximum(t_intra, t_inter)
    return t.reshape(g, -1).max(axis=1)


def alltoall_time(traffic: np.ndarray, cluster, algorithm: str = "flat") -> np.ndarray:
    """Seconds per EP group for one all-to-all with the given byte matrix; 0 for a group whose
    matrix moves nothing between ranks (the runtime skips that exchange, and the cost model's
    ``a2a_crosses`` prices it at zero)."""
    if algorithm not in ALGORITHMS:
        raise ValueError(f"sim: unknown all-to-all algorithm {algorithm!r}; choose from {ALGORITHMS}")
    return np.where(a2a_crosses(traffic), _alltoall_time(traffic, cluster, algorithm), 0.0)


def _alltoall_time(traffic: np.ndarray, cluster, algorithm: str) -> np.ndarray:
    g, p, _ = traffic.shape
    n, l = _layout(p, cluster.ranks_per_node)
    t4 = traffic.reshape(g, n, l, n, l)                      # [g, src node, src local, dst node, dst local]
    eye_n = np.eye(n, dtype=bool)
    eye_l = np.eye(l, dtype=bool)
    li, le = cluster.intra_lat, cluster.inter_lat
    if algorithm in ("flat", "pipe") and not cluster.a2a_bw_table:
        return _flat_linear(t4, cluster, algorithm, n, l)
    # intra / inter bytes out of and into every rank (self excluded)
    same = eye_n[None, :, None, :, None] & ~(eye_n[:, None, :, None] & eye_l[None, :, None, :])[None]
    intra_t = np.where(same, t4, 0.0)
    inter_t = np.where(~eye_n[None, :, None, :, None], t4, 0.0)
    if algorithm in ("flat", "pipe"):
        # one message per peer; its rate may be capped by the calibrated bandwidth-by-size table
        ti = cluster.transfer_time(intra_t, True) * _pair_scale(cluster, l)[None, None, :, None, :]
        te = cluster.transfer_time(inter_t, False)
        both = intra_t + inter_t
        eff = cluster.volume_efficiency(np.maximum(both.sum(axis=(3, 4)), both.sum(axis=(1, 2))))
        t_intra = np.maximum(ti.sum(axis=(3, 4)), ti.sum(axis=(1, 2))) / eff + (l - 1) * li
        out_e, in_e = te.sum(axis=(3, 4)), te.sum(axis=(1, 2))
        if cluster.node_inter_bw:
            # the node's NICs are shared: a rank drives one NIC (inter_bw) and all ranks of a node
            # together at most node_inter_bw, so one hot receiver gets the whole NIC
            out_e = np.maximum(out_e, inter_t.sum(axis=(2, 3, 4))[:, :, None] / cluster.node_inter_bw)
            in_e = np.maximum(in_e, inter_t.sum(axis=(1, 2, 4))[:, :, None] / cluster.node_inter_bw)
        t_inter = np.maximum(out_e, in_e) / eff + (n - 1) * l * le
        t = t_intra + t_inter if algorithm == "flat" else np.maximum(t_intra, t_inter)
        return t.reshape(g, -1).max(axis=1)
    # phase 1: rank (a, l) sends to (a, l') everything whose destination local index is l' != l
    diff_l = ~eye_l[None, None, :, None, :]
    p1 = np.where(diff_l, t4, 0.0).sum(axis=3)               # [g, a, l(src), l'(dst local)]
    p1t = cluster.transfer_time(p1, True) * _pair_scale(cluster, l)[None, None]   # one message per local peer
    out1 = p1t.sum(axis=3)
    in1 = p1t.sum(axis=2)
    ph1 = (np.maximum(out1, in1) / cluster.volume_efficiency(np.maximum(p1.sum(axis=3), p1.sum(axis=2)))
           ).reshape(g, -1).max(axis=1) + (l - 1) * li
    # phase 2: rank (a, l) forwards node a's data for (b, l), b != a
    x = np.where(~eye_n[None, :, None, :, None], t4, 0.0).sum(axis=2)   # [g, a, b, l]
    xt = cluster.transfer_time(x, False)                     # node-aggregated messages
    out2 = xt.sum(axis=2)                                    # [g, a, l]
    in2 = xt.sum(axis=1)                                     # [g, b, l]
    if cluster.node_inter_bw:
        out2 = np.maximum(out2, x.sum(axis=(2, 3))[:, :, None] / cluster.node_inter_bw)
        in2 = np.maximum(in2, x.sum(axis=(1, 3))[:, :, None] / cluster.node_inter_bw)
    ph2 = (np.maximum(out2, in2) / cluster.volume_efficiency(np.maximum(x.sum(axis=2), x.sum(axis=1)))
           ).reshape(g, -1).max(axis=1) + (n - 1) * le
    if n == 1:
        ph2 = np.zeros(g)
    return ph1 + ph2
