"""tools/run_text_generation_server.py as clients use it: Megatron-LM's PUT /api and CLI protocol,
OpenAI's POST /completions (the ``openai`` client), lm-evaluation-harness's ``local-completions``
model on local tasks (its log-likelihoods == the checkpoint's own log probs), bad input answered
with 4xx naming the field, a bounded load test, and a clean exit on SIGTERM.

One tiny checkpoint is trained once (1 rank) and one server process serves the whole module; the
last test stops it with SIGTERM.
"""

import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from megatron_moe.runtime.local_ranks import run_distributed
from tests import _data_helpers as H
from tests._inference_cases import train_and_capture
from tests._server_cases import reference_case

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SEQ = 64
START_TIMEOUT_S = 240
REQUEST_TIMEOUT_S = 120

# lm-evaluation-harness tasks (written by the test): 3 multiple-choice docs, 2 generation docs
MC_DOCS = [
    {"context": "Return the value of", "choices": [" the", " a module", " x"], "label": 0},
    {"context": "The module", "choices": [" is", " provides functions", " of the"], "label": 1},
    {"context": "This function returns", "choices": [" a", " the number", " None"], "label": 2},
]
GEN_DOCS = [{"context": "The module", "answer": " x"}, {"context": "Return the", "answer": " y"}]
GEN_TOKENS = 6


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("server")
    data, tok = H.sp_dataset(str(d), max_docs=120, vocab_size=400)
    save = str(d / "ckpt")
    argv = (f"--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length {SEQ} "
            f"--max-position-embeddings {SEQ} --micro-batch-size 4 --global-batch-size 4 "
            "--lr 3e-3 --split 100,0,0 --tokenizer-type SentencePieceTokenizer --num-experts 4 "
            "--moe-router-topk 2 --moe-token-dispatcher-type alltoall --disable-bias-linear "
            "--hidden-dropout 0 --attention-dropout 0 --train-iters 20 --log-interval 20 "
            "--eval-iters 0").split()
    argv += ["--data-path", data, "--tokenizer-model", tok, "--save", save]
    run_distributed(train_and_capture, 1, argv, timeout_s=300)
    return {"load": save, "dir": d}


class _Server:
    """The server process (own process group) and its output lines, read by a thread."""

    def __init__(self, ckpt):
        cmd = [sys.executable, os.path.join(ROOT, "tools", "run_text_generation_server.py"),
               "--load", ckpt["load"], "--use-checkpoint-args", "--port", "0"]
        env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
        # as a user starts it (no torchrun variables): with MASTER_PORT set, megatron-core 0.19's
        # reading of the checkpoint args binds that port before initialize does (EADDRINUSE)
        for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
            env.pop(k, None)
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, env=env, start_new_session=True)
        self.lines: queue.Queue = queue.Queue()
        self.output = []
        threading.Thread(target=self._read, daemon=True).start()
        deadline = time.time() + START_TIMEOUT_S
        self.url = None
        while self.url is None:
            try:
                line = self.lines.get(timeout=max(0.1, deadline - time.time()))
            except queue.Empty:
                self.kill()
                raise AssertionError("server did not start:\n" + "".join(self.output)[-3000:])
            if line is None:
                raise AssertionError("server exited:\n" + "".join(self.output)[-3000:])
            if line.startswith(" * serving "):
                self.url = line.split(" on ")[1].split("/api")[0]

    def _read(self):
        for line in self.proc.stdout:
            self.output.append(line)
            self.lines.put(line)
        self.lines.put(None)

    def log(self):
        return "".join(self.output)

    def kill(self):
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def server(ckpt):
    s = _Server(ckpt)
    yield s
    s.kill()


@pytest.fixture(scope="module")
def reference(ckpt):
    pairs = [(d["context"], c) for d in MC_DOCS for c in d["choices"]]
    prompts = [d["context"] for d in GEN_DOCS]
    argv = ["--load", ckpt["load"], "--use-checkpoint-args"]
    return run_distributed(reference_case, 1, argv, pairs, prompts, GEN_TOKENS,
                           timeout_s=240)[0]


def _call(server, method, path, payload, timeout=REQUEST_TIMEOUT_S):
    import requests

    data = payload if isinstance(payload, (bytes, str)) else json.dumps(payload)
    r = requests.request(method, server.url + path, data=data, timeout=timeout,
                         headers={"Content-Type": "application/json"})
    return r.status_code, r.json()


