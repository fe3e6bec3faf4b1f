"""Spawned-rank body for tests/test_fused_adam.py: pretrain() with megatron-core's torch Adam
fallback put on torch's fused kernel as on CUDA (compat/optimizer.py ``fusable`` forced true on
the CPU) or left on its CPU path, the fused kernel's calls counted."""


def run(rank, world, runs, fused):
    import torch

    from megatron_moe.compat import optimizer as opt_compat
    from tests._offload_cases import run as pretrain

    calls = {"fused": 0}
    for name in ("_fused_adamw_", "_fused_adam_"):
        orig = getattr(torch, name)

        def counted(*args, _orig=orig, **kwargs):
            calls["fused"] += 1
            return _orig(*args, **kwargs)
        setattr(torch, name, counted)
    if fused:
        opt_compat.fusable = lambda param: True
    out = []
    for argv in runs:
        before = calls["fused"]
        res = pretrain(rank, world, argv)
        out.append({"losses": res["history"]["lm_loss"], "grad_norms": res["history"]["grad_norm"],
                    "fused_calls": calls["fused"] - before})
    return out
