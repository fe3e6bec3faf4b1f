"""Rank function for tests/test_inference_hf.py (spawned by run_distributed): generation from a
checkpoint imported from Hugging Face whose vocabulary Megatron padded."""

from __future__ import annotations


def padded_vocab_case(rank, world_size, load, prompt, n_tokens, samples):
    """tools/generate.py's path (parse_inference_args --use-checkpoint-args, setup_model,
    TextGenerator) on ``load``: temperature-1 sampling, log probs of prompt and samples, the
    server's /completions echo answer, a generation stopped at EOD; then the same sampling with
    the padded-row mask switched off (mutation)."""
    import copy

    from megatron_moe.inference import engine
    from megatron_moe.inference.arguments import parse_inference_args
    from megatron_moe.inference.server import completion_choices
    from tools.generate import add_text_generate_args

    args = parse_inference_args(["--load", load, "--use-checkpoint-args"], add_text_generate_args,
                                prog="test")
    model, tokenizer, _ = engine.setup_model(args)
    out = {"vocab": tokenizer.vocab_size, "padded_vocab": args.padded_vocab_size}

    def sample(gen):
        res = gen.generate(None, tokens_to_generate=n_tokens, temperature=1.0, top_k=0, top_p=0.0,
                           return_log_probs=True, prompt_tokens=[list(prompt)] * samples, seed=7)
        return [dict(tokens=r.tokens, log_probs=r.log_probs, prompt_log_probs=r.prompt_log_probs)
                for r in res]

    gen = engine.TextGenerator(model, tokenizer, args)
    out["sampled"] = sample(gen)
    # the server's /completions with echo + logprobs (lm-evaluation-harness's loglikelihood)
    scored = gen.generate(None, tokens_to_generate=0, top_k=1, return_log_probs=True,
                          prompt_tokens=[list(prompt)], top_n_logprobs=2)
    spec = dict(echo=True, stop=[], logprobs=2)
    out["echo"] = completion_choices(tokenizer, spec, scored)[0][0]["logprobs"]["token_logprobs"]

    # a generation that ends at EOD: the tokenizer's eod made the 4th greedy token (megatron-core
    # stops there and keeps no EOD among the generated tokens)
    [greedy] = gen.generate(None, tokens_to_generate=8, top_k=1, prompt_tokens=[list(prompt)])
    out["greedy"] = dict(tokens=greedy.tokens, finish_reason=greedy.finish_reason)
    stop_at = next(i for i in range(1, 8) if greedy.tokens[i] not in greedy.tokens[:i])
    eod = greedy.tokens[stop_at]
    stopping = copy.copy(tokenizer)
    stopping.__class__ = type("EodAt", (type(tokenizer),), {"eod": property(lambda self: eod)})
    gen.tokenizer = gen.engine.controller.tokenizer = stopping
    [ended] = gen.generate(None, tokens_to_generate=8, top_k=1, prompt_tokens=[list(prompt)])
    choice = completion_choices(stopping, dict(echo=False, stop=[], logprobs=None), [ended])[0][0]
    out["ended"] = dict(tokens=ended.tokens, finish_reason=ended.finish_reason, eod=eod,
                        stop_at=stop_at, completion=choice["text"],
                        completion_finish=choice["finish_reason"],
                        expected_text=tokenizer.detokenize(list(prompt) + greedy.tokens[:stop_at])
                        [len(tokenizer.detokenize(list(prompt))):])

    # mutation: no mask over the padded rows (the engine as it was)
    engine.mask_padded_vocabulary = lambda *a, **k: None
    out["unmasked"] = sample(engine.TextGenerator(model, tokenizer, args))
    return out


def generate_then_logits_case(rank, world_size, load, prompt, n_tokens, samples, logit_jobs):
    """padded_vocab_case, then in the same process logits_rank for each (hf_dir, ckpt, layouts,
    tokens) job: plain forwards after the engine has generated."""
    from tests._hf_cases import logits_rank

    out = padded_vocab_case(rank, world_size, load, prompt, n_tokens, samples)
    out["logits"] = [logits_rank(rank, world_size, *job) for job in logit_jobs]
    return out
