"""megatron-core's Multi-Latent Attention without Transformer Engine.

0.16.x: ``megatron.core.extensions.transformer_engine`` imports without TE and binds MagicMock
stand-ins for TE's classes, so ``multi_latent_attention`` sets ``HAVE_TE = True`` and its
``isinstance(self.linear_proj, TELinear)`` raises ``TypeError: isinstance() arg 2 must be a type``
when an MLA layer is built. 0.19 guards the import (``HAVE_TE`` False, the names None).
The fix asks what is bound, not which release: a stand-in that is not a class means no TE.
"""


def fix_te_stand_ins() -> bool:
    """Make MLA see 'no TE' when its TE names are stand-ins. Returns True if it changed anything."""
    from megatron.core.transformer import multi_latent_attention as mla

    if getattr(mla, "HAVE_TE", False) and not isinstance(getattr(mla, "TELinear", None), type):
        mla.HAVE_TE = False
        return True
    return False
