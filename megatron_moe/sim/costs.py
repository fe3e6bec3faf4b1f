"""The pricing object the FasterMoE / FlexMoE policies consume.

Policies never read raw constants: they call these methods, so the same policy code runs inside
training (built from the calibration profile) and inside the simulator (built from a ``Cluster``).
All times are seconds; "input" = one (token, expert) pair of ``bytes_per_input`` bytes.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import numpy as np

__all__ = ["PlannerCost"]


@dataclasses.dataclass
class PlannerCost:
    fwd_s_per_input: float              # forward expert compute per input (backward = 2x)
    a2a_s_per_input: float             # one all-to-all round per received input at the average bandwidth
    param_collective_s: float          # one broadcast (or reduce) of one expert's parameters over the group
    pair_s_per_input: Optional[np.ndarray] = None   # [P, P] per-input seconds src -> dst (0 diagonal)
    grad_bytes: float = 0.0
    state_bytes: float = 0.0
    link_s_per_byte: Optional[np.ndarray] = None     # [P, P]
    node: Optional[np.ndarray] = None                # [P] node id of each group rank
    intra_bw: float = float("inf")
    inter_bw: float = float("inf")
    lat: float = 0.0

    @classmethod
    def from_cluster(cls, cl, ranks: np.ndarray) -> "PlannerCost":
        ranks = np.asarray(ranks)
        link = cl.link_seconds_per_byte(ranks)
        bw = cl.bottleneck_bw(ranks)
        a2a = cl.bytes_per_input / bw if np.isfinite(bw) else 0.0
        return cls(fwd_s_per_input=1.0 / cl.expert_tokens_per_s, a2a_s_per_input=a2a,
                   param_collective_s=cl.broadcast_time(cl.expert_param_bytes, ranks),
                   pair_s_per_input=link * cl.bytes_per_input, grad_bytes=cl.expert_param_bytes,
                   state_bytes=cl.expert_state_bytes, link_s_per_byte=link,
                   node=cl.node_of(ranks), intra_bw=cl.intra_bw, inter_bw=cl.inter_bw,
                   lat=cl.max_lat(ranks))

    @classmethod
    def from_paper(cls, hidden: int, alpha: float, flops: float, net_elems_per_s: float,
                   num_ranks: int) -> "PlannerCost":
        """FasterMoE's simplified constants (note 2.5): H, alpha = ffn/H, P, W_net in elements/s."""
        fwd = 4.0 * alpha * hidden * hidden / flops
        a2a = hidden / net_elems_per_s
        param = 2.0 * alpha * hidden * hidden / net_elems_per_s
        pair = np.full((num_ranks, num_ranks), a2a)
        np.fill_diagonal(pair, 0.0)
        return cls(fwd_s_per_input=fwd, a2a_s_per_input=a2a, param_collective_s=param,
                   pair_s_per_input=pair)

    @property
    def num_ranks(self) -> int:
        return 0 if self.pair_s_per_input is None else self.pair_s_per_input.shape[0]

    def compute_s(self, inputs) -> np.ndarray:
        """Forward + backward expert compute (3 GEMM rounds) for ``inputs`` per rank."""
        return 3.0 * self.fwd_s_per_input * np.asarray(inputs, dtype=np.float64)

    def sync_s(self, ranks: Sequence[int]) -> float:
        """Ring all-reduce of one expert's gradients over ``ranks`` (group-local indices)."""
        k = len(ranks)
        if k <= 1 or self.grad_bytes <= 0:
            return 0.0
        nodes = self.node[np.asarray(ranks)] if self.node is not None else np.zeros(1)
        bw = self.intra_bw if len(np.unique(nodes)) == 1 else self.inter_bw
        return 2.0 * (k - 1) / k * self.grad_bytes / bw + 2 * (k - 1) * self.lat

    def state_move_s(self, a: int, b: int) -> float:
        if a == b or self.link_s_per_byte is None:
            return 0.0
        return self.state_bytes * float(self.link_s_per_byte[a, b]) + self.lat


def sync_s_vec(cost: PlannerCost, hosts: np.ndarray) -> np.ndarray:
    """Vectorised :meth:`PlannerCost.sync_s` for a boolean host matrix ``hosts[E, P]``."""
    k = hosts.sum(axis=1).astype(np.float64)
    out = np.zeros(hosts.shape[0])
    if cost.grad_bytes <= 0:
        return out
    if cost.node is not None:
        onehot = getattr(cost, "_node_onehot", None)
        if onehot is None:
            nodes = np.unique(cost.node)
            onehot = (cost.node[:, None] == nodes[None, :]).astype(np.float64)   # [P, nodes]
            cost._node_onehot = onehot
        spans = (hosts.astype(np.float64) @ onehot > 0).sum(axis=1)
    else:
        spans = np.ones(hosts.shape[0])
    bw = np.where(spans > 1, cost.inter_bw, cost.intra_bw)
    m = k > 1
    out[m] = 2.0 * (k[m] - 1) / k[m] * cost.grad_bytes / bw[m] + 2 * (k[m] - 1) * cost.lat
    return out


def planner_cost_from_cost_model(cm, num_ranks: int) -> PlannerCost:
    """PlannerCost priced by the balance engineer's ``CostModel`` (the one training uses):
    forward compute 1/t, all-to-all via ``cm.t_a2a`` (bandwidth by message size), one expert's
    parameter broadcast = ``cm.t_trans(1, 0, D)`` (and the gradient reduce = ``cm.t_agg``)."""
    big = cm.bandwidth(float("inf"))
    pair = np.full((num_ranks, num_ranks), cm.input_bytes / big)
    np.fill_diagonal(pair, 0.0)
    pc = PlannerCost(fwd_s_per_input=1.0 / cm.throughput, a2a_s_per_input=cm.input_bytes / big,
                     param_collective_s=cm.t_trans(1, 0, num_ranks), pair_s_per_input=pair,
                     grad_bytes=float(cm.expert_bytes), state_bytes=4.0 * float(cm.expert_bytes),
                     link_s_per_byte=pair / cm.input_bytes, node=np.zeros(num_ranks, dtype=np.int64),
                     intra_bw=cm._trans_bw() if hasattr(cm, "_trans_bw") else big,
                     inter_bw=cm._trans_bw() if hasattr(cm, "_trans_bw") else big)
    pc.cost_model = cm
    return pc


def as_planner_cost(cost, num_ranks: int) -> PlannerCost:
    """Accept a PlannerCost, a balance ``CostModel`` or None (the CostModel's documented defaults)."""
    if isinstance(cost, PlannerCost):
        return cost
    if cost is None:
        from megatron_moe.balance.cost_model import CostModel
        cost = CostModel.from_profile(None)
    return planner_cost_from_cost_model(cost, num_ranks)


def a2a_s(cost, inputs: float) -> float:
    """One all-to-all round for a rank receiving ``inputs`` inputs (the CostModel's Eq. 1 when the
    PlannerCost was built from it, else the linear per-input rate)."""
    cm = getattr(cost, "cost_model", None)
    if cm is not None:
        return cm.t_a2a(np.array([inputs]))
    return cost.a2a_s_per_input * inputs
