"""The REST server's prompt limits, without a model (Flask's test client, a counting tokenizer):

* a text prompt longer in bytes than any prompt that fits the context is refused with 400 before
  it is tokenized (16 MiB bodies held the tokenizer for seconds); the mutation (no bytes check)
  tokenizes it;
* a prompt within the bytes bound but over the context in tokens is still refused, after
  tokenization, naming its token count;
* finish_reason follows the generation's own (engine.finish_reason: "stop" at EOD).
"""

import json
import os

import pytest

from megatron_moe.inference import server as srv
from megatron_moe.inference.engine import Generation, TextGenerator, finish_reason

CONTEXT = 32


@pytest.fixture
def generator(tmp_path):
    """A TextGenerator's tokenization and length checks over a word-level tokenizer (longest
    entry 4 bytes), counting tokenizer calls; no engine (nothing here generates)."""
    pytest.importorskip("tokenizers")
    from tokenizers import Tokenizer, models, pre_tokenizers

    from megatron_moe.data.tokenizers import HuggingFaceTokenizer

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(200)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(os.path.join(tmp_path, "tokenizer.json"))
    tokenizer = HuggingFaceTokenizer(str(tmp_path))

    gen = TextGenerator.__new__(TextGenerator)  # tokenization only: no model, no engine
    gen.tokenizer, gen.max_sequence_length, gen.calls = tokenizer, CONTEXT, 0

    def tokenize(text):
        gen.calls += 1
        return list(tokenizer.tokenize(text))

    gen.tokenize = tokenize
    return gen


@pytest.fixture
def client(generator):
    server = srv.GenerationServer(generator, host="127.0.0.1", port=0, log=lambda *_: None)
    yield server.app.test_client()
    server.httpd.server_close()


def _post(client, path, payload, method="post"):
    r = getattr(client, method)(path, data=json.dumps(payload),
                                content_type="application/json")
    return r.status_code, r.get_json()


@pytest.mark.parametrize("mutate", [False, True], ids=["bytes-checked", "mutation-no-bytes-check"])
def test_oversized_prompt_refused_before_tokenization(generator, client, monkeypatch, mutate):
    if mutate:
        monkeypatch.setattr(srv.GenerationServer, "_check_prompt_bytes", lambda *a, **k: None)
    huge = "w1 " * 400_000  # 1.2 MB; a prompt that fits has at most 28 tokens x 16 bytes
    for path, payload, method in (
            ("/completions", {"prompt": huge, "max_tokens": 4}, "post"),
            ("/api", {"prompts": ["w2 w3", huge], "tokens_to_generate": 4}, "put")):
        generator.calls = 0
        status, body = _post(client, path, payload, method)
        assert status == 400, body
        if mutate:  # refused only after tokenizing the whole prompt
            assert generator.calls >= 1 and "tokens" in body["message"]
            continue
        assert generator.calls == 0
        assert body["message"].startswith("prompt 0 has 1200000 bytes" if path == "/completions"
                                          else "prompt 1 has 1200000 bytes")
        assert f"at most {(CONTEXT - 4) * 16} bytes" in body["message"]
        assert body["error"]["param"] == ("prompt" if path == "/completions" else "prompts")


def test_token_limit_still_applies_after_the_bytes_check(generator, client):
    prompt = " ".join(["w1"] * 30)  # 89 bytes: within the bytes bound; 30 + 4 > 32 tokens
    status, body = _post(client, "/completions", {"prompt": prompt, "max_tokens": 4})
    assert status == 400 and generator.calls == 1
    assert body["message"].startswith("prompt 0 has 30 tokens; with max_tokens=4 it exceeds")


def test_finish_reason_is_the_generations():
    assert finish_reason([1, 2, 3], 8) == "stop"  # megatron-core stopped at EOD (not kept)
    assert finish_reason([1, 2, 3], 3) == "length"
    spec = dict(echo=False, stop=[], logprobs=None)

    class Tok:
        def detokenize(self, ids):
            return "".join(f"<{i}>" for i in ids)

    for reason in ("stop", "length"):
        r = Generation(prompt="", text="", completion="", prompt_tokens=[1], tokens=[2, 3],
                       finish_reason=reason)
        [choice], _ = srv.completion_choices(Tok(), spec, [r])
        assert choice["finish_reason"] == reason and choice["text"] == "<2><3>"
