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


def torch_adams(megatron_optimizer) -> list:
    """The torch.optim.Adam / AdamW instances inside megatron-core's optimizer (its fallback without
    Transformer Engine or apex), through ChainedOptimizer and the mixed-precision wrappers."""
    import torch

    out, todo = [], [megatron_optimizer]
    while todo:
        opt = todo.pop()
        if isinstance(opt, (torch.optim.Adam, torch.optim.AdamW)):
            out.append(opt)
            continue
        chained = getattr(opt, "chained_optimizers", None)
        if chained is not None:   # its .optimizer asserts that it chains exactly one
            todo += list(chained)
            continue
        inner = getattr(opt, "optimizer", None)
        if inner is not None and inner is not opt:
            todo.append(inner)
    return out


def fusable(param) -> bool:
    """Parameters torch's fused Adam runs on here: CUDA (the CPU keeps its per-tensor path, as
    every CPU test's numbers were made with it)."""
    return param.is_cuda


def _fuse_groups(opt) -> None:
    """Mark ``opt``'s param groups fused where torch's fused Adam can run them, each ``step``
    counter moved to its parameter's device as float32 (the fused kernel's layout)."""
    import torch

    for group in opt.param_groups:
        if not group["params"] or not all(fusable(p) for p in group["params"]):
            continue
        if group.get("differentiable") or group.get("capturable"):
            continue   # torch refuses fused with these; megatron-core's choice stands
        group["fused"], group["foreach"] = True, False
        for p in group["params"]:
            state = opt.state.get(p)
            step = state.get("step") if state else None
            if torch.is_tensor(step) and (step.device != p.device or step.dtype != torch.float32):
                state["step"] = step.to(device=p.device, dtype=torch.float32)


def fuse_torch_adam(megatron_optimizer) -> int:
    """megatron-core's torch Adam fallback on torch's fused kernel (``fused=True``: one pass over
    parameter, gradient and both moments) instead of its default foreach path on CUDA (a dozen
    passes: the optimizer step was 18% of the H200 profile's device time); what Transformer
    Engine's or apex's FusedAdam give megatron-core where installed. Set in a step pre-hook, so a
    checkpoint load (which restores the saved param groups and host ``step`` counters, e.g. through
    compat/distrib_optimizer.py) is followed: before a step the groups are marked fused and each
    ``step`` counter is moved to its parameter's device as float32 (the fused kernel's layout).

    That walk visits every parameter (one per expert weight: over a thousand in the GPU kit's
    128-expert model), so it runs before the first step and then again only when the groups may
    have changed: after a ``load_state_dict`` or a ``state_dict`` (the bridge in
    compat/distrib_optimizer.py creates host ``step`` counters for a save) of the torch optimizer,
    or when its param groups are other objects than those last walked. In between, the fused kernel
    keeps the counters on the device itself.
    Returns the number of torch optimizers hooked (0 with TE or apex)."""
    import operator

    hooked = 0
    for opt in torch_adams(megatron_optimizer):
        if getattr(opt, "_megatron_moe_fused", False):
            continue
        walked = []   # the param groups as of the last walk (held: identities stay unique)

        def pre_step(opt, args, kwargs, walked=walked):
            groups = opt.param_groups
            if len(walked) == len(groups) and all(map(operator.is_, walked, groups)):
                return None
            _fuse_groups(opt)
            walked[:] = groups
            return None

        def forget(opt, walked=walked):
            walked.clear()

        opt.register_step_pre_hook(pre_step)
        opt.register_load_state_dict_post_hook(forget)
        opt.register_state_dict_pre_hook(forget)
        opt._megatron_moe_fused = True
        hooked += 1
    return hooked


def mark_decoupled_lr_groups(megatron_optimizer, decoupled_lr) -> int:
    """Flag the --decoupled-lr param groups ``is_decoupled_lr`` (the key megatron-core names for
    them; returns how many).

    megatron-core gives the embedding/output parameters their own group (max_lr/min_lr overrides)
    but leaves its ``is_decoupled_lr`` False. 0.16 pairs a loaded group with the current one by
    (wd_mult, lr_mult, is_expert_parallel, is_decoupled_lr) only, so that group and the default one
    share a key and a resume fails in ``optimizer.load_state_dict`` ("a parameter group that
    doesn't match the size of optimizer's group"); 0.19 adds max_lr/min_lr to the key. Flagged
    before the first save, the groups differ on both releases, and the resume schedule code
    (compat/checkpoint.py, checkpointing.py) knows them as Megatron-LM's load_checkpoint does."""
    if decoupled_lr is None:
        return 0
    marked = 0
    for group in megatron_optimizer.param_groups:
        if not group.get("default_config", True) and group.get("max_lr") == decoupled_lr:
            group["is_decoupled_lr"] = True
            marked += 1
    return marked
