"""Pro-Prophet's search loop, sped up for auto at 8192 GPUs (contiguous columns, max(H) as
H[argmax], Eq. 6 from the maxima, t_trans per s), returns exactly what the plain loop it replaced
returns: that loop is kept here as the reference (``_reference_search``) and both run on random
count matrices over n, eq8, ring / paper Eq. 4 and latencies; every field compares with ``==``."""

from typing import List, Optional, Tuple

import numpy as np
import pytest

from megatron_moe.balance.cost_model import CostModel
from megatron_moe.balance.policies.base import default_owner
from megatron_moe.balance.policies.proprophet import N_COST, SearchResult, check_n, fanouts, search


def _reference_search(C, cost: CostModel, alpha: float, n: int, num_inputs: Optional[float] = None,
           eq8: bool = False) -> SearchResult:
    """Algorithm 1 on the count matrix ``C[d, e]``; ``num_inputs`` = I (default: C.sum()).
    ``n="cost"``: the cheapest of the searches over ``fanouts(D)`` (first = n 0 wins ties)."""
    C = np.asarray(C, dtype=np.float64)
    if C.ndim != 2:
        raise ValueError(f"proprophet: counts must be [ranks, experts], got shape {C.shape}")
    D, E = C.shape
    n = check_n(n, D)
    if n == N_COST:
        return min((_reference_search(C, cost, alpha, k, num_inputs, eq8) for k in fanouts(D)), key=lambda r: r.time_s)
    owner = default_owner(E, D)
    I = float(C.sum()) if num_inputs is None else float(num_inputs)
    colsum = C.sum(axis=0)                                     # plain EP loads (ReplaceInputs)
    H = np.bincount(owner, colsum, D).astype(np.float64)
    R = np.bincount(owner, colsum - C[owner, np.arange(E)], D).astype(np.float64)
    H0 = H.copy()
    t_best = cost.layer_time(R, H, 0, 0, D, eq8)
    t_noop = t_best
    best_H, best_R, cnt = H, R, 0
    steps: List[Tuple[int, List[int]]] = []
    times: List[float] = []
    selected = np.zeros(E, dtype=bool)
    used = np.zeros(D, dtype=bool)
    remote_load = C.sum(axis=0) - C[owner, np.arange(E)]     # sum_{d != owner} C[d, e]
    # ring-form Eq. 4 (the simulator's broadcasts): each rank pays the broadcasts of the replica sets
    # it is in and the layer waits for the busiest, so with n > 0 the priced s is the largest number
    # of sets one rank is in (= the plan's length when n = 0); the paper's form keeps s, its (D-n)/D
    # is already the average share
    members_of = np.zeros(D) if n and getattr(cost, "trans_ring", False) else None
    own: dict = {}                                             # rank -> its experts (owner == i), as met
    stop = "exhausted"
    while True:
        if H.max() - H.min() < alpha * I / E:                  # Eq. 7
            stop = "balanced"
            break
        if len(steps) == E:                                    # every expert selected (one per step)
            break
        i = int(np.argmax(H))                                  # first maximum = lowest rank
        if used[i]:
            stop = "used"
            break
        ex = own.get(i)
        if ex is None:
            ex = own[i] = np.nonzero(owner == i)[0].tolist()
        mine = [e for e in ex if not selected[e]]
        e = int(min(mine, key=lambda x: (-remote_load[x], x)))
        selected[e] = True
        if all(selected[x] for x in ex):
            used[i] = True
        o = int(owner[e])
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
        H = H + moved
        ms = moved.sum()
        H[o] -= ms
        R = R.copy()
        R[o] -= ms
        steps.append((e, nb))
        s_priced = len(steps)
        if members_of is not None:
            members_of += members
            s_priced = int(members_of.max())
        t = cost.layer_time(R, H, s_priced, n, D, eq8)
        times.append(t)
        if t < t_best:                                         # strict: ties keep the shorter prefix
            t_best, cnt, best_H, best_R = t, len(steps), H, R
    return SearchResult(steps[:cnt], steps, times, t_best, t_noop, H0, best_H, best_R, stop, n)


@pytest.mark.parametrize("ring", [False, True])
@pytest.mark.parametrize("eq8", [False, True])
@pytest.mark.parametrize("D,E", [(4, 4), (8, 16), (16, 16), (32, 64)])
def test_search_equals_reference_loop(D, E, eq8, ring):
    rng = np.random.default_rng(D * 7 + E + 2 * eq8 + ring)
    cm = CostModel.from_dict({}, trans_ring=ring, trans_latency=2e-6 if ring else 0.0, a2a_latency=1e-6,
                             t_fnec=1e-4, t_bnec=2e-4)
    for trial in range(6):
        w = rng.gamma(0.5, size=E) ** 2
        C = rng.poisson(4000 * w / w.sum() * E / D, size=(D, E)).astype(np.float64)
        if trial % 2:                               # non-integer counts: sums round, order matters
            C *= rng.uniform(0.3, 1.7, size=C.shape)
        if trial == 5:
            C[:] = 7.0                              # balanced at once: the empty plan
        for n in [0, 1, D // 2, D - 1, "cost"]:
            for alpha in (0.0, 0.5, 3.0):
                got, want = search(C, cm, alpha, n, None, eq8), _reference_search(C, cm, alpha, n, None, eq8)
                for f in ("plan", "steps", "step_times", "time_s", "noop_time_s", "stop", "n"):
                    assert getattr(got, f) == getattr(want, f), (f, n, alpha)
                for f in ("H_before", "H_after", "R_after"):
                    assert np.array_equal(getattr(got, f), getattr(want, f)), (f, n, alpha)
