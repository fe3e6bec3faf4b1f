"""Megatron-LM's text-generation REST interface, on Flask (served by Werkzeug's threaded server).

* ``PUT /api`` with a JSON object ``{"prompts": [...], "tokens_to_generate": N, "temperature": ...,
  "top_k": ..., "top_p": ..., "logprobs": ..., "add_BOS": ..., "random_seed": ...}`` is answered with
  ``{"text": [...], "tokens": [...], "logprobs": [...]}`` (Megatron-LM's field names, defaults and
  checks: megatron/core/inference/text_generation_server/text_generation_server.py).
* ``POST /completions`` (also ``/v1/completions``): OpenAI's completions API as Megatron-LM's
  server offers it (endpoints/completions.py), which is what lm-evaluation-harness's
  ``local-completions`` model and the ``openai`` client speak: ``prompt`` as text, token ids, or a
  list of either; ``max_tokens temperature top_p top_k logprobs echo stop seed n``; answered with
  ``choices[].text``, ``choices[].logprobs`` (``tokens token_logprobs top_logprobs text_offset``),
  ``finish_reason`` and ``usage``. Token ids are generated from as given (Megatron-LM detokenizes
  and re-tokenizes them, which can change them). Unlike Megatron-LM, top log probs are returned
  with generated tokens too (lm-evaluation-harness asks for ``logprobs=1, max_tokens=1, echo``).
* ``GET /tokenizer_info``, ``POST /tokenize``, ``POST /detokenize``: vLLM's tokenizer endpoints,
  through which lm-evaluation-harness (``tokenizer_backend=remote``, auto-detected) tokenizes
  with the checkpoint's own tokenizer, so no Hugging Face tokenizer is needed.

Every error is a 4xx (5xx if generation itself fails) with a JSON object carrying Megatron-LM's
``message`` (what its tools/text_generation_cli.py prints) and OpenAI's ``error`` object (what the
``openai`` client raises from): ``{"message": m, "error": {"message": m, "type":
"invalid_request_error", "param": field, "code": null}}``.

Why Flask: it is Megatron-LM's own choice, well kept, and gives routing, JSON bodies, the body-size
limit (413) and per-request threads; the parsing and checks below are the only hand-written part.

Every rank takes part in each generation (MoE all-to-alls, TP/PP collectives): rank 0 serves HTTP,
validates a request, and hands it to its main thread, which broadcasts it to all ranks; the other
ranks wait in that broadcast. While idle, rank 0 broadcasts a keep-alive every
``KEEPALIVE_S`` seconds so the waiting ranks never reach the process-group timeout.
"""

from __future__ import annotations

import json
import queue
import threading
import time
import uuid

KEEPALIVE_S = 30.0
MAX_PROMPTS = 128
MAX_BODY_BYTES = 16 * 1024 * 1024
MAX_TOP_LOGPROBS = 20

# Megatron-LM fields this server does not implement; asking for them (non-default) is a 400.
_UNSUPPORTED = {"stop_on_double_eol": False, "stop_on_eol": False,
                "prevent_newline_after_colon": False, "top_p_decay": 0.0, "top_p_bound": 0.0,
                "stop_token": None, "length_penalty": 1}
_KNOWN = {"prompts", "tokens_to_generate", "logprobs", "temperature", "top_k", "top_p", "add_BOS",
          "random_seed", "no_log"} | set(_UNSUPPORTED)
# OpenAI completions fields: served, accepted when neutral (default value), or ignored (metadata)
_COMPLETIONS = {"prompt", "max_tokens", "temperature", "top_p", "top_k", "logprobs", "echo",
                "stop", "seed", "n", "model", "user", "best_of", "stream", "suffix",
                "frequency_penalty", "presence_penalty", "logit_bias"}
_NEUTRAL = {"best_of": 1, "stream": False, "suffix": None, "frequency_penalty": 0,
            "presence_penalty": 0, "logit_bias": None}


class RequestError(ValueError):
    """A request that cannot be served; the message goes back with HTTP 400 (``status``)."""

    def __init__(self, message: str, param: str | None = None, status: int = 400):
        super().__init__(message)
        self.param = param
        self.status = status


