"""--attention-backend flash (torch SDPA on the local path) end to end: a tiny GPT-MoE (GQA;
gpt-oss's sinks + window at TP 2; MLA) and BERT train with the losses of megatron-core's local
attention (--attention-backend local) within 1e-4 in fp32, and SDPA ran (a call counter); with
SDPA's causal mask dropped the losses leave that tolerance. Greedy generation gives the same
tokens; the memory report drops the score matrix; bench/attention.py runs."""

import pytest

from megatron_moe.runtime.local_ranks import run_distributed
from tests._sdpa_cases import train_counting_sdpa, train_fast_path
from tests.test_training import TINY

ITERS = 4
LAYERS = 2
EVAL = 2   # after training: one batch each of the validation and test sets (forward only)

# name: (ranks, flags). GQA without the dataloader's mask (SDPA's own causal mask: the flash path);
# gpt-oss's learned sinks with a sliding window on layer 1 and full attention on layer 2, at TP 2
# with SP (heads and sinks split); DeepSeek's MLA (unequal q/k and v head dims, YaRN mscale in the
# softmax scale). The last two take the dataloader's causal mask (Megatron's default).
MODELS = {
    "gqa": (1, "--group-query-attention --num-query-groups 2 "
               "--no-create-attention-mask-in-dataloader"),
    "gpt-oss-tp2": (2, "--tensor-model-parallel-size 2 --sequence-parallel "
                       "--group-query-attention --num-query-groups 2 --softmax-type learnable "
                       "--window-size 5,0 --window-attn-skip-freq 2"),
    "mla": (1, "--multi-latent-attention --q-lora-rank 16 --kv-lora-rank 8 --qk-head-dim 8 "
               "--qk-pos-emb-head-dim 4 --v-head-dim 6 --kv-channels 8 --rotary-scaling-factor 40 "
               "--mscale 0.707 --mscale-all-dim 0.707 --position-embedding-type rope"),
}


def _train(backend, model, mutate=False):
    world, flags = MODELS[model]
    argv = TINY + (f"--train-iters {ITERS} --transformer-impl local --attention-backend {backend} "
                   f"--attention-dropout 0.0 {flags}").split()
    runs = run_distributed(train_counting_sdpa, world, argv, mutate=mutate, timeout_s=300)
    history, calls, _ = runs[0]
    assert all(r[0]["lm_loss"] == history["lm_loss"] for r in runs)
    return history["lm_loss"], calls


@pytest.mark.parametrize("model", list(MODELS))
def test_flash_backend_trains_like_local_attention(model):
    local, local_calls = _train("local", model)
    flash, flash_calls = _train("flash", model)
    assert local_calls == 0          # megatron-core's DotProductAttention: no SDPA
    # one SDPA per layer per forward of each micro-batch (global 8 / micro 2: 4 per iteration)
    assert flash_calls == (ITERS + EVAL) * LAYERS * 4, flash_calls
    assert len(flash) == len(local) == ITERS
    gap = max(abs(a - b) for a, b in zip(flash, local))
    print(f"{model}: flash vs local max |loss gap| {gap:.3g} over {ITERS} iterations, "
          f"{flash_calls} SDPA calls")
    assert gap < 1e-4, (flash, local)
    assert len(set(local)) > 1       # the model trained (losses moved)
    if model == "gqa":
        mutated, _ = _train("flash", model, mutate=True)
        gap = max(abs(a - b) for a, b in zip(mutated, local))
        print(f"{model}: mutated (no causal mask) vs local max |loss gap| {gap:.3g}")
        assert gap > 1e-4, (mutated, local)


def test_bert_with_flash_trains_like_local_attention(tmp_path):
    """BERT (padding masks: [b, 1, s, s], padding queries' rows fully masked) trained 3 iterations
    on 2 ranks (EP 2) with --attention-backend flash: the losses of local within 1e-4."""
    from tests._bert_cases import preprocess
    from tests.test_bert import TINY as BERT_TINY

    prefix, vocab, _ = preprocess(str(tmp_path))
    argv = BERT_TINY + ["--data-path", prefix, "--vocab-file", vocab, "--train-iters", "3",
                        "--attention-dropout", "0.0", "--transformer-impl", "local"]
    runs = {}
    for backend in ("local", "flash"):
        runs[backend] = run_distributed(train_counting_sdpa, 2, argv + ["--attention-backend",
                                                                        backend],
                                        bert=True, timeout_s=300)[0]
    (local, local_calls, _), (flash, calls, masked) = runs["local"], runs["flash"]
    assert local_calls == 0 and calls > 0 and masked == calls   # every call had BERT's mask
    gap = max(abs(a - b) for a, b in zip(flash["lm_loss"], local["lm_loss"]))
    print(f"bert: flash vs local max |loss gap| {gap:.3g}, {calls} SDPA calls on rank 0")
    assert len(flash["lm_loss"]) == 3 and gap < 1e-4, (flash["lm_loss"], local["lm_loss"])


