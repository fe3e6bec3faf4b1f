"""Inference from a training checkpoint: generation at EP=2 (torchrun CLI) == EP=1, ring-memory
offloading bit-identical to resident (NaN fill on; skipping the waits gives NaN), the REST server
on 127.0.0.1, and evaluate.py == the training run's validation line.

One small checkpoint is trained once for the module: SentencePiece data, 4-layer 4-expert top-2
GPT-MoE, 2 gloo ranks with EP=2.
"""

import math
import os
import re
import signal
import subprocess
import sys

import numpy as np
import pytest

from megatron_moe.runtime.local_ranks import free_port, run_distributed
from tests import _data_helpers as H
from tests._inference_cases import evaluate_then_serve_case, generation_suite, train_and_capture

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPTS = ["The module", "Return the value of"]
TOKENS = 8
RING_SLOTS = 2
LINK_GBPS = 0.05  # slow enough that a layer copy takes milliseconds: skipped waits would show


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("inference")
    data, tok = H.sp_dataset(str(d), max_docs=150, vocab_size=500)
    save = str(d / "ckpt")
    argv = ("--num-layers 4 --hidden-size 32 --num-attention-heads 4 --seq-length 32 "
            "--micro-batch-size 2 --global-batch-size 8 --lr 3e-3 --split 90,10,0 "
            "--tokenizer-type SentencePieceTokenizer --num-experts 4 --moe-router-topk 2 "
            "--moe-token-dispatcher-type alltoall --moe-aux-loss-coeff 0.01 --disable-bias-linear "
            "--hidden-dropout 0 --attention-dropout 0 --train-iters 30 --log-interval 30 "
            "--eval-interval 30 --eval-iters 2 --expert-model-parallel-size 2").split()
    argv += ["--data-path", data, "--tokenizer-model", tok, "--save", save]
    printed = run_distributed(train_and_capture, 2, argv, timeout_s=300)
    line = next(l for out in printed for l in out.splitlines() if "validation loss at" in l)
    return dict(load=save, line=line.strip(), data=data, tok=tok)


@pytest.fixture(scope="module")
def ep1(ckpt):
    argv = ["--load", ckpt["load"], "--use-checkpoint-args"]
    return run_distributed(generation_suite, 1, argv, PROMPTS, TOKENS, RING_SLOTS, LINK_GBPS,
                           timeout_s=300)[0]


def _run_group(cmd, timeout):
    """Run a torchrun command in its own process group; a timeout kills the workers too."""
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


