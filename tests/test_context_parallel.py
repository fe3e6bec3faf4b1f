"""Context parallelism (--context-parallel-size) on the local path: this package's SDPA attention
by all-gather (models/attention.py), megatron-core's batch split (pretrain_gpt_moe.get_batch) and
the loss over whole sequences, on gloo ranks (tiny CPU runs, float64 / fp32):

* the CP attention on 2 ranks equals one rank's SDPA over the whole sequence (output and the q, k,
  v gradients, the sinks' gradient summed over CP) within 1e-12 in float64: causal GQA, causal MHA
  with a sliding window, GQA with --reset-attention-mask's per-document mask as get_batch splits
  it, gpt-oss's GQA + window + learnable sinks; each rank's query positions are megatron-core's
  get_batch_on_this_cp_rank split; the K/V all-gathers are counted; mutations: the gathered chunks
  left in rank order, or no all-gather: they fail;
* training (MoE, EP=2) with --context-parallel-size 2 on 2 ranks logs the losses, grad norms and
  evaluation losses of the CP=1 run (DP=2, EP=2: the same global batch and expert seeds; fp32,
  1e-5), each rank holding half of each sequence; mutations: get_batch hands every CP rank the
  whole sequence (megatron-core's split not called), or the loss divided by the rank's own token
  count (the gradients then cp times too large): they differ; the same equality with RoPE, with
  --calculate-per-token-loss, with TP=2 + sequence parallelism (4 ranks against TP=2 alone), and
  for a tiny gpt-oss (sinks, window on every other layer, YaRN);
* parse time, one line each: megatron-core's local attention, a2a+p2p, an unknown
  --cp-comm-type, a sequence not divisible by 2 x cp, BERT; the accepted --cp-comm-type values.
"""

import pytest

from megatron_moe.arguments import parse_args
from megatron_moe.runtime.local_ranks import DistributedRunError, run_distributed
from tests import _cp_cases as cases
from tests.test_training import TINY

ATTENTION_CASES = [(2, None, 0, False), (4, (5, 0), 0, False), (2, None, 3, False),
                   (2, (3, 0), 0, True)]


def _attention(mutate=None):
    return run_distributed(cases.attention_rank, 2, ATTENTION_CASES, mutate=mutate, timeout_s=180)


def _check_attention(mutate=None):
    for diffs, gathers, same_split, causal_chunks in _attention(mutate):
        assert same_split
        assert gathers == 2 * len(ATTENTION_CASES)   # K and V per case
        # the plain causal case (the first) ran by chunks, without an explicit mask
        assert causal_chunks == 2 * sum(window is None and not documents and not sinks
                                        for _, window, documents, sinks in ATTENTION_CASES)
        assert max(diffs) < 1e-12, diffs


def test_cp_attention_equals_whole_sequence_attention():
    _check_attention()


@pytest.mark.parametrize("mutate", ["identity-order", "no-gather", "upper-left"])
def test_cp_attention_mutations_differ(mutate):
    # without the gather, the document mask's keys (the whole sequence) no longer fit: an error
    with pytest.raises((AssertionError, DistributedRunError)):
        _check_attention(mutate)


EXACT = ("--attention-dropout 0 --hidden-dropout 0 --attention-backend flash "
         "--train-iters 3").split()


def _train(world, extra, mutate=None):
    return run_distributed(cases.train, world, TINY + EXACT + extra.split(), mutate=mutate,
                           timeout_s=300)


@pytest.fixture(scope="module")
def cp1():
    # EP=2 on both sides: megatron-core seeds each EP rank's experts by its EP rank, so the
    # experts start equal only with equal EP sizes; here DP=2 reads the same global batch
    runs = _train(2, "--expert-model-parallel-size 2")
    for history, gathers, seen in runs:
        assert gathers == 0 and seen == [2 * 32]
    return runs[0][0]


def test_cp2_with_rope_equals_cp1():
    """RoPE: megatron-core's rotary embedding takes this CP rank's positions itself (on a CPU
    through compat/cpu.py's shim of its pinned index)."""
    extra = " --position-embedding-type rope"
    ref = _train(2, "--expert-model-parallel-size 2" + extra)[0][0]
    for history, gathers, _ in _train(2, CP2 + extra):
        assert gathers > 0 and _same_run(history, ref), (history, ref)


def test_cp2_per_token_loss_equals_cp1():
    """--calculate-per-token-loss: (loss sum, tokens) per CP rank; megatron-core's
    finalize_model_grads divides by the DP x CP token count. Without the aux loss: megatron-core's
    router scales it by the rank's local token count under this flag, which under CP gives its
    gradient 1/cp of the CP=1 run's (megatron-core's behaviour, Transformer Engine's path too)."""
    extra = " --calculate-per-token-loss --moe-aux-loss-coeff 0"
    ref = _train(2, "--expert-model-parallel-size 2" + extra)[0][0]
    for history, gathers, _ in _train(2, CP2 + extra):
        assert gathers > 0 and _same_run(history, ref), (history, ref)


def _close(a, b):
    return len(a) == len(b) and all(abs(x - y) <= 1e-5 * max(1.0, abs(y)) for x, y in zip(a, b))


