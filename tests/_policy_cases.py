"""Spawned-rank bodies for tests/test_fastermoe_equivalence.py and test_flexmoe_equivalence.py:
the FasterMoE / FlexMoE policies drive the balanced MoE layer in training, and one
iteration per placement must match plain megatron-core EP (loss, grads, updated params)."""

from __future__ import annotations


from megatron_moe.balance.policies.base import register_policy
from megatron_moe.balance.policies.fastermoe import FasterMoEPolicy
from megatron_moe.balance.policies.flexmoe import FlexMoEPolicy
from megatron_moe.balance.cost_model import CostModel, PlannerCost
from megatron_moe.balance.policies.auto import AutoPolicy

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


class RandomFlex(FlexMoEPolicy):
    """Random vExpert counts every call (seeded by the call number, so identical on every rank):
    placements where the owner holds no vExpert, several replicas share an expert's overflow, etc."""
    name = "flexmoe_random"

    def __init__(self, num_experts, num_ranks, **kw):
        super().__init__(PlannerCost(**_FREE_COMM), num_experts, num_ranks, threshold=1.0)
        self.calls_ = 0

    def plan(self, counts, current=None):
        import numpy as np

        from megatron_moe.balance.policies.base import Placement, default_owner

        rng = np.random.default_rng(self.calls_)
        self.calls_ += 1
        n = rng.integers(0, 3, size=(self.num_experts, self.num_ranks))
        n[n.sum(axis=1) == 0, 0] = 1
        owner = default_owner(self.num_experts, self.num_ranks)
        sets = [sorted(set(np.nonzero(n[e])[0].tolist()) | {int(owner[e])}) for e in range(self.num_experts)]
        return Placement(sets, self.num_ranks, n.tolist()).validate()


class EagerAuto(AutoPolicy):
    """auto with every transfer priced at zero (its FlexMoE candidate eager too): replicating wins,
    so the tiny model really runs the placements auto picks."""
    name = "auto_eager"

    def __init__(self, num_experts, num_ranks, **kw):
        free = CostModel(input_bytes=1.0, expert_bytes=1.0, throughput=1.0, a2a_bandwidth=1e30,
                         trans_bandwidth=1e30)
        super().__init__(num_experts, num_ranks, cost=free, planner_cost=PlannerCost(**_FREE_COMM),
                         persistent=False, planners={"proprophet": dict(alpha=0.0),
                                                     "flexmoe": dict(threshold=1.0)})


register_policy(EagerAuto)
register_policy(EagerFasterMoE)
register_policy(EagerFlexMoE)
register_policy(RandomFlex)


def policy_equivalence_rank(rank, world, cases):
    """For each case (policy, topk, iters): the reference is stock megatron-core EP; ours runs
    The balanced MoE layer with the policy planning every iteration's placement from the previous counts.
    Returns per-case worst |loss|, grad and updated-param differences and the replicas used."""
    import torch
    from megatron.core import parallel_state as ps

    from megatron_moe.balance import BalanceManager
    from tests import _balance_cases as bc

    ps.initialize_model_parallel(expert_model_parallel_size=world)
    results = []
    for case in cases:
        ref = bc._build(case["topk"], False, torch.float64)
        ours = bc._build(case["topk"], True, torch.float64)
        mgr = BalanceManager(bc._args(moe_balance_policy=case["policy"],
                                      moe_balance_overlap=case.get("overlap", False)),
                             [ours], num_microbatches=1)
        if "plan_ahead" in case:
            mgr.plan_ahead = case["plan_ahead"]
        opt_r = torch.optim.Adam(ref.parameters(), lr=1e-2)
        opt_o = torch.optim.Adam(ours.parameters(), lr=1e-2)
        worst = {"loss": 0.0, "grad": 0.0, "param": 0.0}
        replicated = 0
        placements = []
        for it in range(case["iters"]):
            replicated += sum(len(m.balance.placement.replicated()) for m in mgr.layers)
            placements.append([m.balance.placement.to_dict() for m in mgr.layers])
            lr, gr = bc._iteration(ref, opt_r, it, rank)
            lo, go = bc._iteration(ours, opt_o, it, rank, mgr)      # after_step plans the next placement
            worst["loss"] = max(worst["loss"], abs(lr - lo))
            assert gr.keys() == go.keys()
            worst["grad"] = max(worst["grad"], max(float((gr[k] - go[k]).abs().max()) for k in gr))
            pr, po = dict(ref.named_parameters()), dict(ours.named_parameters())
            worst["param"] = max(worst["param"], max(float((pr[k] - po[k]).abs().max()) for k in pr))
        # replicas never become parameters, optimizer state or checkpoint entries
        assert sum(1 for _ in ours.parameters()) == sum(1 for _ in ref.parameters())
        assert set(ours.state_dict().keys()) == set(ref.state_dict().keys())
        results.append(dict(worst, replicated=replicated, placements=placements,
                            replica_rows=sum(m.balance.a2a_rows_recv_replica for m in mgr.layers),
                            choices={k: dict(p.state.choices) for k, p in mgr.policies.items() if p.name.startswith("auto")},
                            auto_metric=mgr.metrics().get("balance/auto"),
                            a2a_rows=sum(m.balance.a2a_rows_recv for m in mgr.layers)))
    return results


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