def error_body(message: str, param: str | None = None, kind: str = "invalid_request_error"):
    """Megatron-LM's ``message`` + OpenAI's ``error`` object."""
    return {"message": message,
            "error": {"message": message, "type": kind, "param": param, "code": None}}


def _load_json(body: bytes) -> dict:
    try:
        req = json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise RequestError(f"malformed JSON: {exc}") from None
    if not isinstance(req, dict):
        raise RequestError("the request body must be a JSON object")
    return req


def _field(req, name, default, kinds, check, message):
    """req[name] (or default) if it has one of ``kinds`` (bool is not an int) and passes check."""
    value = req.get(name, default)
    if value is default:
        return value
    if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds) \
            or not check(value):
        raise RequestError(message, param=name)
    return value


def parse_request(body: bytes) -> dict:
    """Megatron-LM's checks of a PUT /api body -> generation keyword arguments."""
    req = _load_json(body)
    if "max_len" in req:
        raise RequestError("max_len is no longer used.  Replace with tokens_to_generate", "max_len")
    if "sentences" in req:
        raise RequestError("sentences is no longer used.  Replace with prompts", "sentences")
    if "beam_width" in req:
        raise RequestError("Beam search is no longer supported.", "beam_width")
    if "prompts" not in req:
        raise RequestError("prompts argument required", "prompts")
    unknown = sorted(set(req) - _KNOWN)
    if unknown:
        raise RequestError(f"unknown field(s): {', '.join(unknown)}", unknown[0])
    prompts = req["prompts"]
    if not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts):
        raise RequestError("prompts is not a list of strings", "prompts")
    if not prompts:
        raise RequestError("prompts is empty", "prompts")
    if len(prompts) > MAX_PROMPTS:
        raise RequestError(f"Maximum number of prompts is {MAX_PROMPTS}", "prompts")

    tokens = _field(req, "tokens_to_generate", 64, (int,), lambda v: v >= 0,
                    "tokens_to_generate must be an integer greater than or equal to 0")
    logprobs = _field(req, "logprobs", False, (bool,), lambda v: True,
                      "logprobs must be a boolean value")
    if tokens == 0 and not logprobs:
        raise RequestError("tokens_to_generate=0 implies logprobs should be True", "logprobs")
    temperature = _field(req, "temperature", 1.0, (int, float), lambda v: 0.0 < v <= 100.0,
                         "temperature must be a positive number less than or equal to 100.0")
    top_k = _field(req, "top_k", 0, (int,), lambda v: 0 <= v <= 1000,
                   "top_k must be equal to or greater than 0 and less than or equal to 1000")
    top_p = _field(req, "top_p", 0.0, (int, float), lambda v: 0.0 <= v <= 1.0,
                   "top_p must be less than or equal to 1.0")
    if top_p > 0.0 and top_k > 0:
        raise RequestError("cannot set both top-k and top-p samplings.", "top_p")
    add_bos = _field(req, "add_BOS", False, (bool,), lambda v: True,
                     "add_BOS must be a boolean value")
    if any(len(p) == 0 for p in prompts) and not add_bos:
        raise RequestError("Empty prompts require add_BOS=true", "prompts")
    seed = _field(req, "random_seed", -1, (int,), lambda v: True, "random_seed must be integer")
    if "random_seed" in req and seed < 0:
        raise RequestError("random_seed must be a positive integer", "random_seed")
    _field(req, "no_log", False, (bool,), lambda v: True, "no_log must be a boolean value")
    for name, default in _UNSUPPORTED.items():
        if name in req and req[name] != default:
            raise RequestError(f"{name} is not supported by this server", name)
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


# ------------------------------------------------------------------------------ /completions
def _prompts(value, vocab_size: int):
    """OpenAI's prompt forms -> [str | [ids]]: a string, a list of strings, one list of token ids,
    or a list of token-id lists."""
    def ids_ok(ids):
        return ids and all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size
                           for t in ids)

    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value:
        if all(isinstance(p, str) for p in value):
            return list(value)
        if all(isinstance(t, int) and not isinstance(t, bool) for t in value):
            if not ids_ok(value):
                raise RequestError(f"prompt: token ids must be in [0, {vocab_size})", "prompt")
            return [list(value)]
        if all(isinstance(p, list) for p in value):
            if not all(ids_ok(p) for p in value):
                raise RequestError(f"prompt: every token-id list must be non-empty with ids in "
                                   f"[0, {vocab_size})", "prompt")
            return [list(p) for p in value]
    raise RequestError("prompt must be a string, a list of strings, a list of token ids or a "
                       "list of token-id lists (non-empty)", "prompt")


