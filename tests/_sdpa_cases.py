"""Rank functions for tests/test_sdpa_training.py (spawned by run_distributed)."""


def train_counting_sdpa(rank, world_size, argv, mutate=False, bert=False):
    """pretrain() (GPT, or BERT with ``bert``) with torch's SDPA wrapped to count its calls and
    those given a mask; ``mutate`` drops its causal mask (the mutation the loss comparison must
    catch: each token sees the ones after it). Returns (history, calls, masked calls)."""
    import torch.nn.functional as F

    from tests._bert_cases import run_pretrain_bert
    from tests._train_cases import run_pretrain

    real = F.scaled_dot_product_attention
    calls, masked = [0], [0]

    def counting(*args, **kwargs):
        calls[0] += 1
        masked[0] += kwargs.get("attn_mask") is not None
        if mutate:
            kwargs["is_causal"] = False
        return real(*args, **kwargs)

    F.scaled_dot_product_attention = counting
    try:
        history = (run_pretrain_bert if bert else run_pretrain)(rank, world_size, argv)
    finally:
        F.scaled_dot_product_attention = real
    return history, calls[0], masked[0]


def generate_counting_sdpa(rank, world_size, argv, prompts, tokens):
    """Greedy generation (megatron-core's static engine, KV cache) from a checkpoint with the
    given flags; torch's SDPA calls counted. Returns ([(tokens, log probs)], calls)."""
    import torch.nn.functional as F

    from megatron_moe.inference.arguments import parse_inference_args
    from megatron_moe.inference.engine import TextGenerator, setup_model
    from tools.generate import add_text_generate_args

    real = F.scaled_dot_product_attention
    calls = [0]

    def counting(*args, **kwargs):
        calls[0] += 1
        return real(*args, **kwargs)

    F.scaled_dot_product_attention = counting
    try:
        args = parse_inference_args(argv, add_text_generate_args, prog="test")
        model, tokenizer, _ = setup_model(args)
        gen = TextGenerator(model, tokenizer, args)
        res = gen.generate(prompts, tokens_to_generate=tokens, return_log_probs=True)
    finally:
        F.scaled_dot_product_attention = real
    return [(list(r.tokens), list(r.log_probs)) for r in res], calls[0]


def train_fast_path(rank, world_size, argv):
    """pretrain() with SDPA and the grouped experts counted: (history, SDPA calls, grouped calls)."""
    from megatron_moe.moe.grouped_experts import GroupedSequentialMLP

    history, calls, _ = train_counting_sdpa(rank, world_size, argv)
    return history, calls, GroupedSequentialMLP.grouped_calls