def _same_run(history, cp1):
    assert cp1["eval_lm_loss"]   # the evaluations after training (validation and test)
    return all(_close(history[key], cp1[key]) for key in ("lm_loss", "grad_norm", "eval_lm_loss"))


CP2 = "--context-parallel-size 2 --expert-model-parallel-size 2"


def test_cp2_training_equals_cp1(cp1):
    runs = _train(2, CP2)
    for history, gathers, seen in runs:
        assert gathers > 0 and seen == [2 * 16]   # half of each sequence per rank
        assert _same_run(history, cp1), (history, cp1)
    assert len(set(cp1["lm_loss"])) == len(cp1["lm_loss"])


@pytest.mark.parametrize("mutate", ["no-cp-split", "local-token-mean"])
def test_cp2_training_mutations_differ(cp1, mutate):
    runs = _train(2, CP2, mutate)
    assert not _same_run(runs[0][0], cp1)


BASE = TINY + ["--transformer-impl", "local", "--train-iters", "3"]


@pytest.mark.parametrize("extra, message", [
    ("--context-parallel-size 2 --attention-backend unfused",
     "--context-parallel-size 2 with --attention-backend unfused is not supported"),
    ("--context-parallel-size 2 --cp-comm-type a2a+p2p",
     "--cp-comm-type a2a+p2p needs --hierarchical-context-parallel-sizes"),
    ("--context-parallel-size 2 --cp-comm-type allgather", "--cp-comm-type allgather: choose"),
    ("--context-parallel-size 2 --seq-length 30", "must be divisible by 2 x --context-parallel"),
])
def test_parse_time_refusals(extra, message, capsys):
    with pytest.raises(SystemExit):
        parse_args(BASE + extra.split(), world_size=2)
    err = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(err) == 1 and message in err[0], err


def test_cp_comm_types_accepted_on_the_local_path():
    for comm in ("p2p", "all_gather", "a2a"):
        args = parse_args(BASE + f"--context-parallel-size 2 --cp-comm-type {comm}".split(),
                          world_size=2)
        assert args.context_parallel_size == 2


def test_bert_refuses_context_parallelism():
    """Megatron-LM's BERT never splits its batch over CP ranks; refused in one line."""
    import argparse

    from megatron_moe.data.bert import validate_bert_args

    args = argparse.Namespace(mask_prob=0.15, short_seq_prob=0.1, mock_data=False, seq_length=32,
                              calculate_per_token_loss=False, context_parallel_size=2)
    with pytest.raises(ValueError, match="--context-parallel-size > 1 is not supported for BERT"):
        validate_bert_args(args)
    args.context_parallel_size = 1
    validate_bert_args(args)


def test_cp2_with_tensor_and_sequence_parallel_equals_cp1():
    """TP=2 with sequence parallelism: the CP gather is of each TP rank's heads, after the
    sequence-parallel gather of the QKV projection (4 ranks against TP=2 alone on 2)."""
    tp = "--tensor-model-parallel-size 2 --sequence-parallel"
    ref = _train(2, tp)[0][0]
    for history, gathers, seen in _train(4, tp + " --context-parallel-size 2"):
        assert gathers > 0 and seen == [2 * 16] and _same_run(history, ref), (history, ref)


def test_gpt_oss_cp2_equals_cp1(tmp_path):
    """gpt-oss (examples/train_gpt_oss_20b_cpu.sh's model: learnable sinks, window 3,0 on every
    other layer, YaRN RoPE, EP=2) in fp32, without its checkpoint flags."""
    from tests.test_gpt_oss import SCRIPT, script_argv

    argv = script_argv(SCRIPT, tmp_path, str(tmp_path / "ckpt"))
    drop = {"--bf16": 0, "--save": 1, "--load": 1, "--save-interval": 1, "--train-iters": 1}
    kept, i = [], 0
    while i < len(argv):
        if argv[i] in drop:
            i += 1 + drop[argv[i]]
            continue
        kept.append(argv[i])
        i += 1
    kept += ["--train-iters", "3", "--attention-backend", "flash"]

    def run(extra, world=2):
        return run_distributed(cases.train, world, kept + extra, timeout_s=300)

    ref = run([])[0][0]
    for history, gathers, seen in run(["--context-parallel-size", "2"]):
        assert gathers > 0 and seen == [2 * 16] and _same_run(history, ref), (history, ref)


def test_mla_cp2_equals_cp1():
    """Multi-latent attention (DeepSeek): unequal q/k and v head dims, megatron-core's MLA rotary
    taking this CP rank's positions, a q LoRA; the SDPA core attention gathers K and V."""
    mla = (" --multi-latent-attention --q-lora-rank 16 --kv-lora-rank 16 --qk-head-dim 8 "
           "--qk-pos-emb-head-dim 8 --v-head-dim 8 --position-embedding-type rope")
    ref = _train(2, "--expert-model-parallel-size 2" + mla)[0][0]
    for history, gathers, seen in _train(2, CP2 + mla):
        assert gathers > 0 and seen == [2 * 16] and _same_run(history, ref), (history, ref)
