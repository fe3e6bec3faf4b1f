"""Pro-Prophet planner: Algorithm 1, the locality-based greedy search (design note 2.5).

Candidates are the prefixes of one greedy sequence: repeatedly take the heaviest rank (most computed
inputs, ties -> lowest rank), replicate one of its experts to every rank except the ``n`` non-owner
ranks holding the fewest inputs for it (ties -> lowest rank), until the balance condition
(Eq. 7: max H - min H < alpha * I / E) holds or the heaviest rank was already used. The returned
plan is the prefix with the strictly smallest modelled time (Eq. 6, or Eq. 8 with ``eq8``), empty if
nothing beats plain EP.

Generalisation to E > D experts (ours, docs/balance.md): the heaviest rank picks, among its experts
not yet selected, the one with the largest ``sum_{d != owner} C[d, e]`` (ties -> lowest expert); a
rank counts as "used" once all its experts are selected. With E == D this is the paper's rule.

``n="cost"`` (ours, opt-in, ``--moe-balance-n cost``): each plan runs Alg. 1 once per fan-out
k in {D, D/2, D/4, ..., 2} (n = D - k via BottomK: the owner plus the k-1 ranks sending the expert
the most inputs keep a replica) and keeps the plan with the smallest Eq. 6/8 time (ties -> larger k,
so n = 0 when nothing is saved). The paper ran 8-32 GPUs with n in {0, 1}; at hundreds of ranks a
full broadcast sends every hot expert to ranks that route it few inputs. A per-step choice of k
inside one greedy was tried first and lost: a partly replicated owner becomes the heaviest rank
again and the greedy stops on "used" after 2-3 experts (docs/sim.md).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import List, Optional, Tuple

import numpy as np

from megatron_moe.balance.cost_model import CostModel
from megatron_moe.balance.policies.base import (BalancePolicy, Placement, balance_degree, default_owner,
                                                register_policy)

__all__ = ["ProProphetPolicy", "SearchResult", "search", "check_n"]

N_COST = "cost"


def check_n(n, num_ranks: Optional[int] = None):
    """``--moe-balance-n``: an int >= 0 (< num_ranks when known) or ``"cost"``; ValueError names the flag."""
    if isinstance(n, str) and n == N_COST:
        return n
    if isinstance(n, (bool, np.bool_)) or not isinstance(n, (int, np.integer)):
        raise ValueError(f"--moe-balance-n {n!r}: must be an integer >= 0 or 'cost'")
    if n < 0 or (num_ranks is not None and n >= num_ranks):
        hi = f"[0, {num_ranks - 1}] for {num_ranks} EP ranks" if num_ranks is not None else ">= 0"
        raise ValueError(f"--moe-balance-n {n}: must be in {hi} (or 'cost')")
    return int(n)


def fanouts(D: int) -> List[int]:
    """The n tried by ``n="cost"``: n = D - k for k = D, D/2, D/4, ..., 2 (k = ranks holding the expert)."""
    out, k = [], D
    while k >= 2:
        out.append(D - k)
        k //= 2
    return out or [0]


@functools.lru_cache(maxsize=16)
def _owned(E: int, D: int) -> Tuple[Tuple[int, ...], ...]:
    """Per rank, the experts it owns (``default_owner``), ascending."""
    own: List[List[int]] = [[] for _ in range(D)]
    for e, o in enumerate(default_owner(E, D).tolist()):
        own[o].append(e)
    return tuple(map(tuple, own))


@dataclasses.dataclass
class SearchResult:
    plan: List[Tuple[int, List[int]]]       # the chosen prefix: (expert, excluded ranks)
    steps: List[Tuple[int, List[int]]]      # the whole greedy sequence evaluated
    step_times: List[float]                 # modelled time after each step
    time_s: float                           # modelled time of the chosen plan
    noop_time_s: float                      # modelled time of plain EP
    H_before: np.ndarray
    H_after: np.ndarray
    R_after: np.ndarray
    stop: str                               # "balanced" | "used" | "exhausted"
    n: int = 0                              # the n the plan was searched with

    @property
    def balance_before(self) -> float:
        return balance_degree(self.H_before)

    @property
    def balance_after(self) -> float:
        return balance_degree(self.H_after)


def search(C, cost: CostModel, alpha: float, n: int, num_inputs: Optional[float] = None,
           eq8: bool = False) -> SearchResult:
    """Algorithm 1 on the count matrix ``C[d, e]``; ``num_inputs`` = I (default: C.sum()).
    ``n="cost"``: the cheapest of the searches over ``fanouts(D)`` (first = n 0 wins ties)."""
    C = np.asarray(C, dtype=np.float64)
    if C.ndim != 2:
        raise ValueError(f"proprophet: counts must be [ranks, experts], got shape {C.shape}")
    D, E = C.shape
    n = check_n(n, D)
    if n == N_COST:
        return min((search(C, cost, alpha, k, num_inputs, eq8) for k in fanouts(D)), key=lambda r: r.time_s)
    owner = default_owner(E, D)
    I = float(C.sum()) if num_inputs is None else float(num_inputs)
    colsum = C.sum(axis=0)                                     # plain EP loads (ReplaceInputs)
    H = np.bincount(owner, colsum, D).astype(np.float64)
    remote_load = colsum - C[owner, np.arange(E)]              # sum_{d != owner} C[d, e]
    R = np.bincount(owner, remote_load, D).astype(np.float64)
    H0 = H.copy()
    t_best = cost.layer_time(R, H, 0, 0, D, eq8)
    t_noop = t_best
    # H and R are updated in place below: the best prefix's are copies (the plain arrays if none wins)
    best_H, best_R, cnt = H.copy(), R.copy(), 0
    steps: List[Tuple[int, List[int]]] = []
    times: List[float] = []
    selected = [False] * E                                     # (lists: read one item at a time)
    used = [False] * D
    owner_l = owner.tolist()
    # ring-form Eq. 4 (the simulator's broadcasts): each rank pays the broadcasts of the replica sets
    # it is in and the layer waits for the busiest, so with n > 0 the priced s is the largest number
    # of sets one rank is in (= the plan's length when n = 0); the paper's form keeps s, its (D-n)/D
    # is already the average share
    members_of = np.zeros(D) if n and getattr(cost, "trans_ring", False) else None
    own = _owned(E, D)                                         # rank -> its experts (owner == i)
    stop = "exhausted"
    # speed (the same arithmetic as the plain loop: tests/test_proprophet_search_speed.py pins it):
    # max(H) as H[argmax] (also the next step's rank), Eq. 6 from the maxima and a
    # per-s table of t_trans (eq8 keeps layer_time, which reads H); max(R) and its all-to-all term
    # recomputed only when the entry a step lowers could have been the maximum
    thresh = alpha * I / E
    trans: dict = {}
    i = int(H.argmax())
    r_max = float(R.max()) if len(R) else 0.0
    a2a4 = None
    while True:
        if H[i] - H.min() < thresh:                            # Eq. 7 (H[i] = max H)
            stop = "balanced"
            break
        if len(steps) == E:                                    # every expert selected (one per step)
            break
        # i: first maximum = lowest rank
        if used[i]:
            stop = "used"
            break
        ex = own[i]
        mine = [e for e in ex if not selected[e]]
        e = int(min(mine, key=lambda x: (-remote_load[x], x))) if len(mine) > 1 else int(mine[0])
        selected[e] = True
        if all(selected[x] for x in ex):
            used[i] = True
        o = owner_l[e]
        col = C[:, e]
        members = np.ones(D, dtype=bool) if n else None        # (n = 0: every rank)
        nb: List[int] = []
        if n:
            others = np.delete(np.arange(D), o)
            order = np.lexsort((others, col[others]))            # by count, ties -> lowest rank
            nb = sorted(int(d) for d in others[order[:n]])       # BottomK
            members[nb] = False
        # incremental ReplaceInputs: inputs of e from the new replica ranks stay there
        moved = np.where(members, col, 0.0) if n else np.array(col)    # (n = 0: every rank a member)
        moved[o] = 0.0
        H += moved
        ms = moved.sum()
        H[o] -= ms
        r_old = R[o]
        R[o] -= ms
        r_new = R[o]
        if r_old == r_max or r_new != r_new:                   # (the max may have dropped; NaN)
            r_max, a2a4 = float(R.max()), None
        elif r_new > r_max:
            r_max, a2a4 = float(r_new), None
        steps.append((e, nb))
        s_priced = len(steps)
        if members_of is not None:
            members_of += members
            s_priced = int(members_of.max())
        i = int(H.argmax())
        if eq8:
            t = cost.layer_time(R, H, s_priced, n, D, eq8)
        else:
            ts = trans.get(s_priced)
            if ts is None:
                ts = trans[s_priced] = cost.t_trans(s_priced, n, D)
            if a2a4 is None:
                a2a4 = cost.a2a_term_of_max(r_max)
            t = cost.layer_time_of_parts(a2a4, float(H[i]), ts)
        times.append(t)
        if t < t_best:                                         # strict: ties keep the shorter prefix
            t_best, cnt, best_H, best_R = t, len(steps), H.copy(), R.copy()
    return SearchResult(steps[:cnt], steps, times, t_best, t_noop, H0, best_H, best_R, stop, n)


@register_policy
class ProProphetPolicy(BalancePolicy):
    """``--moe-balance-policy proprophet``: ``plan(counts) -> Placement`` via Algorithm 1."""

    name = "proprophet"

    def __init__(self, num_experts: int, num_ranks: int, cost: Optional[CostModel] = None,
                 alpha: float = 3.0, n=0, eq8: bool = False, num_inputs: Optional[float] = None):
        super().__init__(num_experts, num_ranks)
        self.cost = cost if cost is not None else CostModel.from_profile(None)
        self.alpha, self.n, self.eq8, self.num_inputs = float(alpha), check_n(n, num_ranks), bool(eq8), num_inputs
        if self.alpha < 0:
            raise ValueError(f"--moe-balance-alpha {alpha}: must be >= 0")
        self.last: Optional[SearchResult] = None

    def plan(self, counts, current: Optional[Placement] = None) -> Placement:
        self.last = search(counts, self.cost, self.alpha, self.n, self.num_inputs, self.eq8)
        return Placement.from_plan(self.last.plan, self.num_experts, self.num_ranks)
