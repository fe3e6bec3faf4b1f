"""Topology-aware routing (``--moe-router-topology``): megatron-core's TopKRouter, told where experts live.

Three modes, each a ``TopKRouter`` subclass swapped into the MoE layer spec by
:func:`customize_spec` (its spec edit as a feature, megatron_moe/features.py). All keep top-k semantics: every
token gets exactly k distinct experts, and the probabilities of the chosen set are what
megatron-core's score function gives for it (``topk_routing_with_score_function``).

* ``node_limited`` (DeepSeek-V3 node-limited routing): a token's experts lie on at most
  ``--moe-router-max-nodes`` (M) nodes. This *is* megatron-core's group-limited top-k with
  ``moe_router_num_groups`` = nodes of the EP group and ``moe_router_group_topk`` = M.
* ``congestion`` (FasterMoE's congestion-avoiding gate): at most a fraction
  ``cap = W_inter / (R * W_intra)`` of this rank's token-expert assignments leave its node
  (R = ranks per node); the rest go to the best-scoring experts of the local node.
* ``ta_loss`` (TA-MoE style): routing is plain top-k, and an auxiliary loss
  ``coeff * mean_t sum_e p_te * c_e`` (c = link cost from this rank to expert e's rank) pushes
  probability toward cheap (local) experts; it is logged as ``topology_loss``.

Layout (megatron-core's): expert e lives on EP rank ``e // (E / ep_size)``; EP ranks are node-major,
``node = ep_rank // R`` with R the EP group's members per node under ``megatron_moe.runtime.topology``.
See docs/topology_routing.md for the formulas and the choices made.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
from typing import Optional

import torch
from megatron.core.transformer.moe.router import TopKRouter

from megatron_moe.compat import replace_spec, spec_submodules
from megatron_moe.runtime.topology import check_topology_flags

__all__ = ["EPLayout", "ep_layout", "customize_spec", "NodeLimitedRouter", "CongestionRouter",
           "TopologyLossRouter", "congestion_cap", "congestion_topk", "link_costs", "ROUTERS"]


@dataclasses.dataclass(frozen=True)
class EPLayout:
    """Where this rank and every expert sit: EP rank, EP size, EP members per node, bandwidths."""
    ep_rank: int = 0
    ep_size: int = 1
    ranks_per_node: int = 1          # EP-group members per node (node-major)
    node_ranks_per_node: int = 1     # physical ranks per node (share one NIC; FasterMoE's M)
    intra_bandwidth_gbps: float = 150.0
    inter_bandwidth_gbps: float = 25.0

    def __post_init__(self):
        if self.ep_size % self.ranks_per_node:
            raise ValueError(f"EP size {self.ep_size} is not a multiple of the {self.ranks_per_node} "
                             "EP ranks per node (--ranks-per-node / --topology-file)")

    @property
    def nodes(self) -> int:
        return self.ep_size // self.ranks_per_node

    @property
    def my_node(self) -> int:
        return self.ep_rank // self.ranks_per_node

    def expert_ranks(self, num_experts: int) -> torch.Tensor:
        if num_experts % self.ep_size:
            raise ValueError(f"--num-experts {num_experts} must be a multiple of the EP size "
                             f"{self.ep_size}")
        return torch.arange(num_experts) // (num_experts // self.ep_size)

    def expert_nodes(self, num_experts: int) -> torch.Tensor:
        """node of each expert, [E] int64."""
        return self.expert_ranks(num_experts) // self.ranks_per_node


def ep_layout(ep_group=None, topo=None) -> EPLayout:
    """The layout of ``ep_group`` (default: megatron-core's EP group) under the process topology."""
    import torch.distributed as dist

    from megatron_moe.runtime import topology

    topo = topo or topology.current()
    if not dist.is_initialized():
        return EPLayout(node_ranks_per_node=topo.ranks_per_node,
                        intra_bandwidth_gbps=topo.intra_bandwidth_gbps,
                        inter_bandwidth_gbps=topo.inter_bandwidth_gbps)
    if ep_group is None:
        from megatron.core import parallel_state

        ep_group = parallel_state.get_expert_model_parallel_group()
    ranks = dist.get_process_group_ranks(ep_group)
    try:
        rpn = topology.members_per_node(ranks, topo)
    except ValueError as e:
        raise ValueError(f"--moe-router-topology / expert-load telemetry: {e}") from None
    return EPLayout(ep_rank=ranks.index(dist.get_rank()), ep_size=len(ranks), ranks_per_node=rpn,
                    node_ranks_per_node=topo.ranks_per_node,
                    intra_bandwidth_gbps=topo.intra_bandwidth_gbps,
                    inter_bandwidth_gbps=topo.inter_bandwidth_gbps)


# ---------------------------------------------------------------------------------------------
# pure functions (unit-tested directly)


def congestion_cap(layout: EPLayout) -> float:
    """FasterMoE's outgoing fraction W_net / (M * W_local), M = ranks sharing a node's NIC."""
    return min(1.0, layout.inter_bandwidth_gbps
               / (layout.node_ranks_per_node * layout.intra_bandwidth_gbps))


def congestion_topk(scores: torch.Tensor, top_indices: torch.Tensor, expert_node: torch.Tensor,
                    my_node: int, cap: float, priority: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Re-route plain top-k choices so at most ``floor(cap * T * k)`` assignments leave the node.

    ``scores`` [T, E] are the selection scores megatron-core's top-k ran on, ``top_indices`` [T, k]
    its choice; ``priority`` [T, E] (default ``scores``) ranks assignments *across* tokens, so it
    must be comparable between tokens (gate probabilities, not raw logits). When the off-node
    assignments fit under the cap the choice is returned unchanged. Otherwise the off-node
    assignments of highest priority are kept (ties: lower token, then lower slot first, so it is
    deterministic) and every token fills its remaining slots with its best-scoring local-node
    experts; that stays k distinct experts since all originally chosen local experts outrank every
    unchosen one. Needs k <= experts per node.
    """
    tokens, k = top_indices.shape
    remote = expert_node[top_indices] != my_node                        # [T, k]
    allowed = math.floor(cap * tokens * k)
    if allowed >= tokens * k:
        return top_indices
    chosen = (scores if priority is None else priority).gather(1, top_indices)
    ranked = chosen.masked_fill(~remote, float("-inf")).flatten()
    order = torch.sort(ranked, descending=True, stable=True).indices[:allowed]
    keep = torch.zeros(tokens * k, dtype=torch.bool, device=scores.device)
    keep[order] = True
    keep = keep.view(tokens, k) & remote
    need = k - keep.sum(dim=1, keepdim=True)                             # local slots per token
    is_local = (expert_node == my_node).to(scores.device)
    local_order = torch.sort(scores.masked_fill(~is_local, float("-inf")), dim=1,
                             descending=True, stable=True).indices[:, :k]
    take_local = torch.arange(k, device=scores.device).unsqueeze(0) < need
    # k slots: the kept remote experts, then the best local ones; rows hold exactly k
    slots = torch.cat([top_indices.masked_fill(~keep, -1), local_order.masked_fill(~take_local, -1)],
                      dim=1)
    valid = slots >= 0
    # stable sort puts the k valid entries first, in slot order
    pick = torch.sort((~valid).to(torch.int8), dim=1, stable=True).indices[:, :k]
    # under the cap the plain choice stands; chosen on the device (asking the host whether the
    # cap binds would be a sync per layer and micro-batch)
    return torch.where(remote.sum() <= allowed, top_indices, slots.gather(1, pick))


def link_costs(layout: EPLayout, num_experts: int) -> torch.Tensor:
    """Per-expert link cost from this rank, inter-node = 1: 0 on this rank, W_inter/W_intra on
    another rank of the node (cost ~ seconds per byte = 1 / bandwidth)."""
    ranks = layout.expert_ranks(num_experts)
    same_node = ranks // layout.ranks_per_node == layout.my_node
    cost = torch.ones(num_experts, dtype=torch.float32)
    cost[same_node] = layout.inter_bandwidth_gbps / layout.intra_bandwidth_gbps
    cost[ranks == layout.ep_rank] = 0.0
    return cost


# ---------------------------------------------------------------------------------------------
# routers

_SAID_ONE_NODE = False


def _say_once_one_node(layout: EPLayout, mode: str):
    global _SAID_ONE_NODE
    import torch.distributed as dist

    if _SAID_ONE_NODE:
        return
    _SAID_ONE_NODE = True
    if not dist.is_initialized() or dist.get_rank() == 0:
        extra = " and no topology loss is added" if mode == "ta_loss" else ""
        print(f" [moe] --moe-router-topology {mode}: the EP group ({layout.ep_size} ranks, "
              f"{layout.ranks_per_node} per node) spans one node; routing is plain top-k{extra}",
              flush=True)


def _layout_for(pg_collection, layout):
    if layout is not None:
        return layout
    return ep_layout(getattr(pg_collection, "ep", None))


class NodeLimitedRouter(TopKRouter):
    """Group-limited top-k (megatron-core) with groups = nodes of the EP group, M per token."""

    mode = "node_limited"

    def __init__(self, config, pg_collection=None, *, max_nodes: int = 1,
                 layout: Optional[EPLayout] = None, **router_kwargs):
        layout = _layout_for(pg_collection, layout)
        nodes = layout.nodes
        if max_nodes < 1 or max_nodes > nodes:
            raise ValueError(f"--moe-router-max-nodes={max_nodes} must be in [1, {nodes}] (the "
                             f"EP group of {layout.ep_size} ranks spans {nodes} node(s))")
        experts_per_node = config.num_moe_experts // nodes
        if config.moe_router_topk > max_nodes * experts_per_node:
            raise ValueError(f"--moe-router-topk {config.moe_router_topk} exceeds "
                             f"--moe-router-max-nodes={max_nodes} x {experts_per_node} experts "
                             "per node: a token could not get k distinct experts")
        check_topology_flags(self.mode, num_groups=config.moe_router_num_groups,
                             group_topk=config.moe_router_group_topk)
        # k experts span at most k nodes: with k <= M (or M = all nodes) the limit never binds,
        # and group_limited_topk's top-(k // M) group score would be degenerate for k < M
        if nodes > 1 and config.moe_router_topk > max_nodes and max_nodes < nodes:
            config = copy.copy(config)  # the router's own view; the model config is shared
            config.moe_router_num_groups = nodes
            config.moe_router_group_topk = max_nodes
        elif nodes == 1:
            _say_once_one_node(layout, self.mode)
        # router_kwargs: whatever else megatron-core passes (0.17+: is_mtp_layer), docs/compat.md
        super().__init__(config=config, pg_collection=pg_collection, **router_kwargs)
        self.layout = layout
        self.max_nodes = max_nodes


class CongestionRouter(TopKRouter):
    """FasterMoE's congestion-avoiding gate on megatron-core's top-k and score function."""

    mode = "congestion"

    def __init__(self, config, pg_collection=None, *, layout: Optional[EPLayout] = None,
                 cap: Optional[float] = None, **router_kwargs):
        layout = _layout_for(pg_collection, layout)
        if config.moe_enable_routing_replay:
            raise ValueError("--moe-router-topology congestion cannot be combined with routing "
                             "replay (it selects the experts through the same hook)")
        check_topology_flags(self.mode, fusion=config.moe_router_fusion)
        experts_per_node = config.num_moe_experts // layout.nodes
        if layout.nodes > 1 and config.moe_router_topk > experts_per_node:
            raise ValueError(f"--moe-router-topology congestion: --moe-router-topk "
                             f"{config.moe_router_topk} exceeds the {experts_per_node} experts "
                             "per node a re-routed token can fall back to")
        # router_kwargs: whatever else megatron-core passes (0.17+: is_mtp_layer), docs/compat.md
        super().__init__(config=config, pg_collection=pg_collection, **router_kwargs)
        self.layout = layout
        self.cap = congestion_cap(layout) if cap is None else float(cap)
        self.register_buffer("expert_node", layout.expert_nodes(config.num_moe_experts),
                             persistent=False)
        if layout.nodes > 1:
            # topk_routing_with_score_function asks this object for the top-k indices, on the
            # very scores it selects on (logits, softmax or biased sigmoid), and derives the
            # probabilities of whatever set comes back exactly as for its own choice
            self.router_replay = _CongestionSelector(self)
        else:
            _say_once_one_node(layout, self.mode)


class TopologyLossRouter(TopKRouter):
    """Plain top-k routing plus the link-cost weighted auxiliary loss ``topology_loss``."""

    mode = "ta_loss"
    loss_name = "topology_loss"

    def __init__(self, config, pg_collection=None, *, coeff: float = 1e-2,
                 layout: Optional[EPLayout] = None, **router_kwargs):
        layout = _layout_for(pg_collection, layout)
        check_topology_flags(self.mode, loss_coeff=coeff)
        # router_kwargs: whatever else megatron-core passes (0.17+: is_mtp_layer), docs/compat.md
        super().__init__(config=config, pg_collection=pg_collection, **router_kwargs)
        self.layout = layout
        self.coeff = float(coeff)
        self.register_buffer("link_cost", link_costs(layout, config.num_moe_experts),
                             persistent=False)
        if layout.nodes == 1:
            # no inter-node link to spare: like the other modes this is plain top-k (a pull toward
            # this rank's own experts would only fight the load-balancing loss)
            self.coeff = 0.0
            _say_once_one_node(layout, self.mode)

    def routing(self, logits, padding_mask=None):
        probs, routing_map = super().routing(logits, padding_mask=padding_mask)
        if self.coeff > 0 and self.training and torch.is_grad_enabled():
            probs = self._apply_topology_loss(probs, logits, padding_mask)
        return probs, routing_map

    def _apply_topology_loss(self, probs, logits, padding_mask):
        import torch.distributed as dist
        from megatron.core.transformer.moe.moe_utils import compute_routing_scores_for_aux_loss

        logits = logits.view(-1, self.config.num_moe_experts)
        if padding_mask is not None:
            padding_mask = padding_mask.reshape(-1)
        # the same full-distribution scores megatron-core's load-balancing loss uses (padded
        # tokens zeroed)
        _, scores = compute_routing_scores_for_aux_loss(
            logits, self.topk, self.score_function, fused=self.config.moe_router_fusion,
            padding_mask=padding_mask)
        # token counts as megatron-core's get_tokens_per_expert_and_token_count: the loss is a
        # share of the tp_cp group's tokens, and the logged values are summed over that group
        group_size = self.tp_cp_group.size()
        if padding_mask is None:
            local_tokens = scores.shape[0]
            total_tokens = local_tokens * group_size
        else:
            local_tokens = (~padding_mask).sum().to(scores.dtype)
            total_tokens = local_tokens.clone()
            if group_size > 1:
                dist.all_reduce(total_tokens, group=self.tp_cp_group)
            total_tokens = total_tokens.clamp(min=1)
        cost = self.link_cost.to(device=scores.device, dtype=scores.dtype)
        loss = self.coeff * (scores * cost).sum() / total_tokens
        return self.attach_and_log_load_balancing_loss(
            probs, self.coeff, loss, self.loss_name, self.tp_cp_group,
            valid_token_count=local_tokens)


class _CongestionSelector:
    """Stands in for megatron-core's RouterReplay: top-k, then the congestion cap."""

    def __init__(self, router):
        self._router = router

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None,
                        default_compute_topk=None):
        r = self._router
        _, top_indices = default_compute_topk(scores, topk, num_groups=num_groups,
                                              group_topk=group_topk)
        with torch.no_grad():
            sel = scores.detach()
            # raw logits (softmax after top-k) are not comparable across tokens: rank the
            # off-node assignments by the full softmax, the gate probability FasterMoE ranks by
            priority = None
            if r.score_function == "softmax" and not r.config.moe_router_pre_softmax:
                priority = torch.softmax(sel, dim=-1, dtype=torch.float32)
            top_indices = congestion_topk(sel, top_indices, r.expert_node.to(sel.device),
                                          r.layout.my_node, r.cap, priority=priority)
        return scores.gather(1, top_indices), top_indices


ROUTERS = {"node_limited": NodeLimitedRouter, "congestion": CongestionRouter,
           "ta_loss": TopologyLossRouter}


def router_builder(args):
    """``RouterBuilder`` (callable(config=, pg_collection=)) for ``--moe-router-topology``."""
    mode = getattr(args, "moe_router_topology", "none") or "none"
    if mode == "none":
        return None
    if mode not in ROUTERS:
        raise ValueError(f"--moe-router-topology {mode}: choose one of none, {', '.join(ROUTERS)}")
    if mode == "node_limited":
        return functools.partial(NodeLimitedRouter, max_nodes=int(args.moe_router_max_nodes))
    if mode == "ta_loss":
        return functools.partial(TopologyLossRouter, coeff=float(args.moe_topology_loss_coeff))
    return functools.partial(CongestionRouter)


def customize_spec(args, spec):
    """model.gpt_layer_spec hook: swap megatron-core's TopKRouter for the topology-aware one."""
    if not getattr(args, "num_experts", None):
        return spec
    builder = router_builder(args)
    if builder is None:
        return spec
    ours = tuple(ROUTERS.values())
    for layer in getattr(spec, "layer_specs", None) or [spec]:
        mlp = getattr(getattr(layer, "submodules", None), "mlp", None)
        sub = spec_submodules(mlp)  # a ModuleSpec or (megatron-core >= 0.18) a partial
        if sub is None or not hasattr(sub, "router"):
            continue  # a dense layer
        current = sub.router
        cls = current.func if isinstance(current, functools.partial) else current
        if cls is not TopKRouter and not (isinstance(cls, type) and issubclass(cls, ours)):
            raise ValueError(f"--moe-router-topology {args.moe_router_topology}: the router is already "
                             f"customised ({getattr(cls, '__qualname__', cls)}); cannot combine")
        # a fresh submodules object: spec objects may be shared between layers and builds
        layer.submodules.mlp = replace_spec(mlp, submodules=dataclasses.replace(sub, router=builder))
    return spec
