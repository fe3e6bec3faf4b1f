"""Rank functions for the inference tests (spawned by megatron_moe.runtime.local_ranks.run_distributed)."""

from __future__ import annotations

import contextlib
import io
import threading


def train_and_capture(rank, world_size, argv):
    """pretrain() on this rank; returns the text it printed (the validation line among it)."""
    import pretrain_gpt_moe
    from megatron.core.enums import ModelType

    from megatron_moe.training.loop import pretrain

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        pretrain(pretrain_gpt_moe.train_valid_test_datasets_provider,
                 pretrain_gpt_moe.model_provider, ModelType.encoder_or_decoder,
                 pretrain_gpt_moe.forward_step, argv=argv)
    return out.getvalue()


def _args(argv, tool_args, **kw):
    from megatron_moe.inference.arguments import parse_inference_args

    return parse_inference_args(argv, tool_args, prog="test", **kw)


def evaluate_then_serve_case(rank, world_size, argv, prompt, tokens):
    """tools/evaluate.py's evaluate() in-process, then (same ranks, same model) the REST server
    with every rank generating: rank 0 serves a client on 127.0.0.1, the others follow its
    broadcasts. Returns (evaluate's result, the text it printed, the server's answers)."""
    from megatron_moe.inference.engine import TextGenerator
    from tools import evaluate as ev

    args = _args(argv, ev.add_evaluate_args, need_data=True, keep_batch_size=True)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        result = ev.evaluate(args)
    from megatron_moe.runtime import global_vars

    args.inference_max_requests, args.inference_max_seq_length = 4, None
    gen = TextGenerator(result.pop("model"), global_vars.get_tokenizer(), args)
    return result, out.getvalue(), _serve(gen, prompt, tokens, client=rank == 0)


def _logits(model, tokens):
    import torch

    with torch.no_grad():
        ids = torch.tensor([tokens])
        pos = torch.arange(len(tokens)).unsqueeze(0)
        # numpy: pickled by value (torch tensors would travel as shared-memory handles)
        return model(ids, pos, None, runtime_gather_output=True).numpy().copy()


def generation_suite(rank, world_size, argv, prompts, tokens, ring_slots, link_gbps):
    """One process, one model: greedy generation resident (K=0), then through the ring memory
    (K slots, NaN fill, emulated link), then a ring that skips its waits (must produce NaN), then
    the REST server answering a client on 127.0.0.1."""
    import torch

    from megatron_moe.inference.engine import TextGenerator, setup_model
    from megatron_moe.inference.ring_memory import RingMemory
    from tools.generate import add_text_generate_args

    args = _args(argv, add_text_generate_args)
    model, tokenizer, _ = setup_model(args)
    gen = TextGenerator(model, tokenizer, args)
    probe = gen.tokenize(prompts[0])
    out = {"tokens_per_layer_probe": probe}

    def run():
        res = gen.generate(prompts, tokens_to_generate=tokens, return_log_probs=True)
        return [dict(text=r.text, tokens=r.tokens, log_probs=r.log_probs) for r in res]

    out["resident"] = run()
    out["resident_logits"] = _logits(model, probe)

    ring = RingMemory(model, slots=ring_slots, link_gbps=link_gbps, debug=True)
    out["ring"] = run()
    out["ring_logits"] = _logits(model, probe)
    out["ring_stats"] = ring.stats()
    ring.close()
    out["after_close_logits"] = _logits(model, probe)

    # "Active experts only": copies the routed experts (predicted from the previous step,
    # misses fetched before the experts run); the same tokens and log probs, fewer bytes.
    ring = RingMemory(model, slots=ring_slots, link_gbps=link_gbps, debug=True, experts="active")
    out["active"] = run()
    out["active_stats"] = ring.stats()
    ring.close()

    # Mutation: a ring that does not wait for its copies computes on NaN-filled slots.
    ring = RingMemory(model, slots=ring_slots, link_gbps=link_gbps, debug=True)
    ring._wait = lambda handle: None  # the wait before a layer and before a missed expert
    out["no_wait_logits"] = _logits(model, probe)
    ring.close()

    out["server"] = _serve(gen, prompts[0], tokens)
    return out


def _serve(gen, prompt, tokens, client=True):
    from megatron_moe.inference.server import GenerationServer
    from tools.text_generation_cli import put

    server = GenerationServer(gen, host="127.0.0.1", port=0, log=lambda *_: None)
    if not client:  # a follower rank: generate whatever rank 0 broadcasts, until it stops
        server.serve_forever()
        return None
    host, port = server.address[:2]
    url = f"{host}:{port}"
    answers = {}

    def client():
        try:
            answers["ok"] = put(url, {"prompts": [prompt], "tokens_to_generate": tokens,
                                      "top_k": 1, "logprobs": True}, timeout=120)
            answers["malformed"] = put(url, b'{"prompts": ["a", }', timeout=30)
            answers["no_prompts"] = put(url, {"tokens_to_generate": 3}, timeout=30)
        finally:
            server.stop()

    thread = threading.Thread(target=client, daemon=True)
    thread.start()
    server.serve_forever()
    thread.join(timeout=30)
    return {"host": host, **answers}



def generate_then_forward_case(rank, world_size, mutate):
    """A TextGenerator generates, then the same model runs a plain forward (as evaluation or a
    logits call after serving does: runtime_gather_output left at its default). Returns the
    flag megatron-core's InferenceMode read at each forward (None where the version has no such
    flag), how often compat's engine_inference_mode was entered, and the plain forward's logits
    shape or its AssertionError. ``mutate``: engine_inference_mode does nothing (the engine as it
    comes)."""
    import contextlib

    import torch

    from megatron_moe.arguments import parse_args
    from megatron_moe.compat import inference as compat
    from megatron_moe.inference.engine import TextGenerator
    from megatron_moe.models.builder import gpt_model_provider
    from megatron_moe.runtime.initialize import initialize_distributed
    from megatron_moe.training.loop import _build_tokenizer

    entered = []
    original = compat.engine_inference_mode

    @contextlib.contextmanager
    def counted():
        entered.append(1)
        with (contextlib.nullcontext() if mutate else original()):
            yield

    compat.engine_inference_mode = counted
    args = parse_args(("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
                       "--max-position-embeddings 32 --num-experts 4 --moe-router-topk 2 "
                       "--disable-bias-linear --micro-batch-size 1 --train-iters 1 --lr 0 "
                       "--mock-data --tokenizer-type NullTokenizer --vocab-size 255").split(),
                      world_size=world_size)
    args.inference_max_requests, args.inference_max_seq_length = 2, None
    initialize_distributed(args)
    tokenizer = _build_tokenizer(args)
    model = gpt_model_provider(args)
    model.eval()
    flag = compat._inference_mode_flag()
    seen = []
    model.register_forward_pre_hook(
        lambda *_: seen.append(None if flag is None else flag.is_active()))
    [generated] = TextGenerator(model, tokenizer, args).generate(
        None, tokens_to_generate=3, top_k=1, prompt_tokens=[[5, 17, 42]])
    during = list(seen)
    ids = torch.tensor([[5, 17, 42, 8]])
    try:
        with torch.no_grad():
            forward = tuple(model(ids, torch.arange(4).unsqueeze(0), None).shape)
    except AssertionError as e:
        forward = f"AssertionError: {e}"
    return dict(tokens=generated.tokens, during=during, after=seen[len(during):],
                entered=len(entered), forward=forward)
