"""Glue: replay a trace through a policy (per EP group and layer) and compare policies.

The cluster's ``num_gpus`` ranks are split into EP groups of ``ep_size`` contiguous ranks (default
``min(num_gpus, num_experts)``: with more GPUs than experts, plain EP runs expert-data-parallel
copies of the EP group, as DeepSpeed-MoE and megatron-core do).  Every EP group routes its own rows
of the trace and runs its own policy instance; all groups run concurrently on the modelled cluster.
"""

from __future__ import annotations

import functools
import itertools
import time
from typing import Dict, List, Optional, Sequence, Union

import numpy as np
from threadpoolctl import threadpool_limits

from .cluster import Cluster
from .engine import Assignment, IterationBreakdown, simulate_iterations
from .traces import tile_sources

__all__ = ["POLICIES", "available_policies", "simulate", "compare", "ep_layout"]

POLICIES = ("none", "deepspeed", "fastermoe", "flexmoe", "proprophet", "proprophet+overlap", "auto",
            "proprophet-ncost", "proprophet-ncost+overlap")


def _proprophet_cls():
    try:
        from megatron_moe.balance.policies.proprophet import ProProphetPolicy  # balance engineer's planner
        return ProProphetPolicy
    except Exception:
        return None


def _training_planner_defaults() -> Dict[str, float]:
    import argparse

    from megatron_moe.balance import add_arguments
    a = add_arguments(argparse.ArgumentParser()).parse_args([])
    return {"alpha": a.moe_balance_alpha, "n": a.moe_balance_n}


def available_policies() -> List[str]:
    pols = ["none", "deepspeed", "fastermoe", "flexmoe"]
    if _proprophet_cls() is not None:
        pols += ["proprophet", "proprophet+overlap", "auto"]
    return pols


def ep_layout(num_gpus: int, num_experts: int, ep_size: Optional[int] = None):
    p = min(num_gpus, num_experts) if ep_size is None else int(ep_size)
    if p < 1 or num_gpus % p:
        raise ValueError(f"sim: --ep-size {p} must divide --gpus {num_gpus}")
    return num_gpus // p, p


class _Timer:
    def __init__(self, mode):
        self.mode = mode

    def __call__(self, fn, *a, **kw):
        t = time.perf_counter()
        r = fn(*a, **kw)
        dt = time.perf_counter() - t
        return r, (dt if self.mode == "measured" else float(self.mode))


def _one_blas_thread(fn):
    """Run ``fn`` with BLAS on one thread. The simulator's products are small (at most an EP group's
    E x G or G x G per call), and on the 2-core host OpenBLAS's second thread doubled the CPU seconds
    of a FlexMoE or auto run at 8192 GPUs without shortening its wall time (docs/sim.md, *Simulator
    speed*); the same products in one thread give the same floats."""
    @functools.wraps(fn)
    def run(*a, **kw):
        with threadpool_limits(limits=1, user_api="blas"):
            return fn(*a, **kw)
    return run


