"""megatron-core's DistributedOptimizer over torch.optim.Adam (no Transformer Engine, no apex):
save and resume its Adam state exactly (docs/compat.md row 14, docs/checkpoints.md).

Without TE or apex, ``megatron/core/optimizer/distrib_optimizer.py`` falls back to
``torch.optim.Adam``, whose state carries a per-parameter ``step`` tensor that FusedAdam keeps in
the param groups instead. Its load path then fails, identically on 0.16.1 and 0.19.x:

1. ``sharded_state_dict(is_loading=True)`` calls ``state_dict()``, which asserts exactly one
   ``step`` among torch Adam's per-parameter states; a fresh process has none before its first
   step (AssertionError).
2. ``load_parameter_state_from_fully_reshardable`` -> ``_set_main_param_and_optimizer_states``
   copies every key of the torch state, ``step`` included, from the checkpoint's tensors, which
   never hold it (KeyError: 'step').
3. ``load_state_dict`` puts ONE ``step`` tensor into every parameter's state; torch Adam adds 1 to
   it in place once per parameter per step, so after a resume the bias correction uses a step
   count that grows by the number of parameters per iteration (the losses drift).

The bridge wraps those three methods (a no-op where TE or apex is present):
1. before ``state_dict()``, create the states torch Adam's first step would create (step 0, zero
   moments) for parameters that have none -- what its lazy init does, so a later first step is
   unchanged; 2. hide ``step`` while the checkpoint's tensors are copied in (``step`` comes from the
   param groups, as megatron-core intends); 3. give every parameter its own ``step`` tensor after
   ``load_state_dict``.
"""

from __future__ import annotations

import functools

import torch

__all__ = ["install_torch_adam_bridge", "bridge_needed"]


def bridge_needed() -> bool:
    from megatron.core.optimizer import distrib_optimizer

    return not getattr(distrib_optimizer, "HAVE_APEX_OR_TE", True)


def _prime(opt: torch.optim.Optimizer):
    for group in opt.param_groups:
        for p in group["params"]:
            if opt.state.get(p):
                continue
            state = opt.state[p]
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            if group.get("amsgrad"):
                state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


def install_torch_adam_bridge() -> bool:
    """Wrap DistributedOptimizer's state_dict / load_state_dict / state copy (once per process).
    Returns whether the bridge is in place (False where TE or apex make it unnecessary)."""
    from megatron.core.optimizer import distrib_optimizer

    if not bridge_needed():
        return False
    cls = distrib_optimizer.DistributedOptimizer
    if getattr(cls, "_megatron_moe_torch_adam_bridge", False):
        return True
    state_dict, load_state_dict = cls.state_dict, cls.load_state_dict
    set_states = cls._set_main_param_and_optimizer_states

    @functools.wraps(state_dict)
    def primed_state_dict(self):
        if isinstance(self.optimizer, torch.optim.Optimizer):
            _prime(self.optimizer)
        return state_dict(self)

    @functools.wraps(load_state_dict)
    def load_with_own_steps(self, sd):
        out = load_state_dict(self, sd)
        for state in self.optimizer.state.values():
            if torch.is_tensor(state.get("step")):
                state["step"] = state["step"].clone()
        return out

    @functools.wraps(set_states)
    def set_states_without_step(self, model_param, tensors):
        group_index, group_order = self.model_param_group_index_map[model_param]
        main_param = self.optimizer.param_groups[group_index]["params"][group_order]
        state = self.optimizer.state[main_param]
        step = state.pop("step", None) if "step" not in tensors else None
        try:
            return set_states(self, model_param, tensors)
        finally:
            if step is not None:
                state["step"] = step

    cls.state_dict = primed_state_dict
    cls.load_state_dict = load_with_own_steps
    cls._set_main_param_and_optimizer_states = set_states_without_step
    cls._megatron_moe_torch_adam_bridge = True
    return True
