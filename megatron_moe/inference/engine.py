"""Checkpoint -> model -> megatron-core static inference engine -> text.

Every rank runs the same engine on the same prompts (the MoE all-to-alls, TP all-reduces and PP
sends need all of them); rank 0 reports. Greedy decoding (``top_k=1``) is deterministic; sampling
draws from the controller's own generator, re-seeded per request, so all ranks draw alike.

Megatron pads the vocabulary rows (a multiple of --make-vocab-size-divisible-by x TP); the padded
rows are no tokens. ``mask_padded_vocabulary`` sets their logits to -inf where the model hands its
logits to megatron-core's generation loop, so every softmax after it (sampling, log probs, top-n
log probs) is over the tokenizer's vocabulary only, as transformers' is over the HF vocabulary.
"""

from __future__ import annotations

import dataclasses

import torch


def single_process_port():
    """A free rendezvous port when not launched by torchrun (the default 6000 may be taken)."""
    import os

    if "WORLD_SIZE" not in os.environ and "MASTER_PORT" not in os.environ:
        from megatron_moe.runtime.local_ranks import free_port

        os.environ["MASTER_PORT"] = str(free_port())


def setup_model(args):
    """Process groups, tokenizer, this rank's model chunk in eval mode with the checkpoint's weights.

    Returns (model, tokenizer, iteration). No DDP wrapper: nothing here needs gradients.
    """
    from megatron.core import parallel_state
    from megatron.core.transformer.module import Float16Module

    from megatron_moe.runtime import global_vars
    from megatron_moe.training.checkpointing import load_checkpoint
    from megatron_moe.runtime.initialize import initialize_distributed
    from megatron_moe.models.builder import gpt_model_provider
    from megatron_moe.training.loop import _build_tokenizer

    global_vars.set_args(args)
    initialize_distributed(args)
    tokenizer = _build_tokenizer(args)
    _keep_checkpoint_vocab_padding(args)
    # generation predicts the next token only: the Multi-Token Prediction block is not built
    # (megatron-core's forward would compute its loss, without labels), and the checkpoint's
    # MTP weights are simply not requested from it
    args.mtp_num_layers = None
    model = gpt_model_provider(args, pre_process=parallel_state.is_pipeline_first_stage(),
                               post_process=parallel_state.is_pipeline_last_stage())
    if torch.cuda.is_available():
        model.cuda(torch.cuda.current_device())
    if args.bf16 or args.fp16:
        model = Float16Module(model.config, model)
    model.eval()
    iteration, _, _, _ = load_checkpoint([model], None, None, args)
    return model, tokenizer, iteration


def _keep_checkpoint_vocab_padding(args):
    """Use the checkpoint's padded vocabulary when this TP size can shard it.

    The padding rule (a multiple of --make-vocab-size-divisible-by x TP) gives another size at
    another TP; megatron-core then loads the embedding with a shape mismatch and leaves the extra
    rows at their random init, which changes every softmax. The trained size is right whenever
    TP divides it."""
    stored = getattr(getattr(args, "checkpoint_args", None), "padded_vocab_size", None)
    if stored and stored != args.padded_vocab_size:
        if stored % args.tensor_model_parallel_size == 0:
            args.padded_vocab_size = stored
        else:
            raise ValueError(
                f"the checkpoint's padded vocabulary ({stored}) does not divide into "
                f"--tensor-model-parallel-size {args.tensor_model_parallel_size} shards")


def mask_padded_vocabulary(wrapped_model, vocab_size: int):
    """Logits of ids >= ``vocab_size`` (the tokenizer's; Megatron's padding rows above it) are
    -inf in every forward step's output. megatron-core's static generation loop has no logits
    processor hook; ``run_one_forward_step`` is where the gathered full-vocabulary logits leave
    the model (and the last pipeline stage) before the loop samples, takes log-softmax or top-n
    from them, so this one place covers all of those."""
    forward = wrapped_model.run_one_forward_step

    def run_one_forward_step(*args, **kwargs):
        logits = forward(*args, **kwargs)
        if logits is not None and logits.shape[-1] > vocab_size:
            logits[..., vocab_size:] = float("-inf")
        return logits

    wrapped_model.run_one_forward_step = run_one_forward_step


def finish_reason(tokens, tokens_to_generate: int) -> str:
    """OpenAI's finish_reason of one generation: "stop" when it ended at the end-of-document token,
    "length" when the token budget ran out. megatron-core stops a request at EOD without keeping
    the EOD among its generated tokens (its generated length stops growing at EOD), so a
    generation shorter than the budget ended at EOD."""
    return "stop" if len(tokens) < tokens_to_generate else "length"


@dataclasses.dataclass
class Generation:
    prompt: str
    text: str                    # prompt + completion (Megatron's server answers this)
    completion: str
    prompt_tokens: list
    tokens: list                 # generated token ids (megatron-core keeps no EOD among them)
    finish_reason: str = "length"  # "stop": ended at EOD; "length": the token budget ran out
    log_probs: list | None = None  # of the generated tokens, when asked for
    prompt_log_probs: list | None = None  # of prompt tokens 2..n, when asked for
    top_n: list | None = None    # per generated token {token text: log prob}, when asked for
    prompt_top_n: list | None = None  # per prompt token 2..n, when asked for
    request_id: int | None = None  # megatron-core's id of the request (Megatron's output keys)
    generated_text: str | None = None  # megatron-core's detokenization of `tokens` alone
    tpot: list | None = None     # megatron-core's seconds per generation step