def parse_completions(body: bytes, vocab_size: int) -> dict:
    """OpenAI's (and Megatron-LM's) completions fields -> a request description, checked."""
    req = _load_json(body)
    unknown = sorted(set(req) - _COMPLETIONS)
    if unknown:
        raise RequestError(f"unknown field(s): {', '.join(unknown)}", unknown[0])
    if "prompt" not in req:
        raise RequestError("prompt argument required", "prompt")
    prompts = _prompts(req["prompt"], vocab_size)
    for name, neutral in _NEUTRAL.items():
        if req.get(name, neutral) not in (neutral, None):
            raise RequestError(f"{name}={req[name]!r} is not supported by this server", name)
    max_tokens = _field(req, "max_tokens", 16, (int,), lambda v: v >= 0,
                        "max_tokens must be an integer greater than or equal to 0")
    temperature = _field(req, "temperature", 1.0, (int, float), lambda v: 0.0 <= v <= 100.0,
                         "temperature must be a number in [0, 100] (0: greedy)")
    top_p = _field(req, "top_p", 1.0, (int, float), lambda v: 0.0 <= v <= 1.0,
                   "top_p must be a number in [0, 1]")
    top_k = _field(req, "top_k", 0, (int,), lambda v: 0 <= v <= 1000,
                   "top_k must be an integer in [0, 1000]")
    logprobs = req.get("logprobs")
    if logprobs is not None:
        logprobs = _field(req, "logprobs", None, (int,), lambda v: 0 <= v <= MAX_TOP_LOGPROBS,
                          f"logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}] or null")
    echo = _field(req, "echo", False, (bool,), lambda v: True, "echo must be a boolean value")
    stop = req.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is None:
        stop = []
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop) or len(stop) > 4:
        raise RequestError("stop must be a string or a list of at most 4 strings", "stop")
    seed = _field(req, "seed", None, (int,), lambda v: v >= 0,
                  "seed must be an integer greater than or equal to 0")
    n = _field(req, "n", 1, (int,), lambda v: v >= 1, "n must be an integer greater than 0")
    if len(prompts) * n > MAX_PROMPTS:
        raise RequestError(f"prompts x n must be at most {MAX_PROMPTS}", "n")
    if max_tokens == 0 and not echo:
        raise RequestError("max_tokens=0 requires echo=true (nothing to return)", "max_tokens")
    top_p = 0.0 if top_p >= 1.0 else float(top_p)   # 1.0: the whole distribution (no top-p)
    if temperature == 0:  # OpenAI's greedy: megatron-core samples greedily with top-k 1
        temperature, top_k, top_p = 1.0, 1, 0.0
    if top_p > 0.0 and top_k > 0:
        raise RequestError("cannot set both top_k and top_p", "top_p")
    return dict(prompts=prompts, max_tokens=max_tokens, temperature=float(temperature),
                top_k=top_k, top_p=top_p, logprobs=logprobs, echo=echo, stop=stop, seed=seed,
                n=n, model=req.get("model") if isinstance(req.get("model"), str) else None)


def _pieces(tokenizer, ids, window: int = 16):
    """Per-token text and character offsets such that the texts concatenate to the sequence's
    text. Each token is decoded in context (sentencepiece/BPE spacing depends on the previous
    pieces): the decoding of the last ``window`` tokens up to it minus that of the same tokens
    without it, so the cost stays linear in the length. A token whose decoding is not such a
    continuation (part of a UTF-8 character) gets its own decoding."""
    texts, offsets, pos = [], [], 0
    for i in range(len(ids)):
        context = list(ids[max(0, i - window):i])
        before = tokenizer.detokenize(context) if context else ""
        cur = tokenizer.detokenize(context + [ids[i]])
        text = cur[len(before):] if cur.startswith(before) else tokenizer.detokenize([ids[i]])
        texts.append(text)
        offsets.append(pos)
        pos += len(text)
    return texts, offsets


