"""Rank functions for tests/test_deepseek.py (spawned by run_distributed)."""

import contextlib
import io


def train_capture(rank, world_size, argv):
    """pretrain() on this rank: (history, the text it printed)."""
    import pretrain_gpt_moe
    from megatron.core.enums import ModelType

    from megatron_moe.training.loop import pretrain

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        result = pretrain(pretrain_gpt_moe.train_valid_test_datasets_provider,
                          pretrain_gpt_moe.model_provider, ModelType.encoder_or_decoder,
                          pretrain_gpt_moe.forward_step, argv=argv)
    return result["history"], out.getvalue()


def generate_and_recompute(rank, world_size, argv, prompt, tokens):
    """Greedy generation (megatron-core's engine, KV cache) from a checkpoint, then one
    full-sequence forward without a cache over prompt + generated tokens: its argmax and log
    probabilities must be the generated ones. Also reports what was built and loaded."""
    import torch

    from megatron_moe.inference.engine import TextGenerator, setup_model
    from megatron_moe.models.builder import unwrap
    from tests._inference_cases import _args
    from tools.generate import add_text_generate_args

    args = _args(argv, add_text_generate_args)
    model, tokenizer, iteration = setup_model(args)
    gen = TextGenerator(model, tokenizer, args)
    res = gen.generate([prompt], tokens_to_generate=tokens, top_k=1, return_log_probs=True)[0]
    gpt = unwrap(model)
    seq = torch.tensor([list(res.prompt_tokens) + list(res.tokens)])
    pos = torch.arange(seq.shape[1]).unsqueeze(0)
    with torch.no_grad():
        logits = gpt(seq, pos, None, runtime_gather_output=True).float()   # [1, s, V]
    logits[..., tokenizer.vocab_size:] = float("-inf")  # Megatron's padding rows are no tokens
    logp = torch.log_softmax(logits[0], dim=-1)
    n = len(res.prompt_tokens)
    steps = range(n - 1, seq.shape[1] - 1)
    biases = [m.expert_bias.abs().max().item() for m in gpt.modules()
              if getattr(m, "expert_bias", None) is not None]
    attention = sorted({type(m.core_attention).__name__ for m in gpt.modules()
                        if hasattr(m, "core_attention")})
    return dict(iteration=iteration, generated=list(res.tokens), log_probs=list(res.log_probs),
                argmax=[int(logp[i].argmax()) for i in steps],
                recomputed=[float(logp[i, seq[0, i + 1]]) for i in steps],
                has_mtp=hasattr(gpt, "mtp"), expert_bias_max=max(biases, default=0.0),
                core_attention=attention)
