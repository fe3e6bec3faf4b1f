"""The one MoE layer: megatron-core's ``MoELayer`` with an injected exchange and placement.

megatron-core's ``MoELayer.forward`` runs route -> dispatch -> experts -> combine on its token
dispatcher. This subclass keeps its router, experts, shared experts and state dict (checkpoints are
megatron-core's) and takes two things from the layer spec (``ModuleSpec.params`` / the partial's
keywords, set by :func:`use_layer`):

* ``exchange`` (:class:`ExchangeConfig`, built by megatron_moe.moe.dispatcher from the flags): the
  all-to-all algorithm and compression, the permute kernels, and the chunked overlap
  (``--moe-a2a-overlap-degree`` / ``--moe-a2a-schedule fastermoe``: dispatch -> experts -> combine
  in overlapped chunks, megatron_moe/moe/chunked.py);
* ``placement`` (megatron_moe.balance.layer.ReplicaPlacement with ``--moe-balance-policy`` or
  ``--moe-routing-trace-dir``): which rank computes which (token, expert) pair, replicas included;
  it attaches its per-layer runtime as ``layer.balance`` and runs the dispatch / experts / combine
  middle of the layer itself.

With neither the layer is megatron-core's, stage for stage (``stock_forward``).
"""

from __future__ import annotations

import dataclasses

from megatron.core.transformer.moe.moe_layer import MoELayer as _CoreMoELayer
from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

__all__ = ["ExchangeConfig", "MoELayer", "use_layer"]


@dataclasses.dataclass(frozen=True)
class ExchangeConfig:
    """How an MoE layer exchanges tokens: one choice for every middle of the layer (megatron-core's
    dispatcher, the chunked pipeline, the replica dispatch)."""
    algorithm: str = "flat"
    compression: str = "none"
    permute_fusion: bool = False
    overlap_degree: int = 1
    schedule: str = "schemoe"

    @property
    def chunked(self) -> bool:
        return self.overlap_degree > 1 or self.schedule == "fastermoe"


class MoELayer(_CoreMoELayer):
    def __init__(self, config, submodules=None, layer_number=None, pg_collection=None,
                 exchange: ExchangeConfig = None, placement=None, **kw):
        # TransformerLayer passes no pg_collection to MoELayer subclasses (identity check in 0.16.1)
        pg_collection = pg_collection or get_default_pg_collection()
        super().__init__(config, submodules, layer_number, pg_collection, **kw)
        self.ep_group = pg_collection.ep
        self.exchange = exchange if exchange is not None else ExchangeConfig()
        self.placement = placement
        self.balance = placement.attach(self, pg_collection) if placement is not None else None

    def forward(self, hidden_states, intermediate_tensors=None, padding_mask=None):
        if self.placement is not None:
            return self.placement.forward(self, hidden_states, intermediate_tensors, padding_mask)
        if self.exchange.chunked:
            from megatron_moe.moe.chunked import chunked_forward

            return chunked_forward(self, hidden_states, intermediate_tensors, padding_mask)
        return self.stock_forward(hidden_states, intermediate_tensors, padding_mask)

    def stock_forward(self, hidden_states, intermediate_tensors=None, padding_mask=None):
        """megatron-core's own forward: route, dispatch, experts, combine on its token dispatcher."""
        return super().forward(hidden_states, intermediate_tensors, padding_mask)


def use_layer(spec, what: str, **params):
    """Every MoE layer of a block spec (or a layer spec) -> :class:`MoELayer` with ``params``
    merged into what earlier hooks gave it. ``what`` names the flag in the error raised when the
    class is some other MoELayer subclass (nothing here could inject into it)."""
    from megatron_moe.compat import replace_spec, spec_module

    for layer in getattr(spec, "layer_specs", None) or [spec]:
        mlp = getattr(getattr(layer, "submodules", None), "mlp", None)
        cls = spec_module(mlp)   # a ModuleSpec or (megatron-core >= 0.18) a partial
        if cls is _CoreMoELayer or cls is MoELayer:
            layer.submodules.mlp = replace_spec(mlp, module=MoELayer, **params)
        elif isinstance(cls, type) and issubclass(cls, _CoreMoELayer):
            raise ValueError(f"{what}: the MoE layer class is already customised "
                             f"({cls.__module__}.{cls.__name__}); cannot combine")
    return spec
