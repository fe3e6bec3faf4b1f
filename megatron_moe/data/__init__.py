"""Data: tokenizers (``tokenizers``), GPT/BERT datasets over megatron-core indexed datasets
(``gpt``, ``bert``) and the resumable sampler (``sampler``). The .bin/.idx files come from
``tools/preprocess_data.py``."""
