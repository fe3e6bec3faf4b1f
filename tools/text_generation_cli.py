#!/usr/bin/env python
"""Client of tools/run_text_generation_server.py (Megatron-LM's text_generation_cli.py).

    python tools/text_generation_cli.py 127.0.0.1:5000                  # interactive
    python tools/text_generation_cli.py 127.0.0.1:5000 --prompt "Hello" --tokens-to-generate 16

Standard library only (urllib).
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.request


def put(url: str, payload, timeout: float = 300.0) -> tuple[int, object]:
    """PUT ``payload`` (a dict, or raw bytes as they are) to the server: (HTTP status, answer)."""
    if not url.startswith(("http://", "https://")):
        url = "http://" + url
    if not url.rstrip("/").endswith("/api"):
        url = url.rstrip("/") + "/api"
    data = payload if isinstance(payload, bytes) else json.dumps(payload).encode("utf-8")
    req = urllib.request.Request(url, data=data, method="PUT",
                                 headers={"Content-Type": "application/json; charset=UTF-8"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read().decode("utf-8"))
    except urllib.error.HTTPError as err:
        text = err.read().decode("utf-8", "replace")
        try:
            return err.code, json.loads(text)
        except json.JSONDecodeError:
            return err.code, text


def _message(answer):
    """The server's error message: Megatron-LM's ``message`` field of the error object."""
    return answer.get("message", answer) if isinstance(answer, dict) else answer


def main(argv=None):
    p = argparse.ArgumentParser(prog="text_generation_cli.py", description=__doc__.split("\n\n")[0])
    p.add_argument("url", help="host:port of the server (e.g. 127.0.0.1:5000)")
    p.add_argument("--prompt", default=None, help="Ask once and exit (default: interactive).")
    p.add_argument("--tokens-to-generate", type=int, default=64)
    args = p.parse_args(argv)
    if args.prompt is not None:
        status, answer = put(args.url, {"prompts": [args.prompt],
                                        "tokens_to_generate": args.tokens_to_generate})
        if status != 200:
            print(f"error {status}: {_message(answer)}", file=sys.stderr)
            return 1
        print(answer["text"][0])
        return 0
    while True:
        try:
            sentence = input("Enter prompt: ")
            tokens = int(input("Enter number tokens output: "))
        except (EOFError, KeyboardInterrupt):
            return 0
        except ValueError:
            print("the number of tokens must be an integer")
            continue
        status, answer = put(args.url, {"prompts": [sentence], "tokens_to_generate": tokens})
        if status != 200:
            print(f"Error {status}: {_message(answer)}")
        else:
            print(f"Megatron Response: {answer['text'][0]}")


if __name__ == "__main__":
    sys.exit(main())