def test_completions_echo_logprobs_equal_megatron_api(server):
    status, api = _call(server, "PUT", "/api", {"prompts": ["The module"], "tokens_to_generate": 4,
                                                "top_k": 1, "logprobs": True})
    assert status == 200, api
    status, out = _call(server, "POST", "/completions",
                        {"prompt": "The module", "max_tokens": 4, "temperature": 0,
                         "logprobs": 2, "echo": True})
    assert status == 200, out
    assert out["object"] == "text_completion" and len(out["choices"]) == 1
    choice = out["choices"][0]
    lp = choice["logprobs"]
    tokens = api["tokens"][0]
    n_prompt = out["usage"]["prompt_tokens"]
    assert out["usage"]["total_tokens"] == len(tokens) == n_prompt + out["usage"][
        "completion_tokens"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) \
        == len(lp["text_offset"])
    # Megatron-LM's echo convention: the first token has no log prob, then the same values
    assert lp["token_logprobs"][0] is None
    n = len(lp["token_logprobs"]) - 1
    assert lp["token_logprobs"][1:] == pytest.approx(api["logprobs"][0][:n], abs=1e-6)
    assert "".join(lp["tokens"]) == choice["text"]
    assert choice["text"] == api["text"][0][:len(choice["text"])]
    assert all(len(t) == 2 for t in lp["top_logprobs"][1:])  # logprobs=2: two alternatives
    # greedy: each chosen generated token is the most likely one
    for value, top in zip(lp["token_logprobs"][n_prompt:], lp["top_logprobs"][n_prompt:]):
        assert value == pytest.approx(max(top.values()), abs=1e-6)
    # without echo: only the completion, offsets from its start
    status, plain = _call(server, "POST", "/v1/completions",
                          {"prompt": [server_tokens(server, "The module")],
                           "max_tokens": 4, "temperature": 0, "logprobs": 0})
    assert status == 200, plain
    c = plain["choices"][0]
    assert api["text"][0] == "The module" + c["text"]
    assert c["logprobs"]["text_offset"][0] == 0 and c["logprobs"]["top_logprobs"] is None
    assert c["finish_reason"] in ("length", "stop")


def server_tokens(server, text):
    status, out = _call(server, "POST", "/tokenize", {"prompt": text})
    assert status == 200
    return out["tokens"]


def test_stop_n_and_tokenizer_endpoints(server):
    status, info = _call(server, "GET", "/tokenizer_info", b"")
    assert status == 200 and info["eos_token"] and info["model_max_length"] == SEQ
    ids = server_tokens(server, "Return the value of")
    status, back = _call(server, "POST", "/detokenize", {"tokens": ids})
    assert status == 200 and back["prompt"] == "Return the value of"
    status, out = _call(server, "POST", "/completions",
                        {"prompt": ["The module", "Return the"], "max_tokens": 5, "n": 2,
                         "temperature": 0})
    assert status == 200 and [c["index"] for c in out["choices"]] == [0, 1, 2, 3]
    texts = [c["text"] for c in out["choices"]]
    assert texts[0] == texts[1] and texts[2] == texts[3]  # greedy: n copies agree
    full = texts[0]
    if len(full) > 2:  # a stop string cuts the text where it first occurs
        stop = full[1:3]
        status, cut = _call(server, "POST", "/completions",
                            {"prompt": "The module", "max_tokens": 5, "temperature": 0,
                             "stop": stop})
        assert status == 200 and cut["choices"][0]["text"] == full[:full.find(stop, 0)]
        assert cut["choices"][0]["finish_reason"] == "stop"


def test_openai_client_gets_text_and_logprobs(server):
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=60,
                           max_retries=0)
    out = client.completions.create(model="megatron-moe", prompt="The module", max_tokens=4,
                                    temperature=0, logprobs=1)
    choice = out.choices[0]
    assert isinstance(choice.text, str) and len(choice.logprobs.tokens) == 4
    assert all(isinstance(v, float) and v <= 0 for v in choice.logprobs.token_logprobs)
    assert out.usage.completion_tokens == 4
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="m", prompt="x", max_tokens=-1)
    assert err.value.status_code == 400 and "max_tokens" in str(err.value)
    assert err.value.body["param"] == "max_tokens"


