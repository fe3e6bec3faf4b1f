"""FlexMoE in training (locality-only execution of its slot table through BalancedMoELayer) == plain
EP.  Full FlexMoE execution (overflow split across replicas, persistent replica optimizer state)
is not supported by the balance layer; see docs/sim.md."""

from megatron_moe.testing import run_distributed
from tests import _policy_cases

CASES = [dict(topk=2, iters=3, policy="flexmoe_eager")]


def test_flexmoe_equivalence_ep2():
    out = run_distributed(_policy_cases.policy_equivalence_rank, 2, CASES, timeout_s=300)
    for rank_out in out:
        for case, r in zip(CASES, rank_out):
            assert r["loss"] < 1e-10 and r["grad"] < 1e-10 and r["param"] < 1e-10, (case, r)
    assert out[0][0]["replicated"] > 0
