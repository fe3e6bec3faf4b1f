"""megatron-core's Multi-Latent Attention without Transformer Engine.

0.16.x: ``megatron.core.extensions.transformer_engine`` imports without TE and binds MagicMock
stand-ins for TE's classes, so ``multi_latent_attention`` sets ``HAVE_TE = True`` and its
``isinstance(self.linear_proj, TELinear)`` raises ``TypeError: isinstance() arg 2 must be a type``
when an MLA layer is built. 0.19 guards the import (``HAVE_TE`` False, the names None).
The fix asks what is bound, not which release: a stand-in that is not a class means no TE.

0.19: the local layer spec sets MLA's ``q_layernorm`` whenever ``--qk-layernorm`` is on, and
``MLASelfAttention`` then refuses the spec when there is no query LoRA (``q_lora_rank`` None:
"q_layernorm is non-trivial, but q_lora_rank is None, meaning it will not be used"), which is
DeepSeek-V2-Lite's configuration. 0.16 simply never builds that norm. ``drop_unused_q_norm`` makes
the spec say what both build: no query norm without a query LoRA.
"""


def fix_te_stand_ins() -> bool:
    """Make MLA see 'no TE' when its TE names are stand-ins. Returns True if it changed anything."""
    from megatron.core.transformer import multi_latent_attention as mla

    if getattr(mla, "HAVE_TE", False) and not isinstance(getattr(mla, "TELinear", None), type):
        mla.HAVE_TE = False
        return True
    return False


def drop_unused_q_norm(submodules, q_lora_rank):
    """MLA submodules with ``q_layernorm`` = IdentityOp when there is no query LoRA to normalise
    (a new object; unchanged otherwise)."""
    import dataclasses

    from megatron.core.transformer.identity_op import IdentityOp

    if q_lora_rank is not None or getattr(submodules, "q_layernorm", IdentityOp) in (None, IdentityOp):
        return submodules
    return dataclasses.replace(submodules, q_layernorm=IdentityOp)


def local_fused_q_norm(fused_cls) -> bool:
    """Let megatron-core's MLA norm resolver (0.19+) use ``fused_cls`` where the backend has no
    fused norm + column-parallel linear (the local one). Returns True if the resolver exists."""
    try:
        from megatron.core.transformer import mla_qk_norm_config as resolver_module
    except ImportError:
        return False  # <= 0.18: MLA builds the query path from the spec directly
    resolver = resolver_module.QKNormConfigResolver
    if getattr(resolver, "_megatron_moe_local_fused", None) is fused_cls:
        return True
    init = resolver.__init__

    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        if self.fused_norm_linear_impl is None:
            self.fused_norm_linear_impl = fused_cls

    resolver.__init__ = __init__
    resolver._megatron_moe_local_fused = fused_cls
    return True


def mtp_inner_layer() -> str:
    """The attribute (and parameter-name part) of a megatron-core MTP layer's transformer layer:
    ``transformer_layer`` in 0.16, ``mtp_model_layer`` from 0.19 (its submodules' field name)."""
    import dataclasses

    from megatron.core.transformer.multi_token_prediction import (
        MultiTokenPredictionLayerSubmodules)

    fields = {f.name for f in dataclasses.fields(MultiTokenPredictionLayerSubmodules)}
    return "mtp_model_layer" if "mtp_model_layer" in fields else "transformer_layer"
