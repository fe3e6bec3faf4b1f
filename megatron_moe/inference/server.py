"""Megatron-LM's text-generation REST interface on the standard library's http.server.

``PUT /api`` with a JSON object ``{"prompts": [...], "tokens_to_generate": N, "temperature": ...,
"top_k": ..., "top_p": ..., "logprobs": ..., "add_BOS": ..., "random_seed": ...}`` is answered with
``{"text": [...], "tokens": [...], "logprobs": [...]}`` (Megatron-LM's field names, defaults and
checks: megatron/core/inference/text_generation_server/text_generation_server.py). Bad requests are
answered with HTTP 400 and a one-line message.

Why not Flask (Megatron-LM's choice): it is not a dependency of this project and the interface is
one endpoint; ``ThreadingHTTPServer`` serves it.

Every rank takes part in each generation (MoE all-to-alls, TP/PP collectives): rank 0 serves HTTP,
validates a request, and hands it to its main thread, which broadcasts it to all ranks; the other
ranks wait in that broadcast. While idle, rank 0 broadcasts a keep-alive every
``KEEPALIVE_S`` seconds so the waiting ranks never reach the process-group timeout.
"""

from __future__ import annotations

import json
import queue
import threading
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

KEEPALIVE_S = 30.0
MAX_PROMPTS = 128
MAX_BODY_BYTES = 16 * 1024 * 1024

# Megatron-LM fields this server does not implement; asking for them (non-default) is a 400.
_UNSUPPORTED = {"stop_on_double_eol": False, "stop_on_eol": False,
                "prevent_newline_after_colon": False, "top_p_decay": 0.0, "top_p_bound": 0.0,
                "stop_token": None, "length_penalty": 1}
_KNOWN = {"prompts", "tokens_to_generate", "logprobs", "temperature", "top_k", "top_p", "add_BOS",
          "random_seed", "no_log"} | set(_UNSUPPORTED)


class RequestError(ValueError):
    """A request that cannot be served; the message goes back with HTTP 400."""


def parse_request(body: bytes) -> dict:
    """Megatron-LM's checks of a PUT /api body -> generation keyword arguments."""
    try:
        req = json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise RequestError(f"malformed JSON: {exc}") from None
    if not isinstance(req, dict):
        raise RequestError("the request body must be a JSON object")
    if "max_len" in req:
        raise RequestError("max_len is no longer used.  Replace with tokens_to_generate")
    if "sentences" in req:
        raise RequestError("sentences is no longer used.  Replace with prompts")
    if "beam_width" in req:
        raise RequestError("Beam search is no longer supported.")
    if "prompts" not in req:
        raise RequestError("prompts argument required")
    unknown = sorted(set(req) - _KNOWN)
    if unknown:
        raise RequestError(f"unknown field(s): {', '.join(unknown)}")
    prompts = req["prompts"]
    if not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts):
        raise RequestError("prompts is not a list of strings")
    if not prompts:
        raise RequestError("prompts is empty")
    if len(prompts) > MAX_PROMPTS:
        raise RequestError(f"Maximum number of prompts is {MAX_PROMPTS}")

    def get(name, default, kinds, check, message):
        value = req.get(name, default)
        if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds) \
                or not check(value):
            raise RequestError(message)
        return value

    tokens = get("tokens_to_generate", 64, (int,), lambda v: v >= 0,
                 "tokens_to_generate must be an integer greater than or equal to 0")
    logprobs = get("logprobs", False, (bool,), lambda v: True, "logprobs must be a boolean value")
    if tokens == 0 and not logprobs:
        raise RequestError("tokens_to_generate=0 implies logprobs should be True")
    temperature = get("temperature", 1.0, (int, float), lambda v: 0.0 < v <= 100.0,
                      "temperature must be a positive number less than or equal to 100.0")
    top_k = get("top_k", 0, (int,), lambda v: 0 <= v <= 1000,
                "top_k must be equal to or greater than 0 and less than or equal to 1000")
    top_p = get("top_p", 0.0, (int, float), lambda v: 0.0 <= v <= 1.0,
                "top_p must be less than or equal to 1.0")
    if top_p > 0.0 and top_k > 0:
        raise RequestError("cannot set both top-k and top-p samplings.")
    add_bos = get("add_BOS", False, (bool,), lambda v: True, "add_BOS must be a boolean value")
    if any(len(p) == 0 for p in prompts) and not add_bos:
        raise RequestError("Empty prompts require add_BOS=true")
    seed = get("random_seed", -1, (int,), lambda v: True, "random_seed must be integer")
    if "random_seed" in req and seed < 0:
        raise RequestError("random_seed must be a positive integer")
    get("no_log", False, (bool,), lambda v: True, "no_log must be a boolean value")
    for name, default in _UNSUPPORTED.items():
        if name in req and req[name] != default:
            raise RequestError(f"{name} is not supported by this server")
    return dict(prompts=prompts, tokens_to_generate=tokens, return_log_probs=logprobs,
                temperature=float(temperature), top_k=top_k, top_p=float(top_p), add_bos=add_bos,
                seed=seed if seed >= 0 else None)


