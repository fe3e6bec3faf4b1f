"""Per-layer expert-load telemetry, recorded from the routers of a megatron-core model.

A forward hook on every router (any ``megatron.core.transformer.moe.router.Router`` subclass)
adds the layer's local tokens-per-expert to a buffer. ``collect()`` sums the buffers over all
ranks (each rank routes distinct tokens: DP replicas see other data and, with sequence
parallelism, TP ranks see other sequence shards) and returns the imbalance figures the training
log prints. Counts are summed over every micro-batch since the last ``collect()``.

When the EP group spans more than one node (``megatron_moe.runtime.topology``: ``--ranks-per-node``,
``--topology-file``), the hook also counts the token-expert assignments whose expert lives on
another node than the routing rank (expert e on EP rank e // (E / EP), node = EP rank // EP ranks
per node); ``collect()`` reports their share of all assignments as ``cross_node_fraction``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist


@dataclass
class LayerLoad:
    layer: int                       # global layer number (1-based, as megatron-core counts)
    tokens_per_expert: list[int]
    expert_max_over_mean: float      # 1.0 = perfectly balanced
    rank_max_over_mean: float        # the same over EP ranks (experts grouped by owner)
    cross_node_fraction: Optional[float] = None  # off-node assignments / all (None: one node)


class ExpertLoadTracker:
    """Records tokens per expert per MoE layer; call ``attach(model)`` once after building."""

    def __init__(self, num_layers: int, num_experts: int, ep_size: int, layout=None,
                 mtp_num_layers: int = 0):
        """``layout``: a ``megatron_moe.moe.topo_router.EPLayout``; default (None) reads this rank's
        EP group and the topology at ``attach()``. Multi-Token Prediction layers
        (``mtp_num_layers``) are recorded as layers ``num_layers + 1 ...``."""
        self.decoder_layers = num_layers
        num_layers += mtp_num_layers or 0
        self.num_layers = num_layers
        self.num_experts = num_experts
        self.ep_size = ep_size
        # [layers, experts] float64 sums on the routers' device, made by the first hook; read on
        # the host only by collect(), once per log line, never per step (docs/gpu.md, host syncs)
        self.counts = None
        # [off-node assignments, all assignments] per layer, summed like ``counts``
        self.cross = None
        self.layout = layout
        self._off_node = None  # [E] bool: expert on another node than this rank
        self.enabled = True  # off during evaluation
        self.listeners = []  # callables(layer_number, routing_map) for other consumers (balance stats)
        self._handles = []
        self._mtp_layer = {}  # id(router) -> layer number, for routers inside the MTP block

    def attach(self, model_chunks) -> int:
        """Hook every router in the model chunks; returns the number of hooked routers."""
        from megatron.core.transformer.moe.router import Router

        self._set_off_node()
        for chunk in model_chunks if isinstance(model_chunks, (list, tuple)) else [model_chunks]:
            for name, module in chunk.named_modules():
                if isinstance(module, Router):
                    if "mtp.layers." in name:
                        # MTP layers number their inner layer 1, 2, ... on megatron-core >= 0.17
                        index = int(name.split("mtp.layers.")[1].split(".")[0])
                        self._mtp_layer[id(module)] = self.decoder_layers + index + 1
                    self._handles.append(module.register_forward_hook(self._hook))
        return len(self._handles)

    def _hook(self, router, inputs, outputs):
        if not self.enabled:
            return
        routing_map = outputs[1]
        # set by megatron-core's TransformerLayer; MTP routers by attach()
        layer = self._mtp_layer.get(id(router)) or int(router.layer_number)
        flat = routing_map.detach().reshape(-1, routing_map.shape[-1])
        counts = flat.sum(dim=0)
        if self.counts is None:
            self.counts = counts.new_zeros(self.num_layers, self.num_experts, dtype=torch.float64)
            self.cross = counts.new_zeros(self.num_layers, 2, dtype=torch.float64)
        self.counts[layer - 1] += counts
        if self._off_node is not None:
            if self._off_node.device != flat.device:
                self._off_node = self._off_node.to(flat.device)
            off = (flat & self._off_node).sum()   # a mask product, not flat[:, mask]: no nonzero
            self.cross[layer - 1] += torch.stack([off, counts.sum()])
        for listener in self.listeners:
            listener(layer, routing_map)

    def _set_off_node(self):
        if self.layout is None:
            try:
                from megatron.core import parallel_state

                if not (dist.is_initialized() and parallel_state.model_parallel_is_initialized()):
                    return
                from megatron_moe.moe.topo_router import ep_layout

                self.layout = ep_layout(parallel_state.get_expert_model_parallel_group())
            except ValueError:
                return  # an EP group that is not node-major: no per-node figure
        if self.layout.nodes > 1:
            self._off_node = self.layout.expert_nodes(self.num_experts) != self.layout.my_node

    def collect(self, group=None) -> list[LayerLoad]:
        """Sum counts over ``group`` (default: world), reset them, and return per-layer loads.

        The cross-node figures are summed over the same ranks: the fraction is that of every
        routing rank's assignments leaving its own node (all EP groups together)."""
        if self.counts is None:   # no router ran here (a stage of dense layers): zeros to reduce
            counts = torch.zeros(self.num_layers, self.num_experts + 2, dtype=torch.float64)
        else:
            counts = torch.cat([self.counts, self.cross], dim=1)
            self.counts.zero_()
            self.cross.zero_()
        if dist.is_initialized():
            # on the data's device (NCCL needs device tensors); on a CPU build the shims answer cpu
            device = torch.cuda.current_device() if torch.cuda.is_available() else torch.device("cpu")
            counts = counts.to(device)
            dist.all_reduce(counts, group=group)
        rows = counts.tolist()   # the one device-to-host copy; integers, exact in float64
        E = self.num_experts
        loads = []
        for layer, row in enumerate(rows):
            row, (off, total) = row[:E], row[E:]
            if sum(row) == 0:
                continue  # a dense layer, or one on another pipeline stage that routed nothing
            per_rank = [sum(row[r * E // self.ep_size:(r + 1) * E // self.ep_size])
                        for r in range(self.ep_size)]
            loads.append(LayerLoad(
                layer=layer + 1,
                tokens_per_expert=[int(c) for c in row],
                expert_max_over_mean=max(row) / (sum(row) / E),
                rank_max_over_mean=max(per_rank) / (sum(per_rank) / self.ep_size),
                cross_node_fraction=(off / total
                                     if self._off_node is not None and total > 0 else None),
            ))
        return loads

    def detach(self):
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