def test_memory_report_drops_the_score_matrix_under_sdpa():
    """tools/report_theoretical_memory.py: --transformer-impl local with --attention-backend
    flash keeps no [heads, s, s] softmax per layer; local/unfused keep it (fp32 + 16-bit copy)."""
    import os
    import sys

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from tests.test_theoretical_memory import TINY as MEM_TINY
    from tools import report_theoretical_memory as rtm

    def activations(backend):
        args, _ = rtm.parse(MEM_TINY + ["--world-size", "1", "--bf16", "--transformer-impl",
                                        "local", "--attention-backend", backend])
        return rtm.estimate(args)["activations"]

    flash, local = activations("flash"), activations("local")
    heads, seq, micro, layers = 4, 64, 2, 2
    # the local softmax: fp32 probabilities + their bf16 copy, per head, query and key
    assert local - flash == layers * micro * heads * seq * seq * (4 + 2), (local, flash)


def test_attention_bench_runs():
    """bench/attention.py at toy size: both core attentions agree and are timed, every case."""
    import os

    from megatron_moe.runtime.local_ranks import run_script

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = run_script(os.path.join(root, "bench", "attention.py"),
                     ["--seq", "32", "--heads", "8", "--reps", "1"], timeout_s=240)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    lines = [line for line in out.stdout.splitlines() if "local/ours x" in line]
    assert [line.split()[0] for line in lines] == ["causal", "causal-gqa", "sinks-window-gqa"]


def test_generation_with_flash_equals_local(tmp_path):
    """The static inference engine (prefill with SDPA's causal mask, then one query per step
    against the KV cache, no mask) generates the same greedy tokens with --attention-backend
    flash as with local, log probs within 1e-4, and SDPA ran on every step."""
    from tests import _data_helpers as H
    from tests._sdpa_cases import generate_counting_sdpa

    data, tok = H.sp_dataset(str(tmp_path), max_docs=60, vocab_size=300)
    save = str(tmp_path / "ckpt")
    argv = TINY[:]
    for flag in ("--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "256"):
        argv.remove(flag)
    argv += ("--train-iters 4 --transformer-impl local --attention-dropout 0.0 "
             "--tokenizer-type SentencePieceTokenizer --split 90,10,0").split()
    argv += ["--data-path", data, "--tokenizer-model", tok, "--save", save]
    run_distributed(train_counting_sdpa, 1, argv, timeout_s=300)
    prompts, tokens = ["The module", "Return the value of"], 6
    out = {}
    for backend in ("local", "flash"):
        gen_argv = ["--load", save, "--use-checkpoint-args", "--transformer-impl", "local",
                    "--attention-backend", backend]
        ((out[backend]),) = run_distributed(generate_counting_sdpa, 1, gen_argv, prompts, tokens,
                                            timeout_s=300)
    (local, local_calls), (flash, flash_calls) = out["local"], out["flash"]
    assert local_calls == 0 and flash_calls >= tokens * LAYERS, (local_calls, flash_calls)
    for (lt, lp), (ft, fp) in zip(local, flash):
        assert ft == lt and len(fp) == len(lp) > 0
        assert max(abs(a - b) for a, b in zip(fp, lp)) < 1e-4, (fp, lp)


@pytest.mark.parametrize("policy", ["none", "proprophet"])
def test_fast_path_trains_like_the_unfused_loop(policy):
    """Every speed option of the local path together (SDPA attention, grouped experts, fused
    permute) trains with the losses of megatron-core's local path as it comes (unfused attention,
    expert loop), fp32, EP 2, with and without a balance policy; both SDPA and the grouped experts
    ran. The balance policy's replicas are exercised by tests/test_grouped_features.py."""
    base = TINY + (f"--train-iters {ITERS} --transformer-impl local --attention-dropout 0.0 "
                   f"--expert-model-parallel-size 2 --moe-balance-policy {policy}").split()
    stock = run_distributed(train_fast_path, 2, base + ["--attention-backend", "local"],
                            timeout_s=300)[0]
    fast = run_distributed(train_fast_path, 2, base + ["--attention-backend", "flash",
                                                       "--moe-grouped-gemm",
                                                       "--moe-permute-fusion"], timeout_s=300)[0]
    (slow_hist, slow_sdpa, slow_grouped), (fast_hist, fast_sdpa, fast_grouped) = stock, fast
    assert slow_sdpa == 0 and slow_grouped == 0
    # data parallel 2: two micro-batches of the global 8 per rank per iteration
    assert fast_sdpa == (ITERS + EVAL) * LAYERS * 2 and fast_grouped > 0, (fast_sdpa, fast_grouped)
    gap = max(abs(a - b) for a, b in zip(fast_hist["lm_loss"], slow_hist["lm_loss"]))
    print(f"{policy}: fast path vs stock local max |loss gap| {gap:.3g}")
    assert len(fast_hist["lm_loss"]) == ITERS and gap < 1e-4, (fast_hist, slow_hist)
