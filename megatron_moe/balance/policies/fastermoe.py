"""FasterMoE dynamic shadowing (He et al., PPoPP'22, Alg. 1) as a placement policy.

Each iteration and MoE layer, greedily *shadow* the hottest experts: broadcast their parameters from
the owner to every EP rank so each rank computes its own inputs for them locally (those inputs leave
the all-to-all), reduce the shadow gradients to the owner in backward; only the owner updates.

Cost model (design note 2.5, "consistent" variant, the default):

    Lat_imbl(B)       = 3 * fwd * max(B)  + 4 * a2a * max(B)
    Lat_shadow(r, B') = 3 * fwd * max(B') + 4 * a2a * max(B') + 2r * param

``fwd`` = forward expert seconds per input, ``a2a`` = all-to-all seconds per input at the group's
bottleneck bandwidth, ``param`` = one broadcast (or reduce) of one expert's parameters over the group;
all three come from the shared cost object (``PlannerCost``).  The paper's printed Eq. 8 drops the
residual all-to-all term of the non-shadowed inputs, which favours shadowing even when the load is
balanced; ``paper_literal=True`` reproduces it.

Several experts per rank: counts are ``T[source_rank, expert]`` and shadowing expert e moves
``T[j, e]`` from owner(e) to j for every j != owner(e) (the note's subtraction fix, not "B_i <- T_ii").
Candidates are visited in descending order of the ORIGINAL per-expert load, ties by lower expert id,
and the greedy stops at the first candidate that does not lower the modelled time, so the result is
a prefix, deterministic on every rank given the same all-gathered counts.
"""

from __future__ import annotations

import dataclasses
from typing import List, Optional, Sequence

import numpy as np

from megatron_moe.balance.policies.base import BalancePolicy, Placement, register_policy
from megatron_moe.balance.cost_model import a2a_s, as_planner_cost

__all__ = ["FasterMoEPolicy", "ShadowPlan", "default_owner", "lat_imbl", "lat_shadow", "select_shadow"]


def default_owner(num_experts: int, num_ranks: int) -> np.ndarray:
    """Plain EP ownership: expert e lives on rank e * D // E (megatron-core's contiguous split)."""
    return (np.arange(num_experts) * num_ranks) // num_experts


def lat_imbl(b_max: float, cost) -> float:
    return 3.0 * cost.fwd_s_per_input * b_max + 4.0 * a2a_s(cost, b_max)


def lat_shadow(r: int, b_max: float, cost, paper_literal: bool = False) -> float:
    t = 3.0 * cost.fwd_s_per_input * b_max + 2.0 * r * cost.param_collective_s
    if not paper_literal:
        t += 4.0 * a2a_s(cost, b_max)
    return t


def loads(counts: np.ndarray, owner: np.ndarray, shadowed: Sequence[int] = ()) -> np.ndarray:
    """Per-rank computed inputs B when ``shadowed`` experts are computed at every source."""
    counts = np.asarray(counts, dtype=np.float64)
    d, e = counts.shape
    b = np.zeros(d)
    mask = np.zeros(e, dtype=bool)
    mask[list(shadowed)] = True
    np.add.at(b, owner[~mask], counts[:, ~mask].sum(axis=0))
    b += counts[:, mask].sum(axis=1)
    return b


@dataclasses.dataclass
class ShadowPlan:
    shadowed: List[int]          # experts broadcast to every rank, in acceptance order
    time_s: float                # modelled time of the plan
    noop_time_s: float           # modelled time without shadowing
    loads_before: np.ndarray
    loads_after: np.ndarray

    def replica_sets(self, owner: np.ndarray, num_ranks: int) -> List[List[int]]:
        """Placement in Pro-Prophet form: replica set per expert (owner only, or all ranks)."""
        sets = [[int(o)] for o in owner]
        for e in self.shadowed:
            sets[e] = list(range(num_ranks))
        return sets


def select_shadow(counts: np.ndarray, cost, owner: Optional[np.ndarray] = None,
                  paper_literal: bool = False, max_shadow: Optional[int] = None) -> ShadowPlan:
    """Algorithm 1 (greedy prefix).  ``counts[j, e]`` = inputs on rank j routed to expert e."""
    counts = np.asarray(counts, dtype=np.float64)
    if counts.ndim != 2:
        raise ValueError(f"fastermoe: counts must be [ranks, experts], got shape {counts.shape}")
    d, e = counts.shape
    owner = default_owner(e, d) if owner is None else np.asarray(owner)
    if owner.shape != (e,) or owner.min() < 0 or owner.max() >= d:
        raise ValueError(f"fastermoe: owner must be {e} ranks in [0, {d}), got {owner}")
    b = loads(counts, owner)
    best = lat_imbl(b.max(), cost)
    noop = best
    cur = b.copy()
    chosen: List[int] = []
    per_expert = counts.sum(axis=0)
    order = sorted(range(e), key=lambda x: (-per_expert[x], x))
    limit = e if max_shadow is None else max_shadow
    for x in order:
        if len(chosen) >= limit or per_expert[x] <= 0:
            break
        o = owner[x]
        col = counts[:, x]
        trial = cur + col                          # every rank computes its own inputs for x ...
        trial[o] -= col.sum()                      # ... the owner keeps only its own (col[o] added above)
        c = lat_shadow(len(chosen) + 1, trial.max(), cost, paper_literal)
        if c < best:
            best, cur = c, trial
            chosen.append(int(x))
        else:
            break
    return ShadowPlan(chosen, best, noop, b, cur)


@register_policy
class FasterMoEPolicy(BalancePolicy):
    """``--moe-balance-policy fastermoe``: re-plans from the given counts every call.

    ``cost``: the balance ``CostModel`` (training), a ``PlannerCost`` (simulator) or None (defaults).
    ``plan`` returns a Pro-Prophet-style ``Placement`` (shadowed experts replicated to every rank), so
    the balance engineer's layer executes it: Trans = broadcast from the owner, Agg = reduce to it.
    """

    name = "fastermoe"

    def __init__(self, num_experts: int, num_ranks: int, cost=None, paper_literal: bool = False,
                 max_shadow: Optional[int] = None, owner: Optional[np.ndarray] = None, **_ignored):
        super().__init__(num_experts, num_ranks)
        self.cost = as_planner_cost(cost, num_ranks)
        self.owner = default_owner(num_experts, num_ranks) if owner is None else np.asarray(owner)
        self.paper_literal = bool(paper_literal)
        self.max_shadow = max_shadow
        self.last_plan: Optional[ShadowPlan] = None

    def select(self, counts: np.ndarray) -> ShadowPlan:
        self.last_plan = select_shadow(counts, self.cost, self.owner, self.paper_literal, self.max_shadow)
        return self.last_plan

    def plan(self, counts, current: Optional[Placement] = None) -> Placement:
        sp = self.select(np.asarray(counts))
        return Placement(sp.replica_sets(self.owner, self.num_ranks), self.num_ranks).validate()
