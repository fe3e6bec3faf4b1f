"""Rank function of tests/test_inference_tools.py: the inference tools' own main() functions, as
their command lines run them, resident and with --ring-memory-slots, in one process."""

from __future__ import annotations

import contextlib
import io
import threading


def _main(fn, argv, skip_binds=False):
    """(exit code, stdout) of a tool's main(argv); ``skip_binds``: the ring memory leaves its
    binds out (the mutation: the layers compute on their placeholders)."""
    from megatron_moe.inference.ring_memory import RingMemory

    out = io.StringIO()
    bind_slot = RingMemory._bind_slot
    if skip_binds:
        RingMemory._bind_slot = lambda self, layer: None
    try:
        with contextlib.redirect_stdout(out):
            rc = fn(argv)
    except Exception as exc:  # a mutation may also fail loudly
        if not skip_binds:
            raise
        rc = f"{type(exc).__name__}: {exc}"
    finally:
        RingMemory._bind_slot = bind_slot
    return rc, out.getvalue()


def _serve(argv, prompt, tokens):
    """run_text_generation_server.main(argv) with a client on 127.0.0.1: (exit code, answer)."""
    from megatron_moe.inference import server as server_module
    from tools import run_text_generation_server as srv
    from tools.text_generation_cli import put

    started, answer = [], {}
    init = server_module.GenerationServer.__init__

    def record(self, *a, **k):
        init(self, *a, **k)
        started.append(self)

    def client():
        for _ in range(6000):  # the model loads first
            if started:
                break
            threading.Event().wait(0.05)
        server = started[0]
        try:
            host, port = server.address[:2]
            answer["ok"] = put(f"{host}:{port}", {"prompts": [prompt], "tokens_to_generate": tokens,
                                                 "top_k": 1, "logprobs": True}, timeout=120)
        finally:
            server.stop()

    server_module.GenerationServer.__init__ = record
    thread = threading.Thread(target=client, daemon=True)
    thread.start()
    try:
        rc, _ = _main(srv.main, argv + ["--host", "127.0.0.1", "--port", "0"])
    finally:
        server_module.GenerationServer.__init__ = init
    thread.join(timeout=60)
    return rc, answer.get("ok")


def tools_suite(rank, world_size, load, prompts, tokens, ring):
    """tools/generate.py, the server and tools/evaluate.py at EP=1, resident and through the ring
    (``ring``: its flags); plus generate.py through a ring that skips its binds (mutation)."""
    from tools import evaluate, generate

    common = ["--load", load, "--use-checkpoint-args", "--expert-model-parallel-size", "1"]
    gen = common + ["--num-tokens-to-generate", str(tokens), "--return-log-probs",
                    "--prompts", *prompts]
    # evaluation first: megatron-core 0.19's engine leaves its process-wide InferenceMode flag set
    # after generating, and GPTModel's loss path then refuses (each tool has its own process)
    return {
        "evaluate": _main(evaluate.main, common),
        "evaluate_ring": _main(evaluate.main, common + ring),
        "generate": _main(generate.main, gen),
        "generate_ring": _main(generate.main, gen + ring),
        "generate_ring_skip_bind": _main(generate.main, gen + ring, skip_binds=True),
        "server": _serve(common, prompts[0], tokens),
        "server_ring": _serve(common + ring, prompts[0], tokens),
    }
