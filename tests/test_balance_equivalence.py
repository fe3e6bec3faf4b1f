"""BalancedMoELayer == plain megatron-core EP for any placement (design note 5.3, items 14-17)."""

import pytest

from megatron_moe.testing import run_distributed
from tests import _balance_cases

CASES2 = [
    dict(topk=1, iters=2, plans=["empty", "empty"]),
    dict(topk=2, iters=2, plans=["random", "random"]),
    dict(topk=2, iters=3, plans=["all", "planned", "planned"], overlap=True),
]


def test_equivalence_ep2():
    out = run_distributed(_balance_cases.equivalence_rank, 2, CASES2, timeout_s=240)
    for rank_out in out:
        for case, r in zip(CASES2, rank_out):
            assert r["loss"] < 1e-10 and r["grad"] < 1e-10 and r["param"] < 1e-10, (case, r)
