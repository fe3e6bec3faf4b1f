#!/usr/bin/env python
"""Serve a GPT-MoE checkpoint over Megatron-LM's REST interface (PUT /api, POST /completions).

    python tools/run_text_generation_server.py --load CKPT --use-checkpoint-args --port 5000
    torchrun --nproc_per_node 2 tools/run_text_generation_server.py --load CKPT \
        --use-checkpoint-args --expert-model-parallel-size 2
    curl -X PUT http://127.0.0.1:5000/api -H 'Content-Type: application/json' \
        -d '{"prompts": ["Hello"], "tokens_to_generate": 16}'
    python tools/text_generation_cli.py 127.0.0.1:5000
    lm_eval --model local-completions --tasks lambada_openai \
        --model_args base_url=http://127.0.0.1:5000/v1/completions,model=megatron-moe

Binds to 127.0.0.1 unless --host says otherwise (Megatron-LM binds every interface; this server
has no authentication, so exposing it is an explicit choice). Request fields and answers:
megatron_moe/inference/server.py and docs/inference.md.
"""

from __future__ import annotations

import os
import signal
import sys

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tools.generate import add_text_generate_args, validate_generation_args  # noqa: E402


def add_server_args(parser):
    add_text_generate_args(parser)
    g = parser.add_argument_group("text generation server")
    g.add_argument("--port", type=int, default=5000, help="Port for the server to listen on.")
    g.add_argument("--host", default="127.0.0.1",
                   help="Address to bind (default 127.0.0.1: this machine only).")
    return parser


def _validate(args):
    validate_generation_args(args, need_prompts=False)
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in [0, 65535] (got {args.port})")


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if "-h" in argv or "--help" in argv:
        import argparse

        p = argparse.ArgumentParser(prog="run_text_generation_server.py",
                                    description=__doc__.split("\n\n")[0],
                                    epilog="Every pretrain_gpt_moe.py flag is accepted as well; "
                                           "--use-checkpoint-args reads the model flags from the "
                                           "checkpoint.")
        p.add_argument("--load", required=True)
        p.add_argument("--use-checkpoint-args", action="store_true")
        add_server_args(p)
        p.parse_args(["--help"])

    os.environ.setdefault("TQDM_DISABLE", "1")  # no progress bar per request in the server log
    from megatron_moe.compat import install_megatron_core_stubs, quiet_known_warnings

    quiet_known_warnings()
    install_megatron_core_stubs()
    from megatron_moe.inference.arguments import parse_inference_args

    args = parse_inference_args(argv, add_server_args, prog="run_text_generation_server.py",
                                validate_tool=_validate)

    from megatron_moe.inference.engine import TextGenerator, setup_model, single_process_port
    from megatron_moe.inference.ring_memory_args import attach_ring_memory
    from megatron_moe.inference.server import GenerationServer

    single_process_port()
    model, tokenizer, _ = setup_model(args)
    ring = attach_ring_memory(model, args)
    server = GenerationServer(TextGenerator(model, tokenizer, args), host=args.host, port=args.port)
    received = _stop_on_signals(server)
    if server.httpd is not None:
        host, port = server.address[:2]
        print(f" * serving {args.load} on http://{host}:{port}/api (PUT)", flush=True)
        print(f" * OpenAI completions on http://{host}:{port}/v1/completions (POST; also "
              f"/completions)", flush=True)
    try:
        server.serve_forever()
    finally:
        if ring is not None:
            ring.close()
    if server.httpd is not None:
        why = signal.Signals(received[0]).name if received else "stopped"
        print(f" * server shut down ({why})", flush=True)
    return 0


def _stop_on_signals(server):
    """SIGTERM/SIGINT end the serving loop after the request in progress (rank 0 broadcasts the
    stop; the other ranks wait for it), so the server exits 0 with one line, no stack dump."""
    received = []

    def handler(signum, frame):
        if not received:
            received.append(signum)
            if server.httpd is not None:
                server.stop()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, handler)
    return received


if __name__ == "__main__":
    sys.exit(main())
