"""Inference from training checkpoints: text generation, evaluation, ring-memory offloading.

Kept import-light (the tools answer --help without loading megatron-core): see engine.py,
arguments.py, ring_memory.py and docs/inference.md.
"""