def test_generation_ep2_torchrun_equals_ep1(ckpt, ep1):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
           "--master_port", str(free_port()), os.path.join(ROOT, "tools", "generate.py"),
           "--load", ckpt["load"], "--use-checkpoint-args", "--expert-model-parallel-size", "2",
           "--num-tokens-to-generate", str(TOKENS), "--return-log-probs", "--prompts", *PROMPTS]
    out = _run_group(cmd, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    blocks = [b.strip("\n") for b in out.stdout.split("-" * 80)[1:-1]]  # between the rulers
    texts = [b.splitlines()[0] for b in blocks]
    assert texts == [r["text"] for r in ep1["resident"]], (texts, ep1["resident"])
    # the completions are real generations, not empty strings
    assert all(len(r["tokens"]) > 0 for r in ep1["resident"])
    for block, ref in zip(blocks, ep1["resident"]):
        logps = [float(v) for v in block.splitlines()[1].split(":")[1].split()]
        assert logps == pytest.approx(ref["log_probs"], abs=2e-4)  # printed with 4 decimals


def test_ring_memory_is_bit_identical_and_waits(ep1):
    assert ep1["ring"] == ep1["resident"]  # tokens, text and log probs, exactly
    resident = ep1["resident_logits"]
    assert np.isfinite(resident).all()
    assert ep1["ring_logits"].tobytes() == resident.tobytes()  # bit-identical fp32
    assert ep1["after_close_logits"].tobytes() == resident.tobytes()
    stats = ep1["ring_stats"]
    # the ring really streamed: every layer was copied more than once, some waits blocked
    assert stats["slots"] == RING_SLOTS and stats["layers"] == 4
    assert stats["copies"] > 2 * stats["layers"] and stats["blocked_waits"] > 0
    assert stats["bytes_copied"] >= stats["copies"] * stats["min_layer_bytes"]
    assert stats["peak_device_bytes"] <= RING_SLOTS * stats["slot_bytes"]
    assert stats["peak_device_bytes"] < stats["streamed_bytes"]
    # active experts only: identical output from fewer bytes
    assert ep1["active"] == ep1["resident"]
    active = ep1["active_stats"]
    assert active["bytes_copied"] < stats["bytes_copied"]
    # mutation: without the waits the layers compute on NaN-filled slots
    assert np.isnan(ep1["no_wait_logits"]).any()


def test_server_answers_put_and_rejects_bad_requests(ep1):
    server = ep1["server"]
    assert server["host"] == "127.0.0.1"
    status, answer = server["ok"]
    assert status == 200, answer
    assert answer["text"] == [ep1["resident"][0]["text"]]
    assert answer["tokens"][0][-len(ep1["resident"][0]["tokens"]):] == ep1["resident"][0]["tokens"]
    assert len(answer["logprobs"][0]) == len(answer["tokens"][0]) - 1
    status, answer = server["malformed"]
    assert status == 400 and "malformed JSON" in answer["message"]
    status, answer = server["no_prompts"]
    assert status == 400 and answer["message"] == "prompts argument required"
    assert answer["error"] == {"message": "prompts argument required", "param": "prompts",
                               "type": "invalid_request_error", "code": None}


def test_evaluate_reproduces_the_training_validation_line_and_serves_at_ep2(ckpt, ep1):
    argv = ["--load", ckpt["load"], "--use-checkpoint-args", "--expert-model-parallel-size", "2"]
    ranks = run_distributed(evaluate_then_serve_case, 2, argv, PROMPTS[0], TOKENS, timeout_s=240)
    result = ranks[0][0]
    line = next(l.strip() for _, printed, _ in ranks for l in printed.splitlines()
                if "validation loss at" in l)
    assert line == ckpt["line"]
    value = float(re.search(r"lm loss value: (\S+)", line).group(1))
    assert result["lm loss"] == pytest.approx(value, rel=1e-6)
    assert result["ppl"] == pytest.approx(math.exp(value), rel=1e-5)
    # the server with both ranks generating (rank 0 broadcasts each request): EP=2 == EP=1
    served = ranks[0][2]
    assert ranks[1][2] is None
    status, answer = served["ok"]
    assert status == 200 and answer["text"] == [ep1["resident"][0]["text"]], answer
    assert served["malformed"][0] == 400 and served["no_prompts"][0] == 400


# --- flags: checked before any process group, one line naming the flag ------------------------
def _parse(argv, capsys):
    from megatron_moe.inference.arguments import parse_inference_args
    from tools.generate import add_text_generate_args, validate_generation_args

    try:
        return parse_inference_args(argv, add_text_generate_args, prog="generate.py",
                                    validate_tool=validate_generation_args)
    except SystemExit as exc:
        assert exc.code == 2
        return capsys.readouterr().err


def test_checkpoint_args_and_overrides(ckpt, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    base = ["--load", ckpt["load"], "--prompts", "x"]
    args = _parse(base + ["--use-checkpoint-args", "--hidden-dropout", "0.3",
                          "--num-tokens-to-generate", "5"], capsys)
    assert (args.num_layers, args.hidden_size, args.num_experts) == (4, 32, 4)  # checkpoint's
    assert args.tokenizer_model == ckpt["tok"]
    assert args.hidden_dropout == 0.3 and args.num_tokens_to_generate == 5  # command line wins
    assert args.expert_model_parallel_size == 1  # layout: this launch's, not the checkpoint's (2)
    assert _parse(["--prompts", "x"], capsys).count("--load is required") == 1
    empty = str(tmp_path / "empty")
    os.makedirs(empty)
    assert "no latest_checkpointed_iteration.txt under" in _parse(["--load", empty] + base[2:], capsys)
    assert "--num-layers, --hidden-size, --num-attention-heads, --seq-length required (or " \
           "--use-checkpoint-args" in _parse(base, capsys)
    err = _parse(base + ["--use-checkpoint-args", "--tokenizer-model", str(tmp_path / "nope")],
                 capsys)
    assert "--tokenizer-model: " + str(tmp_path / "nope") + " does not exist" in err
    assert "cannot be combined" in _parse(base + ["--use-checkpoint-args", "--top_k", "2",
                                                  "--top_p", "0.5"], capsys)
    assert "--ring-memory-slots 5 exceeds the 4 transformer layers" in _parse(
        base + ["--use-checkpoint-args", "--ring-memory-slots", "5"], capsys)
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert "needs --expert-model-parallel-size > 1" in _parse(
        base + ["--use-checkpoint-args", "--tensor-model-parallel-size", "2"], capsys)


def test_help_answers_without_megatron_core():
    for tool in ("generate.py", "run_text_generation_server.py", "evaluate.py"):
        code = ("import runpy, sys\nsys.argv = ['x', '--help']\ntry:\n"
                f"    runpy.run_path({os.path.join(ROOT, 'tools', tool)!r}, run_name='__main__')\n"
                "except SystemExit:\n    pass\nprint('MCORE', 'megatron.core' in sys.modules)\n")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             timeout=60, env=dict(os.environ, PYTHONPATH=ROOT))
        assert "--load" in out.stdout and "MCORE False" in out.stdout, (tool, out.stdout[-500:],
                                                                         out.stderr[-2000:])


def test_ring_memory_cost_model():
    from megatron_moe.balance.cost_model import RingMemoryCost

    def cost(copy_s, k, n=8):
        return RingMemoryCost(layer_bytes=copy_s * 1e9, link_bandwidth=1e9, layer_forward_s=1.0,
                              slots=k, num_layers=n)

    assert cost(0.5, 2).layer_s() == 1.0 and cost(0.5, 2).keeps_up()   # hidden
    assert cost(0.5, 1).layer_s() == 1.5 and not cost(0.5, 1).keeps_up()  # K=1 hides nothing
    assert cost(3.0, 4).layer_s() == 3.0 and cost(3.0, 4).ratio() == 1 / 3  # link-bound
    assert cost(5.0, 8).layer_s() == 1.0 and cost(2.0, 4).memory_fraction() == 0.5  # K=N resident
