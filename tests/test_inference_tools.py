"""The inference tools end to end, as their command lines run them (main(argv) in one process):
tools/generate.py, tools/run_text_generation_server.py and tools/evaluate.py at EP=1 from a
checkpoint trained at EP=2 with biased experts (inference refuses only what a forward pass cannot
do), each resident and with --ring-memory-slots 2 of 4 layers (NaN fill and an emulated link on):
identical tokens, log probs and validation loss; the ring's summary line shows it streamed; a ring
that leaves out its binds (monkeypatched out) computes on NaN placeholders."""

import re

import pytest

from megatron_moe.runtime.local_ranks import run_distributed
from tests._inference_cases import train_and_capture
from tests._ring_tools_cases import tools_suite

PROMPTS = ["11 27 3 90", "5 5 61"]
TOKENS = 6
RING = ["--ring-memory-slots", "2", "--ring-memory-debug", "--ring-memory-link-gbps", "0.05"]
_SUMMARY = re.compile(r"\[ring memory\] K=2 of N=4 layers \| device layer bytes peak: (\d+) of "
                      r"(\d+) \(0\.50\) \| copies: (\d+)")


@pytest.fixture(scope="module")
def suite(tmp_path_factory):
    save = str(tmp_path_factory.mktemp("biased") / "ckpt")
    argv = ("--num-layers 4 --hidden-size 32 --num-attention-heads 4 --seq-length 32 "
            "--micro-batch-size 2 --global-batch-size 8 --lr 3e-3 --mock-data "
            "--tokenizer-type NullTokenizer --vocab-size 128 --num-experts 4 --moe-router-topk 2 "
            "--moe-token-dispatcher-type alltoall --hidden-dropout 0 --attention-dropout 0 "
            "--train-iters 3 --log-interval 3 --eval-interval 3 --eval-iters 1 "
            "--expert-model-parallel-size 2").split() + ["--save", save]
    printed = run_distributed(train_and_capture, 2, argv, timeout_s=300)
    line = next(l for out in printed for l in out.splitlines() if "validation loss at" in l)
    out = run_distributed(tools_suite, 1, save, PROMPTS, TOKENS, RING, timeout_s=400)[0]
    return dict(out, line=line, load=save)


def _blocks(stdout):
    return [b.strip("\n") for b in stdout.split("-" * 80)[1:-1]]


def test_generate_at_ep1_from_biased_ep2_checkpoint_ring_equals_resident(suite):
    rc, resident = suite["generate"]
    assert rc == 0
    blocks = _blocks(resident)
    assert len(blocks) == len(PROMPTS)
    for prompt, block in zip(PROMPTS, blocks):
        text = block.splitlines()[0]
        assert text.startswith(prompt) and len(text.split()) > len(prompt.split())
        assert "nan" not in block
    rc, ring = suite["generate_ring"]
    assert rc == 0 and _blocks(ring) == blocks  # tokens and log probs, as printed
    m = _SUMMARY.search(ring)
    assert m, ring
    peak, resident_bytes, copies = map(int, m.groups())
    assert 0 < peak * 2 == resident_bytes and copies > 2 * 4  # streamed, wrapping the ring
    # mutation: the ring leaves its binds out -> the layers compute on their NaN placeholders
    rc, mutated = suite["generate_ring_skip_bind"]
    assert rc != 0 or "nan" in mutated, mutated


def test_server_ring_equals_resident(suite):
    (rc, resident), (rc_ring, ring) = suite["server"], suite["server_ring"]
    assert rc == 0 and rc_ring == 0
    assert resident[0] == 200 and ring == resident
    first = _blocks(suite["generate"][1])[0].splitlines()[0]
    assert resident[1]["text"] == [first]


def test_evaluate_ring_equals_resident_and_reproduces_training(suite):
    (rc, resident), (rc_ring, ring) = suite["evaluate"], suite["evaluate_ring"]
    assert rc == 0 and rc_ring == 0
    loss = lambda text: float(re.search(r"lm loss value: (\S+)", text).group(1))
    # EP=1 here against EP=2 in training: the same loss up to summation order
    assert loss(resident) == pytest.approx(loss(suite["line"]), rel=1e-6)
    assert loss(ring) == loss(resident)
    assert _SUMMARY.search(ring), ring


def test_generate_from_a_run_measured_in_samples(tmp_path):
    """A run given in samples (--train-samples, sample-based LR schedule) stores the iterations it
    derived as well; --use-checkpoint-args takes neither (a tool does not train), where it used to
    stop on '--train-iters and --train-samples are mutually exclusive'."""
    from tests._train_cases import generate_cli, run_pretrain

    ckpt = str(tmp_path / "ckpt")
    argv = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32 "
            "--micro-batch-size 2 --global-batch-size 8 --lr 3e-3 --mock-data "
            "--tokenizer-type NullTokenizer --vocab-size 256 --num-experts 4 --moe-router-topk 2 "
            "--disable-bias-linear --train-samples 16 --lr-decay-samples 16 "
            f"--lr-warmup-samples 8 --eval-iters 1 --save {ckpt}").split()
    history = run_distributed(run_pretrain, 1, argv, timeout_s=300)[0]
    assert history["iteration"] == [1, 2]
    text, logps = generate_cli(ckpt, "5 6 7", tokens=3)
    assert len(text.split()) == 6 and len(logps) == 3, (text, logps)
