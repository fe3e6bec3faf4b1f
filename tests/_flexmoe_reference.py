"""Frozen copy of FlexMoE's planner as it was before the speed-up (commit 8587916,
megatron_moe/balance/policies/flexmoe.py): dense pricing of every expert at each step, row re-pricing
of every candidate and accepted pair, Migrate recounting the slot table and the sync of every expert
at each swap.  tests/test_flexmoe_speed.py runs it beside the live policy on seeded inputs and
requires the same ops, slot tables and priced arrays, bit for bit.  Kept verbatim on purpose (it is
the reference, not a second implementation to maintain): do not edit except to follow an intended
change of the planner's decisions."""

from __future__ import annotations

from typing import List, Optional, Tuple

import numpy as np

from megatron_moe.balance.cost_model import sync_s_vec
from megatron_moe.balance.policies.flexmoe import FREE, FlexMoEPolicy, balance_ratio, route_real

CALLS = {"step": 0}


def _expert_parts(origin_t: np.ndarray, n: np.ndarray, cost):
    """(processed[k, G], seconds[k, G]) of :func:`expert_terms`."""
    from megatron_moe.balance.cost_model import sync_s_vec
    keep, spill, frac = route_real(origin_t.T, n)
    proc = keep + spill.sum(axis=1, keepdims=True) * frac
    t = cost.compute_s(proc)
    if cost.pair_s_per_input is not None:
        t = t + 4.0 * frac * _pair_product(spill, cost)
    hosts = n > 0
    return proc, t + sync_s_vec(cost, hosts)[:, None] * hosts


def _pair_product(spill: np.ndarray, cost) -> np.ndarray:
    """``spill @ cost.pair_s_per_input``.  When the per-input link cost is one rate within a node
    and one between nodes (a simulator cluster without NVLink pairs, or a CostModel's single rate)
    it is computed from per-node sums, O(E x G x nodes) instead of the O(E x G^2) matmul that
    dominated FlexMoE at 256-rank groups; the structure is checked once per cost object."""
    pair = cost.pair_s_per_input
    st = getattr(cost, "_ref_pair_structure", None)
    if st is None:
        st = False
        node = cost.node if cost.node is not None else np.zeros(pair.shape[0], dtype=np.int64)
        _, inv = np.unique(node, return_inverse=True)
        onehot = (inv[:, None] == np.arange(inv.max() + 1)[None, :]).astype(np.float64)   # [G, nodes]
        same = (onehot @ onehot.T) > 0
        off = ~np.eye(pair.shape[0], dtype=bool)
        vin, vout = pair[same & off], pair[~same]
        c_in = float(vin[0]) if len(vin) else 0.0
        c_out = float(vout[0]) if len(vout) else 0.0
        if np.all(vin == c_in) and np.all(vout == c_out) and np.all(pair.diagonal() == 0):
            st = (c_in, c_out, onehot)
        cost._ref_pair_structure = st
    if st is False:
        return spill @ pair
    c_in, c_out, onehot = st
    node_sum = (spill @ onehot) @ onehot.T                      # [k, G] spill from g's node
    return c_out * (spill.sum(axis=1, keepdims=True) - node_sum) + c_in * (node_sum - spill)


class RefPriced:
    """Per-expert rows of Eq. 5 for one count matrix, updated row by row as the slot table changes
    (the scheduler loop changes two experts per accepted pair; pricing all E x G again per
    candidate dominated large simulations)."""

    def __init__(self, origin, n, cost):
        self.o_t, self.cost = np.asarray(origin, dtype=np.float64).T, cost
        self.n = np.array(n)
        self.proc, self.terms = _expert_parts(self.o_t, self.n, cost)
        self.base = self.terms.sum(axis=0)

    def time(self) -> float:
        return float(self.base.max())

    def loads(self) -> np.ndarray:
        return self.proc.sum(axis=0)

    def trial(self, rows, n_rows) -> float:
        """Modelled time with ``rows`` of n replaced by ``n_rows``."""
        t = _expert_parts(self.o_t[rows], n_rows, self.cost)[1]
        return float((self.base - self.terms[rows].sum(axis=0) + t.sum(axis=0)).max())

    def update(self, n) -> None:
        rows = np.nonzero((np.asarray(n) != self.n).any(axis=1))[0]
        if len(rows):
            self.n = np.array(n)
            self._reprice(rows)

    def apply(self, plan) -> None:
        """Follow a policy-maker plan (shrink / expand ops) without recounting the slot table."""
        rows = set()
        for op in plan:
            if op[0] == "shrink":
                self.n[op[1], op[2]] -= 1
            elif op[0] == "expand":
                self.n[op[1], op[3]] += 1
            rows.add(op[1])
        self._reprice(sorted(rows))

    def _reprice(self, rows) -> None:
        self.proc[rows], self.terms[rows] = _expert_parts(self.o_t[rows], self.n[rows], self.cost)
        self.base = self.terms.sum(axis=0)



