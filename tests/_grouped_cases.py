"""Spawned-rank body for tests/test_grouped_experts.py and tests/test_grouped_features.py: pretrain()
runs (tests/_offload_cases.run) with the grouped experts' counters read after each, and optional
planted faults in the grouped path that the equality must catch:

* ``shift``: each expert's token group shifted by one row (the first group one row short);
* ``detach_replicas``: the balance replicas' weights stacked detached, so their gradients never
  reach the Trans'd tensors (and Agg sums zeros into the owners);
* ``skip_rebind``: the expert offload's backward re-bind of a layer's parameters left out;
* ``one_bias``: every group adds the first expert's biases;
* ``wgrad_not_added``: the grouped backward marks the weight gradients as added to DDP's
  ``main_grad`` without adding them; ``single_wgrad_not_added`` the same for a single grouped
  weight (``--moe-single-grouped-weight``);
* ``stack_merge_reversed``: the single grouped weight's checkpoint entry stacks the loaded experts
  in reverse order;
* ``single_one_bias``: every group adds the first expert's biases from the single grouped bias;
* ``slices_added_twice``: a balanced layer's slices of the single grouped weight leave the stacked
  parameter unmarked (DDP's hook adds its gradient again).

A run with a planted fault may stop (a NaN loss exits 1): its exit code or error is returned.
"""

from __future__ import annotations

import contextlib


@contextlib.contextmanager
def _planted(name):
    import torch

    from megatron_moe.moe import grouped_experts as G

    if name is None:
        yield
        return
    if name == "shift":
        orig = torch.nn.functional.grouped_mm

        def shifted(a, b, *, offs=None, **kw):
            offs = offs.clone()
            offs[0] -= 1
            return orig(a, b, offs=offs, **kw)
        torch.nn.functional.grouped_mm = shifted
        try:
            yield
        finally:
            torch.nn.functional.grouped_mm = orig
        return
    if name == "skip_rebind":
        # the expert offload's backward re-bind left out: backward must then read the NaN-filled
        # placeholders (grouped experts save the parameters, not a copy of them)
        from megatron_moe.offload import manager

        orig_bind = manager.ExpertOffload._bind

        def _bind(self, layer, upcoming, phase="forward"):
            if phase != "backward":
                return orig_bind(self, layer, upcoming, phase)
            layer.bind = lambda tensors, *rest: None
            try:
                return orig_bind(self, layer, upcoming, phase)
            finally:
                del layer.bind
        manager.ExpertOffload._bind = _bind
        try:
            yield
        finally:
            manager.ExpertOffload._bind = orig_bind
        return
    if name == "one_bias":
        # every group gets the first expert's biases. (Not a permutation of the experts' biases:
        # from their zero init that is only a relabelling of parameters, and trains identically.)
        orig_stacked = G.stacked

        def stacked(experts, pname):
            out = orig_stacked(experts, pname)
            return [out[0]] * len(out) if out is not None and pname.endswith("bias") else out
        G.stacked = stacked
        try:
            yield
        finally:
            G.stacked = orig_stacked
        return
    if name == "stack_merge_reversed":
        # the single grouped weight's checkpoint factory stacks the loaded experts in reverse
        orig_factory = G._expert_stack_factory

        def factory(param, entries):
            made = orig_factory(param, entries)
            merge = made.merge_fn
            made.merge_fn = lambda parts: merge(parts).flip(0)
            return made
        G._expert_stack_factory = factory
        try:
            yield
        finally:
            G._expert_stack_factory = orig_factory
        return
    if name == "single_one_bias":
        # every group gets the first expert's biases, read from the stacked bias parameter
        orig_single = G.GroupedSequentialMLP._single

        def single(self, pname):
            out = orig_single(self, pname)
            return out[:1].expand_as(out) if pname.endswith("bias") else out
        G.GroupedSequentialMLP._single = single
        try:
            yield
        finally:
            G.GroupedSequentialMLP._single = orig_single
        return
    if name == "single_wgrad_not_added":
        # the stacked weight's gradient marked as added to DDP's main_grad, not added
        orig_backward = G._StackedGroupedLinear.__dict__["backward"]

        def backward(ctx, grad):
            x, offs, weight = ctx.saved_tensors
            dx, dw = G._grouped_grads(ctx, grad, x, offs, weight)
            if G._into_main_grad([weight]):
                weight.grad_added_to_main_grad = True
            return dx, None, dw
        G._StackedGroupedLinear.backward = staticmethod(backward)
        try:
            yield
        finally:
            G._StackedGroupedLinear.backward = orig_backward
        return
    if name == "slices_added_twice":
        # a balanced layer's slices of the single grouped weight add into main_grad without
        # marking the stacked parameter: DDP's hook adds its gradient a second time
        orig_slices = G._slices_into_main_grad

        def slices(param):
            parts = orig_slices(param)
            for part in parts:
                if hasattr(part, "stacked_parameter"):
                    del part.stacked_parameter
            return parts
        G._slices_into_main_grad = slices
        try:
            yield
        finally:
            G._slices_into_main_grad = orig_slices
        return
    if name == "wgrad_not_added":
        orig_acc = G._accumulate_into_main_grads

        def not_added(weights, dw):
            for i in G._into_main_grad(weights):
                weights[i].grad_added_to_main_grad = True
            return list(dw.unbind(0))
        G._accumulate_into_main_grads = not_added
        try:
            yield
        finally:
            G._accumulate_into_main_grads = orig_acc
        return
    assert name == "detach_replicas", name
    orig_stacked = G.stacked

    def stacked(experts, pname):
        return orig_stacked([e if isinstance(e, torch.nn.Module) else
                             {k: v.detach() for k, v in e.items()} for e in experts], pname)
    G.stacked = stacked
    try:
        yield
    finally:
        G.stacked = orig_stacked


