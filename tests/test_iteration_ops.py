"""A training iteration's ops do not grow with the number of experts (issue: launches that do not
grow with experts), counted at the aten level over the whole iteration of the real loop: with
grouped experts the forward and backward are per layer, DDP's per-parameter add into main_grad is
done by the grouped backward in one foreach add, and megatron-core's no-apex gradient norm, clip
and main -> model parameter copy (one op or more per parameter) run as foreach calls
(compat/multi_tensor.py). Mutation: megatron-core's fallbacks put the per-parameter loops back."""

import pytest

from megatron_moe.runtime.local_ranks import run_distributed
from tests import _iteration_ops_cases as C


def _argv(experts):
    return ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
            "--micro-batch-size 2 --global-batch-size 2 --lr 1e-3 --mock-data "
            "--tokenizer-type NullTokenizer --vocab-size 128 --swiglu --disable-bias-linear "
            f"--num-experts {experts} --moe-ffn-hidden-size 16 --moe-router-topk 2 "
            "--moe-token-dispatcher-type alltoall --moe-grouped-gemm --bf16 "
            "--log-interval 100 --eval-interval 1000 --eval-iters 1 --train-iters 3").split()


@pytest.mark.parametrize("mutate", [None, "mcore_fallbacks"])
def test_iteration_ops_do_not_grow_with_experts(mutate):
    small, big = (run_distributed(C.count, 1, _argv(e), mutate, timeout_s=300)[0]
                  for e in (4, 16))
    # iteration 2: past the first step's lazy initialisation (optimizer state)
    if mutate is None:
        assert small[2] == big[2], (small["by_op"], big["by_op"])
    else:   # a norm per parameter and a copy per parameter, at least: 12 more experts x 2
        assert big[2] - small[2] >= 2 * 12 * 2 * 2, (small, big)
