"""Spawned-rank body for tests/test_exchange_path.py: the balanced layer on megatron_moe.comm.

4 gloo ranks as 2 emulated nodes (ranks per node 2), EP 4. For every balance policy x all-to-all
algorithm the same model trains 2 iterations (iteration 0 on a forced placement with replicas of
the policy's kind, iteration 1 on the policy's own plan); every algorithm must give the flat run's
losses, grads and parameters bit for bit, and the exchange counters must show that the configured
algorithm (and no other) carried the tokens. A compressed + fused-permute run per policy proves
that compression and the fused permute ran under the policy too.
"""

from __future__ import annotations

import collections

import numpy as np
import torch

from tests import _balance_cases as bc

POLICIES = ("none", "proprophet", "fastermoe", "flexmoe")
ALGORITHMS = ("flat", "hierarchical", "pipe")


def _exchange(algorithm, compression="none", fusion=False):
    """The exchange flags (args attributes) the model's MoE layers are built with."""
    return dict(moe_permute_fusion=fusion, moe_a2a_algorithm=algorithm,
                moe_a2a_compression=compression, moe_a2a_overlap_degree=1, moe_a2a_schedule="schemoe")


def _forced_placement(policy, world, seed):
    """Iteration 0's placement, of the policy's kind: replica sets (Pro-Prophet, FasterMoE) or
    vExpert counts for FlexMoE's token router."""
    from megatron_moe.balance.policies.base import Placement, default_owner

    if policy == "none":
        return Placement.plain(bc.E, world)
    if policy != "flexmoe":
        return bc._random_placement(seed, world)
    rng = np.random.default_rng(seed)
    n = rng.integers(0, 3, size=(bc.E, world))
    owner = default_owner(bc.E, world)
    n[n.sum(axis=1) == 0, 0] = 1
    sets = [sorted(set(np.nonzero(n[e])[0].tolist()) | {int(owner[e])}) for e in range(bc.E)]
    return Placement(sets, world, n.tolist()).validate()


def _run(rank, world, policy, algorithm, compression="none", fusion=False, iters=2):
    from megatron_moe import comm
    from megatron_moe.balance import BalanceManager

    model = bc._build(2, True, torch.float32, exchange=_exchange(algorithm, compression, fusion))
    mgr = BalanceManager(bc._args(moe_balance_policy=policy, moe_balance_alpha=0.0), [model],
                         num_microbatches=1)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses, grads, replicated = [], [], 0
    with comm.count_exchanges() as ex, comm.count_wire_bytes() as wire:
        for it in range(iters):
            if it == 0:
                for m in mgr.layers:
                    m.balance.placement = _forced_placement(policy, world, 7 + (m.balance.layer_number or 0))
            replicated += sum(len(m.balance.placement.replicated()) for m in mgr.layers)
            loss, g = bc._iteration(model, opt, it, rank, mgr)
            losses.append(loss)
            grads.append(g)
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    return dict(losses=losses, grads=grads, params=params, exchanges=collections.Counter(ex),
                wire=dict(wire), replicated=replicated,
                replica_rows=sum(m.balance.a2a_rows_recv_replica for m in mgr.layers),
                a2a_rows=sum(m.balance.a2a_rows_recv for m in mgr.layers))


def _same(a, b):
    return (a["losses"] == b["losses"]
            and all(torch.equal(x[k], y[k]) for x, y in zip(a["grads"], b["grads"]) for k in x)
            and all(torch.equal(a["params"][k], b["params"][k]) for k in a["params"]))


def _maxdiff(a, b):
    return max(float((a["params"][k] - b["params"][k]).abs().max()) for k in a["params"])


def exchange_path_rank(rank, world):
    import kernels
    from megatron.core import parallel_state as ps

    from megatron_moe.runtime import topology

    topology.configure(ranks_per_node=2)
    ps.initialize_model_parallel(expert_model_parallel_size=world)
    topology.init_hierarchy_groups(ps.get_expert_model_parallel_group())
    # count the fused permute's calls (the exchange's binding calls kernels.permute by name)
    calls = collections.Counter()
    orig_permute, orig_unpermute = kernels.permute, kernels.unpermute

    def permute(*a, **k):
        calls["permute"] += 1
        return orig_permute(*a, **k)

    def unpermute(*a, **k):
        calls["unpermute"] += 1
        return orig_unpermute(*a, **k)

    kernels.permute, kernels.unpermute = permute, unpermute
    out = {}
    try:
        for policy in POLICIES:
            flat = None
            for algo in ALGORITHMS:
                r = _run(rank, world, policy, algo)
                flat = flat or r
                out[(policy, algo)] = dict(
                    equal_to_flat=_same(r, flat), exchanges=dict(r["exchanges"]), wire=r["wire"],
                    replicated=r["replicated"], replica_rows=r["replica_rows"], a2a_rows=r["a2a_rows"],
                    losses=r["losses"])
            # compression + fused permute + a non-flat algorithm under the same policy
            algo = ALGORITHMS[1 + POLICIES.index(policy) % 2]
            calls.clear()
            r = _run(rank, world, policy, algo, compression="bf16", fusion=True)
            out[(policy, "bf16+fused")] = dict(
                algorithm=algo, exchanges=dict(r["exchanges"]), permute_calls=dict(calls),
                loss_diff=max(abs(a - b) for a, b in zip(r["losses"], flat["losses"])),
                param_diff=_maxdiff(r, flat), replicated=r["replicated"])
        # fused permute alone: the same training as megatron-core's permute
        calls.clear()
        r = _run(rank, world, "proprophet", "flat", fusion=True)
        ref = _run(rank, world, "proprophet", "flat")
        out["fused"] = dict(permute_calls=dict(calls), equal=_same(r, ref), param_diff=_maxdiff(r, ref))
    finally:
        kernels.permute, kernels.unpermute = orig_permute, orig_unpermute
    return out
