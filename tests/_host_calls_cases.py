"""Spawned-rank body for tests/test_host_calls.py: the Python function calls our own code makes
in one training iteration of the real pretrain() loop (1 rank, bf16, grouped experts, torch's fused
Adam pre-hook forced on as on CUDA), counted with ``sys.setprofile``: every Python frame that runs
in megatron_moe/ or is called from a frame there (torch's ``nn.Module.__getattr__``, hooks,
autograd functions). compat/cpu.py's shims stand in for CUDA calls and run on the CPU only: their
frames are left out."""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OURS = os.path.join(ROOT, "megatron_moe") + os.sep
CPU_SHIMS = os.path.join(OURS, "compat", "cpu.py")


def _ours(code) -> bool:
    return (code.co_filename.startswith(OURS) and code.co_filename != CPU_SHIMS) \
        or code in _MUTANT_CODE


# --- mutations: the per-expert and per-parameter Python this repository had before -------------

def _old_stacked(experts, name):
    import torch
    linear, attr = name.split(".")
    params = [getattr(getattr(e, linear), attr, None) if isinstance(e, torch.nn.Module)
              else e.get(name) for e in experts]
    return None if params[0] is None else params


def _old_hooks(experts):
    for expert in experts:
        for linear in (expert.linear_fc1, expert.linear_fc2):
            for hook in list(linear._forward_pre_hooks.values()):
                hook(linear, ())


def _experts_by_getattr():
    """The grouped experts' parameters and hooks read through nn.Module.__getattr__ per expert."""
    from megatron_moe.moe import grouped_experts as G
    G.stacked, G._run_forward_pre_hooks = _old_stacked, _old_hooks


def _old_into_main_grad_one(w):
    return getattr(w, "main_grad", None) is not None and hasattr(w, "grad_added_to_main_grad") \
        and not getattr(w, "zero_out_wgrad", False)


def _old_into_main_grad(weights):
    return [i for i, w in enumerate(weights) if _old_into_main_grad_one(w)]


def _main_grad_test_per_weight():
    """DDP's main_grad tested by a Python call per expert weight (per layer per micro-batch)."""
    from megatron_moe.moe import grouped_experts as G
    G._into_main_grad = _old_into_main_grad


def _adam_walk_every_step():
    """The fused Adam pre-hook walking every parameter before every step."""
    from megatron_moe.compat import optimizer as O

    def fuse(megatron_optimizer):
        for opt in O.torch_adams(megatron_optimizer):
            opt.register_step_pre_hook(lambda opt, args, kwargs: O._fuse_groups(opt))
        return 1
    O.fuse_torch_adam = fuse


def _expert_shells_registered():
    """The single grouped weight's empty per-expert MLPs left in the module tree."""
    from megatron_moe.moe import grouped_experts as G
    G._unregister_expert_shells = lambda experts: None


def _replicas_counted_per_expert():
    """The grouped call's replica count taken with an isinstance call per expert, own or not."""
    import torch

    from megatron_moe.moe import grouped_experts as G
    run_groups = G.GroupedSequentialMLP.run_groups

    def counting(self, experts, *args, **kwargs):
        G.GroupedSequentialMLP.replica_groups += 0 * len(
            [e for e in experts if not isinstance(e, torch.nn.Module)])
        return run_groups(self, experts, *args, **kwargs)
    G.GroupedSequentialMLP.run_groups = counting


MUTATIONS = {"expert_shells_registered": _expert_shells_registered,
             "replicas_counted_per_expert": _replicas_counted_per_expert,
             "experts_by_getattr": _experts_by_getattr,
             "main_grad_test_per_weight": _main_grad_test_per_weight,
             "adam_walk_every_step": _adam_walk_every_step}


def _code_of(fn):
    todo, out = [fn.__code__], set()
    while todo:
        code = todo.pop()
        out.add(code)
        todo += [c for c in code.co_consts if hasattr(c, "co_filename")]
    return out


# the mutations' code stands in for ours: counted as if it were in megatron_moe/
_MUTANT_CODE = set().union(*map(_code_of, (_old_stacked, _old_hooks, _old_into_main_grad,
                                             _old_into_main_grad_one, _adam_walk_every_step)))


def count(rank, world, argv, iteration, mutate=None, every_call=False):
    """Calls at ``iteration``; also the wall seconds of each later iteration (bench/host_calls.py)
    and the number of modules in the model. ``mutate``: a name in MUTATIONS, or a tuple of them;
    ``every_call``: count every Python call (megatron-core's and torch's too), not only ours."""
    import collections
    import gc
    import time

    import torch

    from megatron_moe.compat import optimizer as optimizer_compat
    from megatron_moe.moe.grouped_experts import GroupedSequentialMLP
    from tests._train_cases import pretrain_with_step

    optimizer_compat.fusable = lambda param: True   # the CUDA path (as tests/test_fused_adam.py)
    for name in (mutate,) if isinstance(mutate, str) else mutate or ():
        MUTATIONS[name]()
    fused_calls = {"n": 0}
    orig_fused = torch._fused_adamw_

    def counted_fused(*args, **kwargs):
        fused_calls["n"] += 1
        return orig_fused(*args, **kwargs)
    torch._fused_adamw_ = counted_fused

    calls = collections.Counter()

    def profile(frame, event, arg):
        if event == "call" and (every_call or _ours(frame.f_code) or
                                (frame.f_back is not None and _ours(frame.f_back.f_code))):
            code = frame.f_code
            calls[f"{os.path.relpath(code.co_filename, ROOT)}:{code.co_name}"] += 1
        elif event == "c_call" and every_call:     # builtins too (cProfile counts them)
            calls[f"<C>:{getattr(arg, '__qualname__', type(arg).__name__)}"] += 1

    state = {"it": 0}
    ran, seconds, modules = {}, [], []

    def counted_steps(step):
        def counted(self, data_iterator):
            state["it"] += 1
            if state["it"] > iteration:
                start = time.perf_counter()
                try:
                    return step(self, data_iterator)
                finally:
                    seconds.append(time.perf_counter() - start)
            if state["it"] != iteration:
                return step(self, data_iterator)
            modules.append(sum(1 for chunk in self.model for _ in chunk.modules()))
            before = (GroupedSequentialMLP.grouped_calls,
                      GroupedSequentialMLP.wgrads_into_main_grad, fused_calls["n"])
            gc.disable()   # no collector (and finalizers it runs) at points that vary with the sizes
            sys.setprofile(profile)
            try:
                return step(self, data_iterator)
            finally:
                sys.setprofile(None)
                gc.enable()
                after = (GroupedSequentialMLP.grouped_calls,
                         GroupedSequentialMLP.wgrads_into_main_grad, fused_calls["n"])
                ran.update(zip(("grouped_calls", "wgrads_into_main_grad", "fused_adam_calls"),
                               (a - b for a, b in zip(after, before))))
        return counted

    try:
        pretrain_with_step(argv, counted_steps)
    finally:
        torch._fused_adamw_ = orig_fused
    return {"calls": dict(calls), "ran": ran, "seconds": seconds, "modules": modules[0]}
