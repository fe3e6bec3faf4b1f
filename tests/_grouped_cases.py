"""Spawned-rank body for tests/test_grouped_experts.py: pretrain() runs (tests/_offload_cases.run)
with the grouped experts' call counter read after each, and an optional planted fault in the grouped
path (each expert's token group shifted by one row) that the equality must catch."""

from __future__ import annotations


def run_counted(rank, world, argvs, plant_shift=None):
    import torch

    from megatron_moe.moe.grouped_experts import GroupedSequentialMLP
    from tests._offload_cases import run

    out = []
    orig = torch.nn.functional.grouped_mm
    for k, argv in enumerate(argvs):
        before = GroupedSequentialMLP.grouped_calls
        if k == plant_shift:  # the first group one row short, the second one row long
            def shifted(a, b, *, offs=None, **kw):
                offs = offs.clone()
                offs[0] -= 1
                return orig(a, b, offs=offs, **kw)
            torch.nn.functional.grouped_mm = shifted
        try:
            res = run(rank, world, argv)
        finally:
            torch.nn.functional.grouped_mm = orig
        res["grouped_calls"] = GroupedSequentialMLP.grouped_calls - before
        out.append({k2: v for k2, v in res.items() if k2 != "lines"})
    return out
