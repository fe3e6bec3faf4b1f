"""Rank functions for tests/test_sdpa_training.py (spawned by run_distributed)."""


def train_counting_sdpa(rank, world_size, argv, mutate=False):
    """pretrain() with torch's SDPA wrapped to count its calls; ``mutate`` drops its causal mask
    (the mutation the loss comparison must catch: each token sees the ones after it). Returns
    (history, calls)."""
    import torch.nn.functional as F

    from tests._train_cases import run_pretrain

    real = F.scaled_dot_product_attention
    calls = [0]

    def counting(*args, **kwargs):
        calls[0] += 1
        if mutate:
            kwargs["is_causal"] = False
        return real(*args, **kwargs)

    F.scaled_dot_product_attention = counting
    try:
        history = run_pretrain(rank, world_size, argv)
    finally:
        F.scaled_dot_product_attention = real
    return history, calls[0]
