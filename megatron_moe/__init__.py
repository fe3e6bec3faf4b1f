"""megatron-moe: Megatron-LM-style Mixture-of-Experts pretraining on megatron-core."""

__version__ = "0.1.0"
