"""Rank functions for tests/test_server_completions.py (spawned by run_distributed): the
checkpoint's own log probs and greedy generations, computed in-process (no server)."""

from __future__ import annotations


def reference_case(rank, world_size, argv, pairs, prompts, max_new):
    """For each (context, continuation): lm-evaluation-harness's token split (the whole text and
    the context tokenized, the continuation = the whole's tokens after the context's) and the sum
    of the continuation's log probs from one fp32 forward over the whole sequence. For each
    prompt: the greedy completion of ``max_new`` tokens (megatron-core's engine, in-process)."""
    import torch

    from megatron_moe.inference.arguments import parse_inference_args
    from megatron_moe.inference.engine import TextGenerator, setup_model
    from tests._inference_cases import _logits
    from tools.generate import add_text_generate_args

    args = parse_inference_args(argv, add_text_generate_args, prog="test")
    model, tokenizer, _ = setup_model(args)
    loglik = []
    for context, continuation in pairs:
        whole = list(tokenizer.tokenize(context + continuation))
        n_ctx = len(tokenizer.tokenize(context))
        logits = torch.from_numpy(_logits(model, whole))[0].double()
        logits[:, tokenizer.vocab_size:] = float("-inf")  # Megatron's padding rows are no tokens
        logp = torch.log_softmax(logits, dim=-1)
        total = sum(float(logp[i - 1, whole[i]]) for i in range(n_ctx, len(whole)))
        loglik.append(total)
    gen = TextGenerator(model, tokenizer, args)
    completions = [r.completion for r in gen.generate(prompts, tokens_to_generate=max_new,
                                                      top_k=1)]
    return {"loglik": loglik, "completions": completions}
