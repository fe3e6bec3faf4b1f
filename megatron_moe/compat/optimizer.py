"""megatron-core's emerging optimizers (Muon): which releases have them, and the config fields.

megatron-core 0.19 builds Muon itself (``get_megatron_optimizer`` with ``optimizer='muon'``, its
``muon_*`` OptimizerConfig fields, the ``emerging-optimizers`` package for the Newton-Schulz step);
megatron-core 0.16.1 has no Muon, so ``--optimizer muon`` is refused there at parse time.
"""

from __future__ import annotations

MUON_RELEASE = "0.19"

# Megatron-LM's --muon-* dests, each the OptimizerConfig field of the same name (megatron-core 0.19)
MUON_FIELDS = ("muon_momentum", "muon_split_qkv", "muon_nesterov", "muon_scale_mode",
               "muon_fp32_matmul_prec", "muon_coefficient_type", "muon_num_ns_steps",
               "muon_tp_mode", "muon_extra_scale_factor", "muon_scalar_optimizer")


def check_muon_available(optimizer: str) -> None:
    """ValueError with one line when this install cannot build megatron-core's Muon."""
    from megatron_moe.compat.versions import distribution_version, mcore_at_least

    if not mcore_at_least(MUON_RELEASE):
        raise ValueError(f"--optimizer {optimizer} needs megatron-core >= {MUON_RELEASE} "
                         f"(installed: {distribution_version()}, which has no Muon)")
    try:
        import emerging_optimizers  # noqa: F401
    except ImportError:
        raise ValueError(f"--optimizer {optimizer} needs the emerging-optimizers package "
                         f"(megatron-core's Muon: pip install emerging-optimizers)") from None


def emerging_optimizer_kwargs(args) -> dict:
    """OptimizerConfig fields for ``--optimizer muon`` as Megatron-LM's get_megatron_optimizer_config
    sets them (the --muon-* flags by dest; the layer-wise distributed optimizer that validate_args
    chose). Empty for Adam/SGD, so megatron-core 0.16.1's OptimizerConfig never sees them."""
    if args.optimizer != "muon":
        return {}
    kwargs = {name: getattr(args, name) for name in MUON_FIELDS}
    kwargs["use_layer_wise_distributed_optimizer"] = args.use_layer_wise_distributed_optimizer
    return kwargs
