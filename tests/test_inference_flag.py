"""megatron-core 0.19's static inference engine sets its process-wide InferenceMode flag and never
unsets it, so a plain forward after generating (evaluation, a logits call after serving) asserted
"Inference must always gather TP logits". compat.inference.engine_inference_mode confines the flag
to the engine's constructor and generate: generation still runs under it, a later forward does
not. megatron-core 0.16 has no such flag (the test passes there; its mutation case is skipped)."""

import pytest

from megatron_moe.compat.inference import _inference_mode_flag
from megatron_moe.runtime.local_ranks import run_distributed
from tests._inference_cases import generate_then_forward_case


@pytest.mark.parametrize("mutate", [False, True], ids=["restored", "mutation-left-set"])
def test_plain_forward_after_generating(mutate):
    has_flag = _inference_mode_flag() is not None
    if mutate and not has_flag:
        pytest.skip("this megatron-core has no process-wide InferenceMode flag to leave set")
    out = run_distributed(generate_then_forward_case, 1, mutate, timeout_s=300)[0]
    print(out)
    assert len(out["tokens"]) == 3
    assert out["entered"] == 2  # the engine's constructor and its generate
    # prefill + 2 decode steps; generation ran under the flag where the version has one
    assert len(out["during"]) >= 3 and set(out["during"]) == ({True} if has_flag else {None})
    if mutate:  # the engine as it comes: the flag stays set and the plain forward asserts
        assert out["after"] == [True]
        assert "Inference must always gather TP logits" in out["forward"], out["forward"]
        return
    assert out["after"] == [False if has_flag else None]
    assert out["forward"] == (1, 4, 256), out["forward"]