def offload_tiers(tmp_path):
    """The expert offload's host and ssd tiers as the grouped-expert tests run them: 2 layers
    cached, NaN-filled placeholders; the ssd tier's host cache smaller than the experts (evictions)."""
    common = ["--moe-offload-cache-layers", "2", "--moe-offload-debug-nan-fill"]
    return (["--moe-expert-offload", "host", *common],
            ["--moe-expert-offload", "ssd", *common, "--moe-offload-dir", str(tmp_path / "ssd"),
             "--moe-offload-host-cache-gb", "0.0002"])


def run_counted(rank, world, argvs, plant_shift=None, mutations=None, skew=None):
    """``mutations[k]``: the fault planted in run k (``plant_shift=k`` is ``{k: "shift"}``);
    ``skew=(strength, period)``: a hot expert that moves (tests/_flexmoe_persistent_cases), so the
    balance policies replicate at this tiny size."""
    from megatron_moe.moe.grouped_experts import GroupedSequentialMLP
    from tests._offload_cases import run

    mutations = dict(mutations or {})
    if plant_shift is not None:
        mutations[plant_shift] = "shift"
    if skew is not None:
        from tests._flexmoe_persistent_cases import _patch_router

        _patch_router(*skew)
    out = []
    for k, argv in enumerate(argvs):
        calls, replicas = GroupedSequentialMLP.grouped_calls, GroupedSequentialMLP.replica_groups
        wgrads = GroupedSequentialMLP.wgrads_into_main_grad
        with _planted(mutations.get(k)):
            try:
                res = run(rank, world, argv)
            except SystemExit as exc:
                if mutations.get(k) is None:
                    raise
                res = {"exit": exc.code}
            except Exception as exc:    # e.g. a NaN placeholder reached a check
                if mutations.get(k) is None:
                    raise
                res = {"error": f"{type(exc).__name__}: {exc}"[:300]}
        res["grouped_calls"] = GroupedSequentialMLP.grouped_calls - calls
        res["replica_groups"] = GroupedSequentialMLP.replica_groups - replicas
        res["wgrads_into_main_grad"] = GroupedSequentialMLP.wgrads_into_main_grad - wgrads
        out.append({k2: v for k2, v in res.items() if k2 != "lines"})
    return out


def ring_logits(rank, world, argv, probe, slots):
    """Inference from a checkpoint (tools/generate.py's setup): fp32 logits of ``probe`` resident,
    through the ring memory (K slots, NaN fill: every layer streamed), through the ring with only
    the active experts copied, and (grouped experts) the ring with a token group shifted."""
    from megatron_moe.inference.engine import setup_model
    from megatron_moe.inference.ring_memory import RingMemory
    from megatron_moe.moe.grouped_experts import GroupedSequentialMLP
    from tests._inference_cases import _args, _logits
    from tools.generate import add_text_generate_args

    args = _args(argv, add_text_generate_args)
    model, _, _ = setup_model(args)
    calls = GroupedSequentialMLP.grouped_calls
    out = {"resident": _logits(model, probe)}
    ring = RingMemory(model, slots=slots, debug=True)
    out["ring"] = _logits(model, probe)
    out["ring_stats"] = ring.stats()
    ring.close()
    ring = RingMemory(model, slots=slots, debug=True, experts="active")
    out["active"] = _logits(model, probe)
    out["active_stats"] = ring.stats()
    ring.close()
    out["grouped_calls"] = GroupedSequentialMLP.grouped_calls - calls
    if out["grouped_calls"]:
        ring = RingMemory(model, slots=slots, debug=True)
        with _planted("shift"):
            out["ring_shifted"] = _logits(model, probe)
        ring.close()
    return out