def test_megatron_cli_protocol_reads_the_message(server):
    """Megatron-LM's tools/text_generation_cli.py: requests.put(...); on an error it prints
    response.json()['message']."""
    import requests

    headers = {"Content-Type": "application/json"}
    response = requests.put(server.url + "/api", headers=headers, timeout=30,
                            data=json.dumps({"prompts": ["hi"], "tokens_to_generate": -3}))
    assert response.status_code == 400
    assert response.json()["message"] == \
        "tokens_to_generate must be an integer greater than or equal to 0"
    response = requests.put(server.url + "/api", headers=headers, timeout=60,
                            data=json.dumps({"prompts": ["The module"], "tokens_to_generate": 3}))
    assert response.status_code == 200 and response.json()["text"][0].startswith("The module")
    # our own CLI prints the message too
    cli = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "text_generation_cli.py"),
                          server.url.split("//")[1], "--prompt", "", "--tokens-to-generate", "2"],
                         capture_output=True, text=True, timeout=60,
                         env=dict(os.environ, PYTHONPATH=ROOT))
    assert cli.returncode == 1 and "error 400: Empty prompts require add_BOS=true" in cli.stderr


@pytest.mark.parametrize("body, field", [
    (b'{"prompt": "a", "max_tokens": ', None),                       # malformed JSON
    (b'["a list"]', None),                                           # not an object
    ({"max_tokens": 3}, "prompt"),
    ({"prompt": "a", "max_tokens": -1}, "max_tokens"),
    ({"prompt": "a", "max_tokens": "3"}, "max_tokens"),
    ({"prompt": "word " * 200, "max_tokens": 1}, "prompt"),           # longer than the model's
    ({"prompt": "a", "max_tokens": SEQ}, "prompt"),                    # with max_tokens too long
    ({"prompt": [1, 2, 10 ** 9]}, "prompt"),
    ({"prompt": "a", "temperature": -1}, "temperature"),
    ({"prompt": "a", "logprobs": 99}, "logprobs"),
    ({"prompt": "a", "stop": 3}, "stop"),
    ({"prompt": "a", "n": 0}, "n"),
    ({"prompt": "a", "stream": True}, "stream"),
    ({"prompt": "a", "frobnicate": 1}, "frobnicate"),
    ({"prompt": "a", "max_tokens": 0}, "max_tokens"),                 # nothing to return
])
def test_bad_completions_get_4xx_naming_the_field(server, body, field):
    status, out = _call(server, "POST", "/completions", body, timeout=30)
    assert 400 <= status < 500, out
    assert out["message"] == out["error"]["message"] and out["error"]["param"] == field
    if field is not None:
        assert field in out["message"]


def _raw(server, data: bytes, read=True, timeout=30):
    host, port = server.url.split("//")[1].split(":")
    with socket.create_connection((host, int(port)), timeout=timeout) as s:
        s.sendall(data)
        if not read:
            return b""
        chunks = []
        while True:
            try:
                chunk = s.recv(65536)
            except socket.timeout:
                break
            if not chunk:
                break
            chunks.append(chunk)
        return b"".join(chunks)


def test_load_concurrent_oversized_malformed_and_disconnecting_clients(server):
    from megatron_moe.inference.server import MAX_BODY_BYTES

    results, errors = [], []

    def client(i):
        try:
            if i % 2:
                results.append(_call(server, "POST", "/completions",
                                     {"prompt": "The module", "max_tokens": 3,
                                      "temperature": 0, "seed": i}))
            else:
                results.append(_call(server, "PUT", "/api",
                                     {"prompts": ["Return the"], "tokens_to_generate": 3,
                                      "top_k": 1}))
        except Exception as exc:  # reported below
            errors.append(repr(exc))

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(8)]
    for t in threads:
        t.start()
    # meanwhile: an oversized body, malformed bodies, clients that go away mid-request
    big = b"x" * (MAX_BODY_BYTES + 1)
    status, out = _call(server, "POST", "/completions", big, timeout=60)
    assert status == 413 and "larger than" in out["message"]
    for bad in (b"{", b"null", b'{"prompt": "\xff"}', b""):
        status, out = _call(server, "POST", "/completions", bad, timeout=30)
        assert status == 400 and out["error"]["type"] == "invalid_request_error", (bad, out)
    head = (b"POST /completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 5000\r\n\r\n")
    _raw(server, head + b'{"prompt": "The', read=False)           # body cut short
    body = json.dumps({"prompt": "The module", "max_tokens": 8}).encode()
    _raw(server, head.replace(b"5000", str(len(body)).encode()) + body, read=False)  # no read
    _raw(server, b"GARBAGE\r\n\r\n", timeout=10)                  # not HTTP
    for t in threads:
        t.join(timeout=REQUEST_TIMEOUT_S)
    assert not errors and len(results) == 8, errors
    assert all(status == 200 for status, _ in results), results
    completions = [out["choices"][0]["text"] for status, out in results if "choices" in out]
    assert len(set(completions)) == 1 and len(completions) == 4  # greedy: one answer
    status, out = _call(server, "PUT", "/api", {"prompts": ["The module"],
                                                "tokens_to_generate": 2})
    assert status == 200  # still serving