def completion_choices(tokenizer, spec, results) -> tuple[list, dict]:
    """Generations -> OpenAI's choices (text, logprobs, finish_reason) and usage."""
    choices = []
    prompt_tokens = completion_tokens = 0
    for index, r in enumerate(results):
        prompt_ids = list(r.prompt_tokens)
        gen_ids = list(r.tokens)  # an EOD that ended generation is not among them
        prompt_tokens += len(prompt_ids)
        completion_tokens += len(gen_ids)
        ids = prompt_ids + gen_ids
        texts, offsets = _pieces(tokenizer, ids)
        full = "".join(texts)
        start = 0 if spec["echo"] else len("".join(texts[:len(prompt_ids)]))
        first = 0 if spec["echo"] else len(prompt_ids)
        end = len(full)
        gen_start = len("".join(texts[:len(prompt_ids)]))
        cuts = [full.find(s, gen_start) for s in spec["stop"] if s]
        cuts = [c for c in cuts if c >= 0]
        finish = r.finish_reason  # "stop" at EOD, "length" when max_tokens ran out
        if cuts:
            end, finish = min(cuts), "stop"
        last = len(ids)  # log probs: every token up to a stop string
        if cuts:
            last = first
            while last < len(ids) and offsets[last] < end:
                last += 1
        choice = {"index": index, "text": full[start:end], "logprobs": None,
                  "finish_reason": finish}
        if spec["logprobs"] is not None:
            lps = [None] + list(r.prompt_log_probs or []) + list(r.log_probs or [])
            tops = None
            if spec["logprobs"] > 0:
                tops = [None] + list(r.prompt_top_n or []) + list(r.top_n or [])
                tops += [None] * (len(ids) - len(tops))
                tops = [dict(t) if t is not None else None for t in tops]
            choice["logprobs"] = {
                "tokens": texts[first:last],
                "token_logprobs": [None if v is None else float(v) for v in lps[first:last]],
                "top_logprobs": tops[first:last] if tops is not None else None,
                "text_offset": [o - start for o in offsets[first:last]],
            }
        choices.append(choice)
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
             "total_tokens": prompt_tokens + completion_tokens}
    return choices, usage


# ------------------------------------------------------------------------------ the server
class _Work:
    def __init__(self, kind, kwargs, spec=None):
        self.kind = kind
        self.kwargs = kwargs
        self.spec = spec
        self.done = threading.Event()
        self.result = None
        self.error = None
        self.error_status = 500


