"""Hugging Face interop: per-family name and layout mappings between HF checkpoints (safetensors,
transformers' on-disk names) and megatron-core's GPTModel (docs/hf.md).

``families`` is pure bookkeeping (names, shapes, config <-> flags) and imports only torch;
``tools/checkpoint/convert.py`` drives the loaders and savers.
"""

from megatron_moe.hf.families import FAMILIES, Rule, Spec, family_for_config, rules_for

__all__ = ["FAMILIES", "Rule", "Spec", "family_for_config", "rules_for"]
