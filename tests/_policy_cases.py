"""Spawned-rank bodies for tests/test_fastermoe_equivalence.py and test_flexmoe_equivalence.py:
the FasterMoE / FlexMoE policies drive the balance engineer's BalancedMoELayer in training, and one
iteration per placement must match plain megatron-core EP (loss, grads, updated params)."""

from __future__ import annotations

import numpy as np

from megatron_moe.balance.policies.base import register_policy
from megatron_moe.balance.policies.fastermoe import FasterMoEPolicy
from megatron_moe.balance.policies.flexmoe import FlexMoEPolicy
from megatron_moe.sim.costs import PlannerCost

# Transfers priced at zero so the tiny test model's routing actually triggers replication (the
# placement is what is under test, not the pricing); the default-cost policies are tested too.
_FREE_COMM = dict(fwd_s_per_input=1.0, a2a_s_per_input=0.0, param_collective_s=0.0)


class EagerFasterMoE(FasterMoEPolicy):
    name = "fastermoe_eager"

    def __init__(self, num_experts, num_ranks, **kw):
        super().__init__(num_experts, num_ranks, cost=PlannerCost(**_FREE_COMM))


class EagerFlexMoE(FlexMoEPolicy):
    name = "flexmoe_eager"

    def __init__(self, num_experts, num_ranks, **kw):
        super().__init__(PlannerCost(**_FREE_COMM), num_experts, num_ranks, threshold=1.0)


register_policy(EagerFasterMoE)
register_policy(EagerFlexMoE)


def policy_equivalence_rank(rank, world, cases):
    from tests import _balance_cases

    out = _balance_cases.equivalence_rank(rank, world, cases)
    return out


def record_trace_rank(rank, world, trace_dir, iters):
    """Train the balance tests' tiny GPT-MoE with ``--moe-routing-trace-dir`` (the real writer)."""
    import torch
    from megatron.core import parallel_state as ps

    from megatron_moe.balance import BalanceManager
    from tests import _balance_cases as bc

    ps.initialize_model_parallel(expert_model_parallel_size=world)
    model = bc._build(2, True, torch.float32)
    args = bc._args(moe_balance_policy="none", moe_routing_trace_dir=trace_dir)
    mgr = BalanceManager(args, [model], num_microbatches=1)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for it in range(iters):
        bc._iteration(model, opt, it, rank, mgr)
    return len(mgr.layers)