class TextGenerator:
    """megatron-core's StaticInferenceEngine (KV cache, prefill + decode) over one model chunk."""

    def __init__(self, model, tokenizer, args):
        from megatron_moe.compat.inference import build_static_engine

        self.tokenizer = tokenizer
        self.args = args
        self.max_sequence_length = args.inference_max_seq_length or args.max_position_embeddings
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
        self.engine = build_static_engine(
            model, tokenizer, hidden_size=args.hidden_size, params_dtype=dtype[args.params_dtype],
            padded_vocab_size=args.padded_vocab_size, max_batch_size=args.inference_max_requests,
            max_sequence_length=self.max_sequence_length, random_seed=args.seed)
        self.vocab_size = int(tokenizer.vocab_size)  # the true vocabulary, without padding rows
        mask_padded_vocabulary(self.engine.controller.inference_wrapped_model, self.vocab_size)

    def tokenize(self, prompt: str) -> list:
        return list(self.tokenizer.tokenize(prompt))

    def tokenize_prompts(self, prompts, tokens_to_generate: int, add_bos: bool = False) -> list:
        """Token ids per prompt; ValueError naming a prompt that is empty or does not fit the
        context together with its completion."""
        prompt_tokens = [self.tokenize(p) for p in prompts]
        if add_bos:
            try:
                bos = self.tokenizer.bos
            except (AttributeError, NotImplementedError):
                bos = None
            if bos is None or bos < 0:
                raise ValueError(f"add_BOS: the tokenizer {type(self.tokenizer).__name__} has no "
                                 f"BOS token")
            prompt_tokens = [[bos] + t for t in prompt_tokens]
        for i, tokens in enumerate(prompt_tokens):
            n = len(tokens)
            if n == 0:
                raise ValueError(f"prompt {i} is empty after tokenization")
            if n + tokens_to_generate > self.max_sequence_length:
                raise ValueError(
                    f"prompt {i} has {n} tokens; with {tokens_to_generate} tokens to generate it "
                    f"exceeds the context length {self.max_sequence_length} "
                    f"(--inference-max-seq-length / --max-position-embeddings)")
        return prompt_tokens

    def generate(self, prompts, tokens_to_generate: int = 30, temperature: float = 1.0,
                 top_k: int = 1, top_p: float = 0.0, return_log_probs: bool = False,
                 seed: int | None = None, add_bos: bool = False,
                 prompt_tokens: list | None = None, top_n_logprobs: int = 0) -> list[Generation]:
        from megatron.core.inference.inference_request import InferenceRequest

        from megatron_moe.compat.inference import generate, sampling_params

        if prompt_tokens is None:
            prompt_tokens = self.tokenize_prompts(prompts, tokens_to_generate, add_bos)
        else:  # token ids given (benchmarks): the prompt strings are their detokenization
            prompts = [self.tokenizer.detokenize(list(t)) for t in prompt_tokens]
        params = sampling_params(temperature=temperature, top_k=top_k, top_p=top_p,
                                 return_log_probs=return_log_probs,
                                 num_tokens_to_generate=tokens_to_generate,
                                 **({"top_n_logprobs": top_n_logprobs} if top_n_logprobs else {}))
        controller = self.engine.controller
        controller.sampling_rng.manual_seed(self.args.seed if seed is None else seed)
        requests = [InferenceRequest(request_id=self.engine.get_new_request_id(), prompt=p,
                                     prompt_tokens=t, sampling_params=params)
                    for p, t in zip(prompts, prompt_tokens)]
        done = generate(self.engine, requests)
        out = []
        for prompt, req in zip(prompts, done):
            tokens = [int(t) for t in req.generated_tokens.tolist()]
            completion = self._completion(req.prompt_tokens, tokens)
            out.append(Generation(
                prompt=prompt, text=prompt + completion, completion=completion,
                prompt_tokens=list(req.prompt_tokens), tokens=tokens,
                finish_reason=finish_reason(tokens, tokens_to_generate),
                log_probs=list(req.generated_log_probs) if return_log_probs else None,
                prompt_log_probs=list(req.prompt_log_probs) if return_log_probs else None,
                top_n=list(req.generated_top_n_logprobs or []) if top_n_logprobs else None,
                prompt_top_n=list(req.prompt_top_n_logprobs or []) if top_n_logprobs else None,
                request_id=req.request_id, generated_text=req.generated_text,
                tpot=[float(t) for t in (req.tpot or [])]))
        return out

    def _completion(self, prompt_tokens, tokens) -> str:
        # Detokenize in context (sentencepiece/BPE spacing depends on the previous piece), then
        # cut the detokenized prompt off.
        head = self.tokenizer.detokenize(list(prompt_tokens))
        full = self.tokenizer.detokenize(list(prompt_tokens) + list(tokens))
        return full[len(head):] if full.startswith(head) else self.tokenizer.detokenize(tokens)