# the two tasks' own lines (lm-evaluation-harness task YAML; the data file is added per task)
TASKS = {
    "mm_loglik": (MC_DOCS, """output_type: multiple_choice
doc_to_text: "{{context}}"
doc_to_choice: "{{choices}}"
doc_to_target: label
metric_list:
  - metric: acc
"""),
    "mm_gen": (GEN_DOCS, f"""output_type: generate_until
doc_to_text: "{{{{context}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["<never>"]
  max_gen_toks: {GEN_TOKENS}
  do_sample: false
  temperature: 0
metric_list:
  - metric: exact_match
"""),
}


def _write_tasks(directory):
    for task, (docs, lines) in TASKS.items():
        data = os.path.join(directory, f"{task}.jsonl")
        with open(data, "w") as f:
            f.writelines(json.dumps(d) + "\n" for d in docs)
        with open(os.path.join(directory, f"{task}.yaml"), "w") as f:
            f.write(f"task: {task}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
                    f"    test: {data}\ntest_split: test\n" + lines)


def test_lm_eval_local_completions_equals_the_checkpoint(server, reference, tmp_path):
    pytest.importorskip("lm_eval")
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    _write_tasks(str(tasks))
    out = tmp_path / "out"
    before = server.log().count("/v1/completions")
    # the one command of docs/inference.md (the tokenizer: the server's, auto-detected)
    cmd = [sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args",
           f"base_url={server.url}/v1/completions,model=megatron-moe,max_length={SEQ}",
           "--tasks", "mm_loglik,mm_gen", "--include_path", str(tasks), "--output_path",
           str(out), "--log_samples"]
    env = dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1",
               HF_DATASETS_CACHE=str(tmp_path / "hf"), TOKENIZERS_PARALLELISM="false")
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=400, env=env,
                         start_new_session=True)
    assert run.returncode == 0, run.stderr[-4000:]
    assert "Using remote tokenizer" in run.stderr  # the server's tokenizer endpoints
    samples = {}
    for dirpath, _, files in os.walk(out):
        for name in files:
            if name.startswith("samples_"):
                task = name.split("_", 1)[1].rsplit("_", 1)[0]
                with open(os.path.join(dirpath, name)) as f:
                    samples[task] = sorted((json.loads(line) for line in f),
                                           key=lambda s: s["doc_id"])
    assert sorted(samples) == ["mm_gen", "mm_loglik"]
    loglik = [float(resp[0][0]) for s in samples["mm_loglik"] for resp in s["resps"]]
    assert len(loglik) == sum(len(d["choices"]) for d in MC_DOCS)
    assert loglik == pytest.approx(reference["loglik"], abs=1e-4)
    assert all(v < 0 for v in loglik)
    generations = [s["resps"][0][0] for s in samples["mm_gen"]]
    assert generations == reference["completions"]
    assert any(generations)
    # every request went through the server (one per choice, one per generation)
    assert server.log().count("/v1/completions") - before >= len(loglik) + len(GEN_DOCS)


def test_sigterm_exits_cleanly(server):
    """Last: stops the module's server. A shutdown line, exit 0, no stack dump."""
    server.proc.send_signal(signal.SIGTERM)
    rc = server.proc.wait(timeout=60)
    time.sleep(0.2)
    log = server.log()
    assert rc == 0, log[-3000:]
    assert " * server shut down (SIGTERM)" in log and "Traceback" not in log, log[-3000:]
