"""Token dispatch on megatron-core's dispatchers, with our fused permute kernels and all-to-all.

megatron-core's ``MoEAlltoAllTokenDispatcher`` / ``MoEAllGatherTokenDispatcher`` call three
functions by module-level name: ``permute``, ``unpermute`` (moe_utils) and ``all_to_all``
(tensor_parallel). Their call sites (splits bookkeeping, capacity, TP/EP grouping) stay
megatron-core's; this module rebinds those names inside ``token_dispatcher`` to:

* ``kernels.permute`` / ``kernels.unpermute`` with ``--moe-permute-fusion`` (Triton on GPU, a fused
  index path on CPU; bit-identical to megatron-core's unfused path, see tests/test_dispatcher.py),
* ``megatron_moe.comm.all_to_all`` with ``--moe-a2a-algorithm`` other than ``flat``, with
  ``--moe-a2a-compression`` (hierarchical / pipe all-to-all, compression), or with
  ``--moe-ep-link-gbps`` (the emulated link, comm/link.py, must see megatron-core's exchanges too).

The same choice (:func:`exchange_config`, :func:`permute_fns`) is read by the layers that exchange
tokens themselves: ``ChunkedMoELayer`` and the balanced layer (``--moe-balance-policy``), so the
three flags apply under every policy.

With ``--moe-a2a-overlap-degree`` > 1 (or ``--moe-a2a-schedule fastermoe``) the MoE layer class in
the spec becomes ``megatron_moe.moe.chunked.ChunkedMoELayer`` (chunked, overlapped dispatch ->
experts -> combine on the same algorithm and compression).

megatron-core's own ``--moe-permute-fusion`` needs Transformer Engine; ours is a different
implementation behind the same flag, so megatron-core's config flag stays False.
The choice is process-wide (one model per process), made once from the parsed args.
"""

from __future__ import annotations

import dataclasses
import functools

_ORIGINAL = {}


@dataclasses.dataclass(frozen=True)
class ExchangeConfig:
    """The process-wide all-to-all choice, read by every MoE layer that exchanges tokens itself
    (the chunked layer, the balanced layer): one exchange path for all of them."""
    algorithm: str = "flat"
    compression: str = "none"
    permute_fusion: bool = False


_EXCHANGE = ExchangeConfig()


def exchange_config() -> ExchangeConfig:
    return _EXCHANGE


def permute_fns():
    """The (permute, unpermute) pair the token dispatchers use now: megatron-core's, or
    kernels.permute / kernels.unpermute with ``--moe-permute-fusion`` (looked up at call time)."""
    from megatron_moe.compat.dispatch import permute_v016

    td = _token_dispatcher_module()
    return permute_v016(td.permute), td.unpermute  # megatron-core 0.16's call contract, any version


def add_arguments(parser):
    group = parser.add_argument_group("moe dispatch")
    group.add_argument("--moe-permute-fusion", action="store_true",
                       help="Fused permute / unpermute+combine kernels (kernels/).")
    return parser


def validate_args(args):
    from megatron_moe.moe.chunked import validate_args as chunked_validate_args

    chunked_validate_args(args)


def _token_dispatcher_module():
    from megatron.core.transformer.moe import token_dispatcher

    return token_dispatcher


def _fused_permute(*args, fused=False, **kwargs):
    import kernels

    return kernels.permute(*args, **kwargs)


def _fused_unpermute(*args, fused=False, **kwargs):
    import kernels

    return kernels.unpermute(*args, **kwargs)


def _pluggable_all_to_all(group, input_, output_split_sizes=None, input_split_sizes=None, *,
                          algorithm, compression, ranks_per_node):
    from megatron_moe import comm

    return comm.all_to_all(input_, output_split_sizes, input_split_sizes, group,
                           algorithm=algorithm, ranks_per_node=ranks_per_node,
                           compression=compression)


def _rebind(name, value):
    td = _token_dispatcher_module()
    _ORIGINAL.setdefault(name, getattr(td, name))
    setattr(td, name, value)


def restore_defaults():
    """Undo every rebinding (tests build several models in one process)."""
    global _EXCHANGE
    _EXCHANGE = ExchangeConfig()
    td = _token_dispatcher_module()
    for name, value in _ORIGINAL.items():
        setattr(td, name, value)
    _ORIGINAL.clear()


def customize_spec(args, spec):
    """Called by model.gpt_layer_spec: choose the permute and all-to-all implementations."""
    restore_defaults()
    if not getattr(args, "num_experts", None):
        return spec
    from megatron_moe.compat.dispatch import adapt_all_to_all, adapt_permute, adapt_unpermute

    if getattr(args, "moe_permute_fusion", False):  # call contracts per megatron-core version
        _rebind("permute", adapt_permute(_fused_permute))
        _rebind("unpermute", adapt_unpermute(_fused_unpermute))
    algorithm = getattr(args, "moe_a2a_algorithm", "flat") or "flat"
    compression = getattr(args, "moe_a2a_compression", "none") or "none"
    global _EXCHANGE
    _EXCHANGE = ExchangeConfig(algorithm, compression, bool(getattr(args, "moe_permute_fusion", False)))
    if algorithm != "flat" or compression != "none" or getattr(args, "moe_ep_link_gbps", None) is not None:
        _rebind("all_to_all", adapt_all_to_all(functools.partial(
            _pluggable_all_to_all, algorithm=algorithm, compression=compression,
            ranks_per_node=None)))  # derived per EP group from the topology
    if getattr(args, "moe_a2a_overlap_degree", 1) > 1 or \
            getattr(args, "moe_a2a_schedule", "schemoe") == "fastermoe":
        spec = _use_chunked_layer(args, spec)
    return spec


def _use_chunked_layer(args, spec):
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from megatron_moe.moe.chunked import ChunkedMoELayer

    ChunkedMoELayer.overlap_degree = int(args.moe_a2a_overlap_degree)
    ChunkedMoELayer.schedule = getattr(args, "moe_a2a_schedule", "schemoe")
    ChunkedMoELayer.algorithm = getattr(args, "moe_a2a_algorithm", "flat")
    ChunkedMoELayer.compression = getattr(args, "moe_a2a_compression", "none")
    from megatron_moe.compat import replace_spec, spec_module

    for layer in getattr(spec, "layer_specs", None) or [spec]:
        mlp = getattr(getattr(layer, "submodules", None), "mlp", None)
        if spec_module(mlp) is MoELayer:  # a ModuleSpec or (megatron-core >= 0.18) a partial
            layer.submodules.mlp = replace_spec(mlp, module=ChunkedMoELayer)
    return spec