class GenerationServer:
    """HTTP on rank 0; generation on every rank through ``serve_forever``'s broadcast loop."""

    def __init__(self, generator, host: str = "127.0.0.1", port: int = 5000, log=None):
        import torch.distributed as dist

        self.generator = generator
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.log = log or (lambda line: print(line, flush=True))
        self.work: queue.Queue = queue.Queue()
        self.httpd = None
        self._stopping = threading.Event()
        if self.rank == 0:
            from werkzeug.serving import WSGIRequestHandler, make_server

            server = self

            class Handler(WSGIRequestHandler):
                def log(self, type, message, *args):  # one line per request via our log
                    server.log(f" [server] {self.address_string()} {message % args}")

            self.app = self._build_app()
            self.httpd = make_server(host, port, self.app, threaded=True,
                                     request_handler=Handler)
            self.httpd.daemon_threads = True
            self.address = self.httpd.server_address

    # --- rank 0, HTTP threads --------------------------------------------------------------------
    def _submit(self, kind, kwargs, spec=None):
        if self._stopping.is_set():
            raise RequestError("the server is shutting down", status=503)
        item = _Work(kind, kwargs, spec)
        self.work.put(item)
        item.done.wait()
        if item.error is not None:
            raise RequestError(item.error, status=item.error_status)
        return item.result

    def _vocab_size(self):
        return int(self.generator.tokenizer.vocab_size)

    def _bytes_per_token(self):
        """The most UTF-8 bytes one token can stand for, an upper bound: the longest vocabulary
        entry's bytes (a byte-level or sentencepiece entry spells a byte in 1-6 bytes) x 4 (a
        normaliser such as NFKC maps a character of up to 4 bytes to 1). None when the tokenizer
        lists no vocabulary (NullTokenizer)."""
        try:
            return self._token_bytes
        except AttributeError:
            try:
                vocab = self.generator.tokenizer.vocab
                self._token_bytes = 4 * max(len(str(piece).encode("utf-8")) for piece in vocab)
            except (AttributeError, NotImplementedError, TypeError, ValueError):
                self._token_bytes = None
            return self._token_bytes

    def _check_prompt_bytes(self, prompts, budget, field, param):
        """Before tokenization: a text prompt longer in bytes than any prompt that fits the
        context can be is refused without tokenizing it (a 16 MiB body would hold the tokenizer
        for seconds to minutes). The token count is checked after tokenization."""
        per_token = self._bytes_per_token()
        if per_token is None:
            return
        limit = self.generator.max_sequence_length
        most = max(limit - budget, 1) * per_token
        for i, prompt in enumerate(prompts):
            size = len(prompt.encode("utf-8")) if isinstance(prompt, str) else 0
            if size > most:
                raise RequestError(
                    f"prompt {i} has {size} bytes; with {field}={budget} a prompt must fit in "
                    f"{max(limit - budget, 0)} tokens of the context length {limit}, which is "
                    f"at most {most} bytes with this tokenizer (--inference-max-seq-length / "
                    f"--max-position-embeddings)", param)

    def _check_lengths(self, prompt_tokens, budget, field):
        limit = self.generator.max_sequence_length
        for i, tokens in enumerate(prompt_tokens):
            if len(tokens) + budget > limit:
                raise RequestError(
                    f"prompt {i} has {len(tokens)} tokens; with {field}={budget} it exceeds the "
                    f"model's context length {limit} (--inference-max-seq-length / "
                    f"--max-position-embeddings)", "prompt")

    def _token_name(self, token_id):
        tok = self.generator.tokenizer
        if token_id is None:
            return None
        try:
            inv = self._inv_vocab
        except AttributeError:
            try:
                inv = self._inv_vocab = tok.inv_vocab
            except (AttributeError, NotImplementedError):
                inv = self._inv_vocab = {}
        return inv.get(token_id) or tok.detokenize([token_id])

    def _build_app(self):
        from flask import Flask, jsonify, request
        from werkzeug.exceptions import HTTPException

        server = self
        app = Flask("megatron_moe.inference.server")
        app.config["MAX_CONTENT_LENGTH"] = MAX_BODY_BYTES

        def fail(message, status=400, param=None):
            kind = "invalid_request_error" if status < 500 else "server_error"
            return jsonify(error_body(message, param, kind)), status

        @app.errorhandler(RequestError)
        def _request_error(exc):
            return fail(str(exc), exc.status, exc.param)

        @app.errorhandler(HTTPException)
        def _http_error(exc):  # 404, 405, 413, a body cut short (client gone), ...
            message = {404: f"no endpoint {request.path}; use PUT /api or POST /completions",
                       413: f"request body larger than {MAX_BODY_BYTES} bytes"}.get(
                exc.code, exc.description or exc.name)
            return fail(message, exc.code)

        def body():
            return request.get_data(cache=False)

        @app.put("/api")
        def api():
            kwargs = parse_request(body())
            server._check_prompt_bytes(kwargs["prompts"], kwargs["tokens_to_generate"],
                                       "tokens_to_generate", "prompts")
            try:  # tokenization and length limits here: a bad prompt never reaches other ranks
                server.generator.tokenize_prompts(kwargs["prompts"], kwargs["tokens_to_generate"],
                                                  kwargs["add_bos"])
            except ValueError as exc:
                raise RequestError(str(exc), "prompts") from None
            return jsonify(server._submit("api", kwargs))

        @app.post("/completions")
        @app.post("/v1/completions")
        def completions():
            spec = parse_completions(body(), server._vocab_size())
            gen = server.generator
            server._check_prompt_bytes(spec["prompts"], spec["max_tokens"], "max_tokens", "prompt")
            prompt_tokens = []
            for i, p in enumerate(spec["prompts"]):
                ids = gen.tokenize(p) if isinstance(p, str) else p
                if not ids:
                    raise RequestError(f"prompt {i} is empty after tokenization", "prompt")
                prompt_tokens.append(ids)
            server._check_lengths(prompt_tokens, spec["max_tokens"], "max_tokens")
            prompt_tokens = [t for t in prompt_tokens for _ in range(spec["n"])]
            kwargs = dict(prompts=None, prompt_tokens=prompt_tokens,
                          tokens_to_generate=spec["max_tokens"], temperature=spec["temperature"],
                          top_k=spec["top_k"], top_p=spec["top_p"], return_log_probs=True,
                          seed=spec["seed"], top_n_logprobs=spec["logprobs"] or 0)
            choices, usage = server._submit("completions", kwargs, spec)
            return jsonify({"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion",
                            "created": int(time.time()), "model": spec["model"] or "megatron-moe",
                            "choices": choices, "usage": usage})

        @app.get("/tokenizer_info")
        def tokenizer_info():
            tok = server.generator.tokenizer

            def special(name):
                try:
                    value = getattr(tok, name)
                except (AttributeError, NotImplementedError):
                    return None
                return server._token_name(value) if isinstance(value, int) and value >= 0 \
                    else None

            return jsonify({"eos_token": special("eod"), "bos_token": special("bos"),
                            "pad_token": special("pad"), "tokenizer_class": type(tok).__name__,
                            "model_max_length": server.generator.max_sequence_length})

        @app.post("/tokenize")
        def tokenize():
            req = _load_json(body())
            text = req.get("prompt")
            if not isinstance(text, str):
                raise RequestError("prompt must be a string", "prompt")
            tokens = server.generator.tokenize(text)
            return jsonify({"tokens": tokens, "count": len(tokens),
                            "max_model_len": server.generator.max_sequence_length})

        @app.post("/detokenize")
        def detokenize():
            req = _load_json(body())
            tokens = req.get("tokens")
            vocab = server._vocab_size()
            if not isinstance(tokens, list) or not all(
                    isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab
                    for t in tokens):
                raise RequestError(f"tokens must be a list of token ids in [0, {vocab})",
                                   "tokens")
            return jsonify({"prompt": server.generator.tokenizer.detokenize(tokens)})

        return app

    # --- every rank, main thread -----------------------------------------------------------------
    def _run(self, kind, kwargs, spec):
        results = self.generator.generate(**kwargs)
        if kind == "api":
            return response(results, kwargs["return_log_probs"])
        return completion_choices(self.generator.tokenizer, spec, results)

    def serve_forever(self, max_requests: int | None = None):
        """Serve until stopped (``stop()``, SIGTERM/SIGINT via ``stop``) or after
        ``max_requests`` generations."""
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
                               (None if item is None else (item.kind, item.kwargs))]
                else:
                    message = [None]
                if dist.is_initialized() and dist.get_world_size() > 1:
                    dist.broadcast_object_list(message, src=0)
                if message[0] == "stop":
                    break
                if message[0] is None:
                    continue  # keep-alive
                kind, kwargs = message[0]
                try:
                    result = self._run(kind, kwargs, item.spec if item is not None else None)
                    if item is not None:
                        item.result = result
                except Exception as exc:  # every rank fails alike; answer 500 and serve on
                    self.log(f" [server] generation failed: {type(exc).__name__}: {exc}")
                    if item is not None:
                        item.error, item.error_status = f"{type(exc).__name__}: {exc}", 500
                finally:
                    if item is not None:
                        item.done.set()
                served += 1
        finally:
            self._stopping.set()
            if self.httpd is not None:
                self.httpd.shutdown()
                self.httpd.server_close()
            while True:  # requests that arrived after the stop: answer them, do not hang
                try:
                    item = self.work.get_nowait()
                except queue.Empty:
                    break
                if item is not _STOP:
                    item.error, item.error_status = "the server is shutting down", 503
                    item.done.set()

    def stop(self):
        """Ask the serving loop (on every rank) to end after the current request. Safe to call
        from a signal handler."""
        self.work.put(_STOP)


_STOP = object()