class ReferenceFlexMoE(FlexMoEPolicy):
    """FlexMoEPolicy with the pre-speed-up scheduler, policy maker and Migrate."""

    def make_plan(self, origin: np.ndarray, priced: Optional[RefPriced] = None) -> List[Tuple]:
        """One (Shrink, Expand) pair or a lone Expand; ``priced`` (the scheduler loop's running
        pricing of this ``origin`` and the current table) avoids pricing every expert again."""
        slots = self.table.slots
        if priced is None:
            priced = RefPriced(origin, self.table.counts(), self.cost)
        n = priced.n
        t0 = priced.time()
        tot = np.asarray(origin, dtype=np.float64).sum(axis=0)
        ne = n.sum(axis=1)
        cap = tot / ne
        e_hot = int(np.argmax(cap))                         # argmax returns the lowest id on ties
        hot_hosts = np.nonzero(n[e_hot])[0]
        free = np.argwhere(slots == FREE)
        cands = []                                          # (g, s, e_cold or FREE)
        if len(free):
            cands = [(int(g), int(s), FREE) for g, s in free]
        else:
            ok = (ne >= 2) & (np.arange(self.num_experts) != e_hot)
            if not ok.any():
                return []
            c = np.where(ok, cap, np.inf)
            e_cold = int(np.argmin(c))
            for g in np.nonzero(n[e_cold])[0]:
                s = int(np.nonzero(slots[g] == e_cold)[0][-1])
                cands.append((int(g), s, e_cold))
        node = self.cost.node
        best = None
        scale = max(abs(t0), 1e-30)
        for g, s, e_cold in cands:
            rows = [e_hot] if e_cold == FREE else [e_hot, e_cold]
            n1 = n[rows].copy()
            n1[0, g] += 1
            if e_cold != FREE:
                n1[1, g] -= 1
            t1 = priced.trial(rows, n1)
            same_node = node is not None and bool((node[hot_hosts] == node[g]).any())
            # rounded: candidates equal up to summation order tie-break by the rules that follow
            key = (round(t1 / scale, 12), g not in hot_hosts, not same_node, g)
            if best is None or key < best[0]:
                best = (key, g, s, e_cold)
        (t1, *_), g, s, e_cold = best
        if not t1 < 1.0 - 1e-12:             # strictly lower, beyond summation-order rounding
            return []
        src = int(min(hot_hosts, key=lambda h: (self._link(h, g), h)))
        plan = [("expand", e_hot, src, g, s)]
        if e_cold != FREE:
            plan.insert(0, ("shrink", e_cold, g, s))
        return plan

    def migrate(self, origin: np.ndarray, experts: Optional[List[int]] = None,
                priced: Optional[RefPriced] = None) -> List[Tuple]:
        """Greedy swaps for ``experts`` (default: all replicated experts), ascending id."""
        ops: List[Tuple] = []
        slots = self.table.slots
        if priced is None:
            priced = RefPriced(origin, self.table.counts(), self.cost)
        for _ in range(self.max_migrations):
            n = self.table.counts()
            priced.update(n)
            hosts = n > 0
            sync_e = sync_s_vec(self.cost, hosts)
            sync = sync_e.sum()
            if sync <= 0:
                break
            t0 = priced.time()
            found = None
            multi = np.nonzero(hosts.sum(axis=1) > 1)[0]
            if experts is not None:
                multi = [e for e in multi if e in experts]
            for e in multi:
                hs = np.nonzero(n[e])[0]
                a = int(min(hs, key=lambda h: (n[e, h], h)))          # e's thinnest host
                sa = int(np.nonzero(slots[a] == e)[0][0])
                for b in sorted(hs, key=lambda h: (-n[e, h], h)):
                    if b == a:
                        continue
                    for sb in range(self.slots_per_rank):
                        f = int(slots[b, sb])
                        if f == e:
                            continue
                        rows = [e] if f == FREE else [e, f]
                        r1 = n[rows].copy()
                        r1[0, a] -= 1
                        r1[0, b] += 1
                        if f != FREE:
                            r1[1, b] -= 1
                            r1[1, a] += 1
                        # only rows e and f change: price them alone, confirm a hit exactly
                        s1 = sync - sync_e[rows].sum() + sync_s_vec(self.cost, r1 > 0).sum()
                        if not s1 < sync:
                            continue
                        if priced.trial(rows, r1) <= t0 * (1 + 1e-12):   # Eq. 5 does not rise
                            found = (a, sa, int(b), sb, int(e), f)
                            break
                    if found:
                        break
                if found:
                    break
            if not found:
                break
            a, sa, b, sb, e, f = found
            slots[a, sa], slots[b, sb] = f, e
            ops.append(("migrate", e, a, sa, f, b, sb))
        return ops

    def step(self, origin: np.ndarray) -> List[Tuple]:
        CALLS["step"] += 1
        origin = np.asarray(origin)
        if origin.shape != (self.num_ranks, self.num_experts):
            raise ValueError(f"flexmoe: counts shape {origin.shape} != ({self.num_ranks}, {self.num_experts})")
        ops: List[Tuple] = []
        priced = RefPriced(origin, self.table.counts(), self.cost)
        r = balance_ratio(priced.loads())
        steps = 0
        if r > self.threshold:
            self.calls += 1
        while r > self.threshold and steps < self.max_steps:
            plan = self.make_plan(origin, priced)
            if not plan:
                break
            self._apply(plan)
            ops.extend(plan)
            steps += 1
            priced.apply(plan)
            r = balance_ratio(priced.loads())
        if self.migrate_enabled and ops:
            ops.extend(self.migrate(origin, sorted({op[1] for op in ops if op[0] == "expand"}), priced))
        if ops:
            self.table.version += 1
        return ops
