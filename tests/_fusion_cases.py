"""Spawned-rank body for tests/test_compiled_fusions.py: a 1-rank pretrain() with megatron-core's
torch.compile fusions forced on (what the local path selects on CUDA: builder._fusion_selectors)
or left off, with calls of the fused functions counted."""


def run(rank, world, argv, fused):
    from megatron.core.models.common.language_module import language_module
    from megatron.core.transformer import mlp

    from megatron_moe.models import builder
    from tests._offload_cases import run as pretrain

    calls = {"swiglu": 0, "cross_entropy": 0}

    def counted(module, name, key):
        orig = getattr(module, name)

        def wrapper(*args, **kwargs):
            calls[key] += 1
            return orig(*args, **kwargs)
        setattr(module, name, wrapper)

    counted(mlp, "bias_swiglu_impl", "swiglu")
    counted(mlp, "weighted_bias_swiglu_impl", "swiglu")
    counted(language_module, "fused_vocab_parallel_cross_entropy", "cross_entropy")
    if fused:   # as on CUDA (torch.cuda.is_available() is what the builder asks)
        orig = builder._fusion_selectors

        def on_cuda(args, te):
            import torch

            real = torch.cuda.is_available
            torch.cuda.is_available = lambda: True
            try:
                sel = orig(args, te)
            finally:
                torch.cuda.is_available = real
            if fused is not True:   # only the named selectors
                sel = {k: (v if k in fused else False) for k, v in sel.items()}
            return sel
        builder._fusion_selectors = on_cuda
    res = pretrain(rank, world, argv)
    return {"losses": res["history"]["lm_loss"], "grad_norms": res["history"]["grad_norm"],
            "calls": calls}
