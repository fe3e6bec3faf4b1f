"""The one MoE layer: megatron-core's ``MoELayer`` with an injected exchange and placement.

megatron-core's ``MoELayer.forward`` runs its stages in order: ``shared_experts_compute``,
``route``, ``preprocess``, ``dispatch``, ``routed_experts_compute``, ``combine``, ``postprocess``
(and megatron-core's overlapped 1F1B schedule, --overlap-moe-expert-parallel-comm, calls the same
stages one by one from models/gpt/fine_grained_callables.py). This subclass keeps that forward,
its router, experts, shared experts, recompute and state dict (checkpoints are megatron-core's),
and overrides the stages. It takes two things from the layer spec (``ModuleSpec.params`` / the
partial's keywords, set by :func:`use_layer`):

* ``exchange`` (megatron_moe.moe.dispatcher.ExchangeConfig, from the flags): the all-to-all
  algorithm and compression, the permute kernels, and the chunked overlap. The functions
  megatron-core's token dispatcher calls by name (permute, unpermute, sort_chunks_by_idxs,
  all_to_all) are this layer's own while one of its stages runs (compat/dispatch.py
  ``DispatcherScope``); with ``--moe-a2a-overlap-degree`` > 1 or ``--moe-a2a-schedule fastermoe``
  the dispatch -> experts -> combine middle is the chunked, overlapped pipeline
  (megatron_moe/moe/chunked.py ``ChunkedMiddle``);
* ``placement`` (megatron_moe.balance.layer.ReplicaPlacement with ``--moe-balance-policy`` or
  ``--moe-routing-trace-dir``): which rank computes which (token, expert) pair, replicas included;
  it attaches its per-layer runtime as ``layer.balance`` and is the layer's middle.

Every stage after routing runs under the layer's exchange and goes to the layer's middle: an
object with ``begin(layer)`` (before routing), ``preprocess``, ``dispatch``, ``compute``,
``combine`` and ``postprocess``, megatron-core's stage signatures with ``layer`` first.
:class:`CoreStages` (megatron-core's own stages) is the middle where neither above applies, and
the base the chunked middle changes three stages of.
"""

from __future__ import annotations

from megatron.core.transformer.moe.moe_layer import MoELayer as _CoreMoELayer
from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

from megatron_moe.compat.cuda_graph import captures_whole_iterations
from megatron_moe.compat.dispatch import DispatcherScope, drop_kept_graph, keep_counts_on_device
from megatron_moe.moe.dispatcher import ExchangeConfig, dispatcher_bindings

__all__ = ["CoreStages", "ExchangeConfig", "MoELayer", "use_layer"]


class CoreStages:
    """megatron-core's stages as a layer's middle."""

    def begin(self, layer):
        pass

    def preprocess(self, layer, hidden_states, probs, routing_map):
        return _CoreMoELayer.preprocess(layer, hidden_states, probs, routing_map)

    def dispatch(self, layer, hidden_states, probs):
        return _CoreMoELayer.dispatch(layer, hidden_states, probs)

    def compute(self, layer, hidden_states, probs):
        return _CoreMoELayer.routed_experts_compute(layer, hidden_states, probs)

    def combine(self, layer, output):
        return _CoreMoELayer.combine(layer, output)

    def postprocess(self, layer, output, shared_expert_output):
        return _CoreMoELayer.postprocess(layer, output, shared_expert_output)


class MoELayer(_CoreMoELayer):
    def __init__(self, config, submodules=None, layer_number=None, pg_collection=None,
                 exchange: ExchangeConfig = None, placement=None, **kw):
        # TransformerLayer passes no pg_collection to MoELayer subclasses (identity check in 0.16.1)
        pg_collection = pg_collection or get_default_pg_collection()
        super().__init__(config, submodules, layer_number, pg_collection, **kw)
        self.ep_group = pg_collection.ep
        self.exchange = exchange if exchange is not None else ExchangeConfig()
        self.exchange_scope = DispatcherScope(dispatcher_bindings(self.exchange,
                                                                  self._dropless_topk()))
        self.placement = placement
        self.balance = placement.attach(self, pg_collection) if placement is not None else None
        self.middle = self._choose_middle()
        self.counts_on_device = self._device_counts_suffice() and \
            keep_counts_on_device(self.token_dispatcher)
        # a full-iteration graph's capture must not reach a node of an earlier iteration (the
        # dispatcher keeps the last forward's probs, and with them its graph: compat/dispatch.py)
        self.drops_kept_graph = captures_whole_iterations(config)

    def _keeps_every_token(self) -> bool:
        """Every routed token kept: no capacity, no padding (to a capacity or for quantization),
        so the permuted row count is tokens x top-k, known on the host."""
        config = self.config
        return (config.moe_expert_capacity_factor is None
                and not getattr(self.token_dispatcher, "drop_and_pad", False)
                and not getattr(config, "moe_router_padding_for_quantization", False))

    def _dropless_topk(self) -> int:
        """The top-k when megatron-core's all-to-all dispatcher permutes every token to exactly
        top-k rows, else 0 (moe/dispatcher.py ``rows_gathered_permute``)."""
        from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

        dropless = (isinstance(self.token_dispatcher, MoEAlltoAllTokenDispatcher)
                    and self._keeps_every_token())
        return self.config.moe_router_topk if dropless else 0

    def _device_counts_suffice(self) -> bool:
        """Whether no stage of this layer needs the dispatcher's counts on the host: one rank
        (expert and tensor parallel size 1: no all-to-all splits), every routed token kept (no
        capacity, no padding: the permuted row count is known on the host), grouped experts
        (they take device counts), and no per-layer CUDA graph (megatron-core's capture of the
        dispatcher's preprocess moves its copy point). A full-iteration graph needs this most: a
        capture fails at megatron-core's wait for its host copy of the counts."""
        from megatron_moe.moe.grouped_experts import GroupedSequentialMLP

        td, config = self.token_dispatcher, self.config
        return (getattr(td, "ep_size", None) == 1 and getattr(td, "tp_size", None) == 1
                and self._keeps_every_token()
                and (getattr(config, "cuda_graph_impl", "none") == "none"
                     or captures_whole_iterations(config))
                and isinstance(self.experts, GroupedSequentialMLP))

    def _choose_middle(self):
        """The placement where it attached; else the chunked pipeline where it applies; else
        megatron-core's stages."""
        if self.balance is not None:
            return self.placement
        if self.exchange.chunked:
            from megatron_moe.moe.chunked import ChunkedMiddle

            if ChunkedMiddle.applies(self):
                return ChunkedMiddle()
        return CoreStages()

    # --- megatron-core's stages, overridden -------------------------------------------------------
    def route(self, hidden_states, padding_mask=None):
        self.middle.begin(self)
        return super().route(hidden_states, padding_mask)

    def preprocess(self, hidden_states, probs, routing_map):
        with self.exchange_scope:
            return self.middle.preprocess(self, hidden_states, probs, routing_map)

    def dispatch(self, hidden_states, probs):
        with self.exchange_scope:
            return self.middle.dispatch(self, hidden_states, probs)

    def routed_experts_compute(self, hidden_states, probs):
        with self.exchange_scope:
            return self.middle.compute(self, hidden_states, probs)

    def combine(self, output):
        with self.exchange_scope:
            return self.middle.combine(self, output)

    def postprocess(self, output, shared_expert_output):
        with self.exchange_scope:
            output = self.middle.postprocess(self, output, shared_expert_output)
        if self.drops_kept_graph:
            drop_kept_graph(self.token_dispatcher)
        return output


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
