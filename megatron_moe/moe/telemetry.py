"""Per-layer expert-load telemetry, recorded from the routers of a megatron-core model.

A forward hook on every router (any ``megatron.core.transformer.moe.router.Router`` subclass)
adds the layer's local tokens-per-expert to a buffer. ``collect()`` sums the buffers over all
ranks (each rank routes distinct tokens: DP replicas see other data and, with sequence
parallelism, TP ranks see other sequence shards) and returns the imbalance figures the training
log prints. Counts are summed over every micro-batch since the last ``collect()``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class LayerLoad:
    layer: int                       # global layer number (1-based, as megatron-core counts)
    tokens_per_expert: list[int]
    expert_max_over_mean: float      # 1.0 = perfectly balanced
    rank_max_over_mean: float        # the same over EP ranks (experts grouped by owner)


class ExpertLoadTracker:
    """Records tokens per expert per MoE layer; call ``attach(model)`` once after building."""

    def __init__(self, num_layers: int, num_experts: int, ep_size: int):
        self.num_layers = num_layers
        self.num_experts = num_experts
        self.ep_size = ep_size
        self.counts = torch.zeros(num_layers, num_experts, dtype=torch.float64)
        self.enabled = True  # off during evaluation
        self.listeners = []  # callables(layer_number, routing_map) for other consumers (balance stats)
        self._handles = []

    def attach(self, model_chunks) -> int:
        """Hook every router in the model chunks; returns the number of hooked routers."""
        from megatron.core.transformer.moe.router import Router

        for chunk in model_chunks if isinstance(model_chunks, (list, tuple)) else [model_chunks]:
            for module in chunk.modules():
                if isinstance(module, Router):
                    self._handles.append(module.register_forward_hook(self._hook))
        return len(self._handles)

    def _hook(self, router, inputs, outputs):
        if not self.enabled:
            return
        routing_map = outputs[1]
        layer = int(router.layer_number)  # set by megatron-core's TransformerLayer
        counts = routing_map.detach().reshape(-1, routing_map.shape[-1]).sum(dim=0)
        self.counts[layer - 1] += counts.to(device="cpu", dtype=torch.float64)
        for listener in self.listeners:
            listener(layer, routing_map)

    def collect(self, group=None) -> list[LayerLoad]:
        """Sum counts over ``group`` (default: world), reset them, and return per-layer loads."""
        counts = self.counts.clone()
        self.counts.zero_()
        if dist.is_initialized():
            device = "cuda" if torch.cuda.is_available() and dist.get_backend(group) == "nccl" else "cpu"
            counts = counts.to(device)
            dist.all_reduce(counts, group=group)
            counts = counts.cpu()
        loads = []
        for layer in range(self.num_layers):
            row = counts[layer]
            if row.sum() == 0:
                continue  # a dense layer, or one on another pipeline stage that routed nothing
            per_rank = row.view(self.ep_size, -1).sum(dim=1)
            loads.append(LayerLoad(
                layer=layer + 1,
                tokens_per_expert=[int(c) for c in row.tolist()],
                expert_max_over_mean=float(row.max() / row.mean()),
                rank_max_over_mean=float(per_rank.max() / per_rank.mean()),
            ))
        return loads

    def detach(self):
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
