"""Spawned-rank body for tests/test_grouped_experts.py and tests/test_grouped_features.py: pretrain()
runs (tests/_offload_cases.run) with the grouped experts' counters read after each, and optional
planted faults in the grouped path that the equality must catch:

* ``shift``: each expert's token group shifted by one row (the first group one row short);
* ``detach_replicas``: the balance replicas' weights stacked detached, so their gradients never
  reach the Trans'd tensors (and Agg sums zeros into the owners).
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
        with _planted(mutations.get(k)):
            res = run(rank, world, argv)
        res["grouped_calls"] = GroupedSequentialMLP.grouped_calls - calls
        res["replica_groups"] = GroupedSequentialMLP.replica_groups - replicas
        out.append({k2: v for k2, v in res.items() if k2 != "lines"})
    return out