def response(results, return_log_probs: bool) -> dict:
    """Megatron-LM's answer: prompt + completion texts, all token ids, and log probs if asked."""
    out = {"text": [r.text for r in results],
           "tokens": [list(r.prompt_tokens) + list(r.tokens) for r in results]}
    if return_log_probs:
        out["logprobs"] = [list(r.prompt_log_probs) + list(r.log_probs) for r in results]
    return out


class _Work:
    def __init__(self, kwargs):
        self.kwargs = kwargs
        self.done = threading.Event()
        self.result = None
        self.error = None


class GenerationServer:
    """HTTP on rank 0; generation on every rank through ``serve_forever``'s broadcast loop."""

    def __init__(self, generator, host: str = "127.0.0.1", port: int = 5000, log=print):
        import torch.distributed as dist

        self.generator = generator
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.log = log
        self.work: queue.Queue = queue.Queue()
        self.httpd = None
        if self.rank == 0:
            self.httpd = ThreadingHTTPServer((host, port), self._handler_class())
            self.httpd.daemon_threads = True
            self.address = self.httpd.server_address

    # --- rank 0, HTTP threads --------------------------------------------------------------------
    def _handler_class(self):
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, fmt, *args):  # one line per request via the server's log
                server.log(f" [server] {self.address_string()} {fmt % args}")

            def _reply(self, status, payload):
                # errors are JSON strings too, as flask-restful sends Megatron-LM's messages
                data = json.dumps(payload).encode("utf-8")
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_PUT(self):
                if self.path.rstrip("/") != "/api":
                    return self._reply(HTTPStatus.NOT_FOUND, f"no endpoint {self.path}; use PUT /api")
                try:
                    length = int(self.headers.get("Content-Length") or 0)
                except ValueError:
                    return self._reply(HTTPStatus.BAD_REQUEST, "bad Content-Length")
                if length > MAX_BODY_BYTES:
                    return self._reply(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, "request too large")
                try:
                    kwargs = parse_request(self.rfile.read(length))
                    # tokenization and length limits: checked here so a bad prompt never
                    # reaches the other ranks
                    server.generator.tokenize_prompts(kwargs["prompts"],
                                                      kwargs["tokens_to_generate"],
                                                      kwargs["add_bos"])
                except ValueError as exc:
                    return self._reply(HTTPStatus.BAD_REQUEST, str(exc))
                item = _Work(kwargs)
                server.work.put(item)
                item.done.wait()
                if item.error is not None:
                    return self._reply(HTTPStatus.INTERNAL_SERVER_ERROR, item.error)
                return self._reply(HTTPStatus.OK, item.result)

            def do_POST(self):
                self._reply(HTTPStatus.METHOD_NOT_ALLOWED, "use PUT /api")

            do_GET = do_POST

        return Handler

    # --- every rank, main thread -----------------------------------------------------------------
    def serve_forever(self, max_requests: int | None = None):
        """Serve until stopped (``stop()``, Ctrl-C) or after ``max_requests`` generations."""
        import torch.distributed as dist

        if self.httpd is not None:
            threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        served = 0
        try:
            while max_requests is None or served < max_requests:
                item = None
                if self.rank == 0:
                    try:
                        item = self.work.get(timeout=KEEPALIVE_S)
                    except queue.Empty:
                        item = None
                    message = ["stop" if item is _STOP else
                               (None if item is None else item.kwargs)]
                else:
                    message = [None]
                if dist.is_initialized() and dist.get_world_size() > 1:
                    dist.broadcast_object_list(message, src=0)
                if message[0] == "stop":
                    break
                if message[0] is None:
                    continue  # keep-alive
                try:
                    results = self.generator.generate(**message[0])
                    if item is not None:
                        item.result = response(results, message[0]["return_log_probs"])
                except Exception as exc:  # every rank fails alike; answer 500 and serve on
                    self.log(f" [server] generation failed: {type(exc).__name__}: {exc}")
                    if item is not None:
                        item.error = f"{type(exc).__name__}: {exc}"
                finally:
                    if item is not None:
                        item.done.set()
                served += 1
        finally:
            if self.httpd is not None:
                self.httpd.shutdown()
                self.httpd.server_close()

    def stop(self):
        """Ask the serving loop (on every rank) to end after the current request."""
        self.work.put(_STOP)


_STOP = object()