@_one_blas_thread
def simulate(trace: np.ndarray, cluster: Cluster, policy: str = "none", algorithm: str = "flat",
             ep_size: Optional[int] = None, plan_time: Union[str, float] = 0.0,
             policy_kwargs: Optional[Dict] = None, degree: int = 1) -> IterationBreakdown:
    """Replay ``trace[iteration, layer, source, expert]`` through ``policy`` on ``cluster``.

    ``deepspeed`` is DeepSpeed-MoE's GShard-style expert parallelism: every (source, expert) slot of
    the all-to-all is padded to one capacity C; ``policy_kwargs={"capacity_factor": f}`` gives
    C = ceil(f * inputs_per_source / E) and drops the overflow, None (default) is its
    ``drop_tokens=False`` mode, C = the largest count over all sources and experts (all-reduce MAX).
    ``degree`` > 1 pipelines each all-to-all / expert / all-to-all segment (FasterMoE's smart schedule).
    """
    from megatron_moe.balance.policies.fastermoe import FasterMoEPolicy, default_owner
    from megatron_moe.balance.policies.flexmoe import FlexMoEPolicy
    from megatron_moe.balance.policies.base import Placement

    if policy not in POLICIES:
        raise ValueError(f"sim: unknown policy {policy!r}; choose from {POLICIES}")
    if trace.ndim != 4:
        raise ValueError(f"sim: trace must be [iterations, layers, sources, experts], got {trace.shape}")
    iters, layers, d_src, n_exp = trace.shape
    d = cluster.num_gpus
    if d_src != d:
        trace = tile_sources(trace, d)
    groups, p = ep_layout(d, n_exp, ep_size)
    kw = dict(policy_kwargs or {})
    timer = _Timer(plan_time)
    ranks = [np.arange(g * p, (g + 1) * p) for g in range(groups)]
    if p % cluster.ranks_per_node == 0:     # node-aligned groups: every group prices the same
        costs = [cluster.planner_cost(ranks[0])] * groups
    else:
        costs = [cluster.planner_cost(r) for r in ranks]
    owner = default_owner(n_exp, p)
    onehot = np.zeros((n_exp, p)); onehot[np.arange(n_exp), owner] = 1.0
    own_mask = (owner[None, :] == np.arange(p)[:, None])            # [P, E]
    bcast = np.array([cluster.broadcast_time(cluster.expert_param_bytes, r) for r in ranks])
    per_rank = n_exp // p                                            # experts per rank (contiguous)
    _bc = {}

    def bcast_of(g, rs):
        """Broadcast time of one expert over group g's ranks ``rs`` (sorted): it depends only on the
        member count and on whether they span nodes, so it is cached by that."""
        gr = ranks[g]
        key = (len(rs), int(gr[rs[0]]) // cluster.ranks_per_node != int(gr[rs[-1]]) // cluster.ranks_per_node)
        if key not in _bc:
            _bc[key] = cluster.broadcast_time(cluster.expert_param_bytes, gr[rs])
        return _bc[key]

    def to_owner(x):
        """[G, P, E] inputs -> [G, P, P] inputs each source sends to each owner rank."""
        if n_exp % p:
            return x @ onehot
        return x.reshape(x.shape[0], p, p, per_rank).sum(axis=3)
    base = policy.split("+")[0]
    overlap = policy.endswith("+overlap")
    if base == "proprophet-ncost":          # Pro-Prophet with --moe-balance-n cost (fan-out per expert)
        base = "proprophet"
        kw.setdefault("n", "cost")
    pols = {}
    ds_cf = kw.pop("capacity_factor", None) if base == "deepspeed" else None
    if base == "fastermoe":
        # policy_kwargs["cost"]: the constants the shadowing decision is priced with, when they are not
        # the cluster's (a paper's code hard-codes its own; papers.shadow_decision_cost)
        dc = kw.pop("cost", None)
        pols = {(g, l): FasterMoEPolicy(n_exp, p, costs[g] if dc is None else dc, **kw)
                for g in range(groups) for l in range(layers)}
    elif base == "flexmoe":
        pols = {(g, l): FlexMoEPolicy(costs[g], n_exp, p, **kw) for g in range(groups) for l in range(layers)}
    elif base == "auto":
        # per group and layer the cost model picks none / proprophet (transient) / flexmoe (persistent)
        from megatron_moe.balance.policies.auto import AutoPolicy, RegimeState, plan_groups, plan_layers
        kw.setdefault("planners", {"proprophet": _training_planner_defaults()})
        pols = {(g, l): AutoPolicy(n_exp, p, cost=cluster.cost_model(ranks[g]), planner_cost=costs[g], **kw)
                for g in range(groups) for l in range(layers)}
        # the state auto's choice carries between re-plans, one per layer's EP groups (the first
        # one for all layers when they choose together)
        regimes = [RegimeState() for _ in range(layers)]
    elif base == "proprophet":
        cls = _proprophet_cls()
        if cls is None:
            raise ValueError("sim: policy 'proprophet' needs megatron_moe.balance.policies.proprophet."
                             "ProProphetPolicy (the balance engineer's planner), which is not importable")
        kw.setdefault("eq8", overlap)
        # plan as training does by default (--moe-balance-alpha / --moe-balance-n defaults), so a
        # replayed trace gets the placements the training run would have used
        for k, v in _training_planner_defaults().items():
            kw.setdefault(k, v)
        pols = {(g, l): cls(num_experts=n_exp, num_ranks=p, cost=cluster.cost_model(ranks[g]), **kw)
                for g in range(groups) for l in range(layers)}
    prev = {}
    flex_out = {}
    auto_joint = {}                                 # auto with layers: the later layers' assignments

    def run_replicas(g, placement, c, local, traffic, trans, agg):
        """Transient replica sets (Pro-Prophet): inputs of a replica rank stay there; Trans/Agg."""
        s = own_mask.copy()
        rep = placement.replicated()
        if rep:     # every replica rank of every replicated expert at once; Trans summed in expert order
            sets = [placement.replica_sets[e] for e in rep]
            lens = [len(rs) for rs in sets]
            flat = np.fromiter(itertools.chain.from_iterable(sets), dtype=np.int64, count=sum(lens))
            s[flat, np.repeat(rep, lens)] = True
            np.add.at(trans[g], flat, np.repeat([bcast_of(g, rs) for rs in sets], lens))
        agg[g] = trans[g]
        local[g] = c[g] * s
        traffic[g] = to_owner((c[g] * ~s)[None])[0]

    def run_flex(g, priced, local, traffic, agg):
        """FlexMoE vExpert table priced with group g's counts: the flexible router, replica-group
        ring all-reduce (``Priced.dispatch``)."""
        agg[g] = priced.dispatch(local[g], traffic[g])[2]

    def charge_moves(g, moves, adj):
        """Best-effort state transfers (src, dst, bytes) of group g."""
        for src, dst, nb in moves:
            t = cluster.p2p_time(nb, int(ranks[g][src]), int(ranks[g][dst]))
            adj[g, src] += t; adj[g, dst] += t

    def assign(it: int, l: int) -> Assignment:
        # (auto converts the layers it plans itself: with several layers all at layer 0)
        c = None if base == "auto" else trace[it, l].reshape(groups, p, n_exp).astype(np.float64)
        z = np.zeros((groups, p))
        plan_s = np.zeros(groups); plan_h = np.zeros(groups)
        trans = z.copy(); agg = z.copy(); adj = z.copy()
        if base == "none":
            local = c * own_mask
            traffic = to_owner(c * ~own_mask)
        elif base == "deepspeed":
            if ds_cf is None:                                    # drop_tokens=False: global max count
                cap = float(trace[it, l].max())
            else:
                cap = float(np.ceil(ds_cf * trace[it, l].sum(axis=1).max() / n_exp))
            local = np.broadcast_to(cap * own_mask, c.shape).astype(np.float64)
            traffic = np.broadcast_to(to_owner((cap * ~own_mask)[None])[0], (groups, p, p)).astype(np.float64)
        elif base == "fastermoe":
            local = np.empty_like(c); traffic = np.empty((groups, p, p))
            for g in range(groups):
                plan, dt = timer(pols[(g, l)].select, c[g])
                plan_s[g] = dt                                   # needs this iteration's counts
                s = own_mask.copy(); s[:, plan.shadowed] = True
                local[g] = c[g] * s
                traffic[g] = to_owner((c[g] * ~s)[None])[0]
                trans[g] = len(plan.shadowed) * bcast[g]
                agg[g] = len(plan.shadowed) * bcast[g]           # reduce = same ring volume
        elif base == "flexmoe":
            # one pair of arrays per layer, refilled each iteration (the engine has read them by
            # the time it asks for the layer's next assignment): no fresh 2 x 16 MiB to fault in
            if l not in flex_out:
                flex_out[l] = (np.empty_like(c), np.empty((groups, p, p)))
            local, traffic = flex_out[l]
            for g in range(groups):
                pol = pols[(g, l)]
                priced = pol.price(c[g])                         # this step runs the current table
                run_flex(g, priced, local, traffic, agg)
                ops, dt = timer(pol.step, c[g], priced)          # placement for the next step
                plan_h[g] = 0.0                                  # host-side, overlaps GPU work
                plan_s[g] = 0.0
                pol.plan_seconds = getattr(pol, "plan_seconds", 0.0) + dt
                charge_moves(g, pol.adjustment_bytes(ops), adj)
        elif base == "auto":
            # as flexmoe: the plan from this iteration's counts applies from the next one, its state
            # moves (when it picks flexmoe) are charged now, best effort. One choice per layer over
            # all EP groups (auto.plan_groups: the iteration waits for the slowest group); with
            # several layers and groups, one choice for all layers (auto.plan_layers: it waits for
            # the slowest group's sum over layers), made when the engine asks for layer 0 (it asks
            # for every layer of an iteration before running it). With one group the iteration is
            # the layers' sum, so each layer chooses alone (exact, and layers may differ). Output
            # arrays reused per layer as in flexmoe (every group's rows are rewritten below)
            joint = layers > 1 and groups > 1 and pols[(0, 0)].rules.joint_layers
            if joint and l > 0:
                return auto_joint.pop(l)
            todo = range(layers) if joint else [l]
            runs = {}
            for k in todo:
                ck = trace[it, k].reshape(groups, p, n_exp).astype(np.float64)
                if k not in flex_out:
                    flex_out[k] = (np.empty_like(ck), np.empty((groups, p, p)))
                local, traffic = flex_out[k]
                trans, agg, adj = (np.zeros((groups, p)) for _ in range(3))
                layer_pols = [pols[(g, k)] for g in range(groups)]
                for pol in layer_pols:  # this plan serves iterations it+1 .. iters-1
                    pol.remaining = (iters - 1 - it) / pol.interval
                for g in range(groups):
                    placement = prev.get((g, k)) or Placement.plain(n_exp, p)
                    if placement.has_vexperts:
                        run_flex(g, layer_pols[g].run_priced(ck[g], placement), local, traffic, agg)
                    else:
                        run_replicas(g, placement, ck, local, traffic, trans, agg)
                runs[k] = (ck, layer_pols, local, traffic, trans, agg, adj, [pol.choice for pol in layer_pols])
            if joint:
                planned, dt = timer(plan_layers, [runs[k][1] for k in todo], [list(runs[k][0]) for k in todo],
                                    regimes[0])
                dt /= layers
            else:
                got, dt = timer(plan_groups, runs[l][1], list(runs[l][0]), regimes[l])
                planned = {l: got}
            for k in todo:
                ck, layer_pols, local, traffic, trans, agg, adj, was = runs[k]
                for g, pol in enumerate(layer_pols):
                    prev[(g, k)] = planned[k][g]
                    if pol.choice == "flexmoe":
                        if was[g] != "flexmoe":              # switching in: each expert down a chain from its owner
                            moves = [(int(a), int(b), float(costs[g].state_bytes))
                                     for a, b in zip(*pol.build_moves(planned[k][g]))]
                        else:
                            moves = pol.cands["flexmoe"].adjustment_bytes(pol.last_ops)
                        charge_moves(g, moves, adj)
                plan_h = np.full(groups, dt / groups)
                runs[k] = Assignment(local, traffic, trans, agg, np.zeros(groups), plan_h, adj)
            if joint:
                auto_joint.update((k, runs[k]) for k in todo if k != l)
            return runs[l]
        else:   # proprophet: plan from the previous iteration's counts (locality), applied now
            local = np.empty_like(c); traffic = np.empty((groups, p, p))
            for g in range(groups):
                pred = prev.get((g, l))                          # iteration 0: plain EP
                placement = Placement.plain(n_exp, p)
                if pred is not None:
                    placement, plan_h[g] = timer(pols[(g, l)].plan, pred)   # plan j+1 overlaps dispatch of j
                run_replicas(g, placement, c, local, traffic, trans, agg)
                prev[(g, l)] = c[g]
        return Assignment(local, traffic, trans, agg, plan_s, plan_h, adj)

    res = simulate_iterations(cluster, assign, iters, layers, algorithm, overlap=overlap, degree=degree)
    if base == "flexmoe":
        res.values["plan_s"] += sum(getattr(pp, "plan_seconds", 0.0) for pp in pols.values()) / max(1, iters) / groups
    return res


def compare(trace: np.ndarray, cluster: Cluster, policies: Sequence[str], algorithms: Sequence[str],
            policy_kwargs: Optional[Dict[str, Dict]] = None, **kw) -> Dict:
    """Mean breakdown per (algorithm, policy) and speedup over plain EP with the same algorithm.
    ``policy_kwargs`` maps a policy name to its constructor keyword arguments."""
    rows = {}
    pk = policy_kwargs or {}
    for algo in algorithms:
        base = simulate(trace, cluster, "none", algo, **kw)
        b = base.mean()
        rows[(algo, "none")] = dict(b, speedup=1.0, per_iter=base.values["iter_s"])
        for pol in policies:
            if pol == "none":
                continue
            r = simulate(trace, cluster, pol, algo, policy_kwargs=pk.get(pol.split("+")[0]), **kw)
            m = r.mean()
            rows[(algo, pol)] = dict(m, speedup=b["iter_s"] / m["iter_s"], per_iter=r.values["iter_s"])
    return rows
