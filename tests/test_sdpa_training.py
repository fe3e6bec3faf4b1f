"""A tiny GPT-MoE trained with --attention-backend flash (torch SDPA on the local path) has the
losses of megatron-core's local attention (--attention-backend local) within 1e-4 in fp32, and
SDPA ran (a call counter); with SDPA's causal mask dropped the losses leave that tolerance."""

import pytest

from megatron_moe.runtime.local_ranks import run_distributed
from tests._sdpa_cases import train_counting_sdpa
from tests.test_training import TINY

ITERS = 4
LAYERS = 2

# GQA on every case; gpt-oss: learned sinks, a sliding window on layer 1, full attention on 2
MODELS = {
    "gqa": "--group-query-attention --num-query-groups 2",
    "gpt-oss": "--group-query-attention --num-query-groups 2 --softmax-type learnable "
               "--window-size 5,0 --window-attn-skip-freq 2",
}


def _train(backend, model, mutate=False):
    argv = TINY + (f"--train-iters {ITERS} --transformer-impl local --attention-backend {backend} "
                   f"--attention-dropout 0.0 {MODELS[model]}").split()
    ((history, calls),) = run_distributed(train_counting_sdpa, 1, argv, mutate=mutate,
                                          timeout_s=300)
    return history["lm_loss"], calls


@pytest.mark.parametrize("model", list(MODELS))
def test_flash_backend_trains_like_local_attention(model):
    local, local_calls = _train("local", model)
    flash, flash_calls = _train("flash", model)
    assert local_calls == 0          # megatron-core's DotProductAttention: no SDPA
    # one SDPA per layer per forward of each micro-batch (global 8 / micro 2: 4 per iteration)
    assert flash_calls == ITERS * LAYERS * 4, flash_calls
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
