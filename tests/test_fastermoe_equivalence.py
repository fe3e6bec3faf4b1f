"""FasterMoE shadowing in training: the balanced MoE layer (megatron_moe/moe/layer.py with the replica placement) with the policy's placements == plain EP."""

from megatron_moe.runtime.local_ranks import run_distributed
from tests import _policy_cases

CASES = [
    dict(topk=2, iters=3, policy="fastermoe_eager"),
]


def test_fastermoe_equivalence_ep2():
    out = run_distributed(_policy_cases.policy_equivalence_rank, 2, CASES, timeout_s=300)
    for rank_out in out:
        for case, r in zip(CASES, rank_out):
            assert r["loss"] < 1e-10 and r["grad"] < 1e-10 and r["param"] < 1e-10, (case, r)
    # the eager policy really shadowed experts in the planned iterations
    assert out[0][0]["replicated"] > 0
