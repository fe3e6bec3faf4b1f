"""FlexMoE vExperts (Nie et al., SIGMOD'23) as a placement policy.

Every EP rank has ``S`` expert slots (vExperts).  An expert may occupy several slots on one or more
ranks; its inputs are split evenly over its vExperts by the flexible token router (Alg. 3, locality
first, overflow proportional to spare capacity, with the design note's sign fix
``spare = max(0, cap_e * n_eg - origin[g, e])``).  Replicas on different ranks sum their gradients
over the replica group; same-rank vExperts share one weight copy.

Scheduler (Alg. 1): if the balance ratio max/mean rank load exceeds ``threshold``, ask the policy
maker (Alg. 2) for one (Expand e_hot, Shrink e_cold) pair at a time; accept it only if the modelled
step time (Eq. 5: compute + 4 all-to-all receive terms + replica sync, max over ranks) strictly falls.
Then greedy Migrate swaps tighten replica groups (lower total sync cost, max load not raised).

Choices the paper leaves open (documented in docs/sim.md):
* e_hot = argmax cap_e, e_cold = argmin cap_e over experts with n_e >= 2 and != e_hot (never
  remove an expert's last copy); ties -> lower expert id.  A FREE slot is used by Expand alone.
* The freed slot is the one of e_cold's ranks that gives the lowest modelled time; ties prefer a
  rank already hosting e_hot, then the same node as a replica of e_hot, then the lower rank.
* The copy source for Expand is the replica of e_hot with the cheapest link to the target.
* Adjustment cost is not part of the accept test (paper-literal); the simulator charges the state
  transfers on the comm resource (best effort) and the new placement applies from the next step.
* Hard cap of ``max_steps`` (default G*S) accepted pairs per call.
"""

from __future__ import annotations

import collections
import dataclasses
import json
from typing import Dict, List, Optional, Tuple

import numpy as np

from megatron_moe.balance.policies.base import (BalancePolicy, Placement, default_owner,  # noqa: F401
                                                register_policy, route_tokens)
from megatron_moe.balance.cost_model import as_planner_cost

__all__ = ["SlotTable", "FlexMoEPolicy", "route_real", "route_tokens", "flex_cost", "balance_ratio",
           "initial_slots", "FREE"]

FREE = -1


def initial_slots(num_experts: int, num_ranks: int, slots_per_rank: int) -> np.ndarray:
    """Plain-EP-like start: slot k (rank-major) holds expert k * E // (G * S); every expert gets
    G*S/E consecutive slots, so with E = G and S = 2 each rank holds its own expert twice."""
    total = num_ranks * slots_per_rank
    if total < num_experts:
        raise ValueError(f"flexmoe: {num_ranks} ranks x {slots_per_rank} slots < {num_experts} experts; "
                         "raise --moe-flexmoe-slots")
    return ((np.arange(total) * num_experts) // total).reshape(num_ranks, slots_per_rank)


@dataclasses.dataclass
class SlotTable:
    """``slots[rank, slot]`` = expert id or FREE.  Identical on every rank; JSON-serialisable."""
    slots: np.ndarray
    num_experts: int
    version: int = 0

    def __post_init__(self):
        self.slots = np.asarray(self.slots, dtype=np.int64)
        if self.slots.ndim != 2:
            raise ValueError(f"flexmoe slot table must be [ranks, slots], got {self.slots.shape}")
        bad = (self.slots < FREE) | (self.slots >= self.num_experts)
        if bad.any():
            raise ValueError(f"flexmoe slot table: expert ids out of range at {np.argwhere(bad)[:3].tolist()}")
        missing = set(range(self.num_experts)) - set(self.slots[self.slots >= 0].tolist())
        if missing:
            raise ValueError(f"flexmoe slot table: experts {sorted(missing)[:5]} have no vExpert")

    @property
    def num_ranks(self) -> int:
        return self.slots.shape[0]

    def counts(self) -> np.ndarray:
        """n[e, g] = vExperts of expert e on rank g."""
        n = np.zeros((self.num_experts, self.num_ranks), dtype=np.int64)
        g, _ = np.nonzero(self.slots >= 0)
        np.add.at(n, (self.slots[self.slots >= 0], g), 1)
        return n

    def replica_groups(self) -> List[List[int]]:
        n = self.counts()
        return [np.nonzero(n[e])[0].tolist() for e in range(self.num_experts)]

    def to_dict(self) -> Dict:
        return {"format": "flexmoe-slots-v1", "num_experts": int(self.num_experts),
                "version": int(self.version), "slots": self.slots.tolist()}

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_dict(cls, d: Dict, num_ranks: Optional[int] = None,
                  num_experts: Optional[int] = None) -> Optional["SlotTable"]:
        """Restore a checkpointed table.  Returns None when the checkpoint's EP size or expert count
        differs from the run's (the caller then falls back to :func:`initial_slots`)."""
        if d.get("format") != "flexmoe-slots-v1":
            raise ValueError(f"flexmoe slot table: unknown format {d.get('format')!r}")
        t = cls(np.asarray(d["slots"]), int(d["num_experts"]), int(d.get("version", 0)))
        if (num_ranks is not None and t.num_ranks != num_ranks) or \
                (num_experts is not None and t.num_experts != num_experts):
            return None
        return t

    @classmethod
    def from_json(cls, s: str, **kw) -> Optional["SlotTable"]:
        return cls.from_dict(json.loads(s), **kw)


def route_real(origin: np.ndarray, n: np.ndarray):
    """Alg. 3 in real numbers for all experts at once.

    ``origin[g, e]`` gate counts, ``n[e, g]`` vExperts.  Returns ``keep[e, g]`` (computed at the
    source), ``spill[e, g]`` (sent away) and ``frac[e, g]`` (share of every spill that rank g
    receives, proportional to its spare room; rows sum to 1 where anything spills).
    Every replica rank g then processes exactly cap_e * n[e, g] inputs of e.
    """
    o = np.asarray(origin, dtype=np.float64).T                  # [E, G]
    tot = o.sum(axis=1)
    ne = n.sum(axis=1)
    cap = tot / np.maximum(ne, 1)
    capacity = cap[:, None] * n
    keep = np.minimum(capacity, o)
    spill = o - keep
    spare = capacity - keep                                     # sign-fixed: >= 0
    s = spare.sum(axis=1, keepdims=True)
    frac = np.divide(spare, s, out=np.zeros_like(spare), where=s > 0)
    return keep, spill, frac


def balance_ratio(loads: np.ndarray) -> float:
    """max / mean rank load (Eq. 6); 1.0 for an all-zero load."""
    loads = np.asarray(loads, dtype=np.float64)
    m = loads.mean()
    return float(loads.max() / m) if m > 0 else 1.0


def flex_cost(origin: np.ndarray, n: np.ndarray, cost, details: bool = False):
    """Eq. 5: max over ranks of compute + all-to-all receive (x4) + replica sync of hosted experts."""
    from megatron_moe.balance.cost_model import sync_s_vec
    keep, spill, frac = route_real(origin, n)
    processed = keep + spill.sum(axis=1, keepdims=True) * frac        # [E, G]
    load = processed.sum(axis=0)
    t = cost.compute_s(load)
    if cost.pair_s_per_input is not None:
        t = t + 4.0 * (frac * (spill @ cost.pair_s_per_input)).sum(axis=0)
    hosts = n > 0
    t = t + (sync_s_vec(cost, hosts)[:, None] * hosts).sum(axis=0)
    if details:
        return float(t.max()), load, t
    return float(t.max())


def expert_terms(origin_t: np.ndarray, n: np.ndarray, cost) -> np.ndarray:
    """Eq. 5 split by expert: ``[k, G]`` seconds each of the given experts adds to every rank
    (compute of what it processes there, its all-to-all receives x4, its replica sync on its hosts).
    ``origin_t[k, G]`` and ``n[k, G]`` are those experts' rows; summed over all experts this is
    :func:`flex_cost`'s per-rank time, so a candidate that changes two experts is priced by
    re-evaluating their two rows only (the policy maker's ranking; the accept test stays exact)."""
    return _expert_parts(origin_t, n, cost)[1]


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
    st = getattr(cost, "_pair_structure", None)
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
        cost._pair_structure = st
    if st is False:
        return spill @ pair
    c_in, c_out, onehot = st
    node_sum = (spill @ onehot) @ onehot.T                      # [k, G] spill from g's node
    return c_out * (spill.sum(axis=1, keepdims=True) - node_sum) + c_in * (node_sum - spill)


class _Priced:
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
        t = expert_terms(self.o_t[rows], n_rows, self.cost)
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


@register_policy
class FlexMoEPolicy(BalancePolicy):
    """``--moe-balance-policy flexmoe``: stateful; ``step(origin)`` adjusts the slot table.

    ``plan(counts, current)`` (the balance interface) runs ``step`` and returns the slot table as a
    ``Placement`` (replica set = ranks holding a vExpert, plus the owner; ``vexperts`` = the slot
    counts).  The balance layer executes it with the flexible token router (``route_tokens``, via
    ``dispatch_matrix``): local vExperts first, overflow spread over the other replicas by spare
    capacity.  Replicas are persistent there by default (``--moe-flexmoe-replicas``; they keep weights
    and optimizer state, params + state move from the owner only when a rank joins an expert's
    replica set, see ``placement.LayerBalance``), or transient (parameters sent from the owner each
    iteration, grads summed back into it).
    """

    name = "flexmoe"

    def __init__(self, cost=None, num_experts: int = 0, num_ranks: int = 0, slots_per_rank: Optional[int] = None,
                 threshold: float = 1.15, max_steps: Optional[int] = None, migrate: bool = True,
                 max_migrations: Optional[int] = None, table: Optional[SlotTable] = None, **_ignored):
        super().__init__(num_experts, num_ranks)
        if num_experts < 1 or num_ranks < 1:
            raise ValueError(f"flexmoe: num_experts={num_experts} and num_ranks={num_ranks} must be >= 1")
        cost = as_planner_cost(cost, num_ranks)
        if threshold < 1.0:
            raise ValueError(f"flexmoe: --moe-flexmoe-threshold {threshold} must be >= 1")
        if slots_per_rank is None:
            slots_per_rank = 2 * max(1, -(-num_experts // num_ranks))
        self.cost = cost
        self.num_experts, self.num_ranks, self.slots_per_rank = num_experts, num_ranks, slots_per_rank
        self.threshold = threshold
        self.max_steps = num_ranks * slots_per_rank if max_steps is None else max_steps
        self.migrate_enabled = migrate
        self.max_migrations = num_ranks if max_migrations is None else max_migrations
        self.table = table or SlotTable(initial_slots(num_experts, num_ranks, slots_per_rank), num_experts)
        if self.table.slots.shape != (num_ranks, slots_per_rank):
            raise ValueError(f"flexmoe: slot table shape {self.table.slots.shape} != "
                             f"({num_ranks}, {slots_per_rank})")
        self.calls = 0            # planner invocations (trigger fired)
        self.last_ops: List[Tuple] = []   # the primitives of the last plan() call
        # plan() may be shared by several MoE layers (the balance manager holds one policy): the slot
        # table of each layer is found again from the placement it last produced (bounded LRU)
        self._by_placement: "collections.OrderedDict" = collections.OrderedDict()
        self.max_tables = 256

    # -- helpers --------------------------------------------------------------------------------
    def loads(self, origin: np.ndarray, n: Optional[np.ndarray] = None) -> np.ndarray:
        n = self.table.counts() if n is None else n
        keep, spill, frac = route_real(origin, n)
        return (keep + spill.sum(axis=1, keepdims=True) * frac).sum(axis=0)

    def cost_of(self, origin, n=None) -> float:
        return flex_cost(origin, self.table.counts() if n is None else n, self.cost)

    def _link(self, a: int, b: int) -> float:
        if a == b:
            return -1.0
        if self.cost.link_s_per_byte is None:
            return 0.0
        return float(self.cost.link_s_per_byte[a, b])

    # -- Alg. 2 -----------------------------------------------------------------------------------
    def make_plan(self, origin: np.ndarray, priced: Optional[_Priced] = None) -> List[Tuple]:
        """One (Shrink, Expand) pair or a lone Expand; ``priced`` (the scheduler loop's running
        pricing of this ``origin`` and the current table) avoids pricing every expert again."""
        slots = self.table.slots
        if priced is None:
            priced = _Priced(origin, self.table.counts(), self.cost)
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

    def _apply(self, plan: List[Tuple]) -> None:
        for op in plan:
            if op[0] == "shrink":
                _, e, g, s = op
                assert self.table.slots[g, s] == e
                self.table.slots[g, s] = FREE
            elif op[0] == "expand":
                _, e, _src, g, s = op
                assert self.table.slots[g, s] == FREE
                self.table.slots[g, s] = e
        for op in plan:                      # only a shrunk expert can have lost its last vExpert
            if op[0] == "shrink":
                assert (self.table.slots == op[1]).any(), "flexmoe: an expert lost its last vExpert"

    # -- Migrate (the paper gives no algorithm; greedy swaps, see module doc) ---------------------
    def migrate(self, origin: np.ndarray, experts: Optional[List[int]] = None,
                priced: Optional[_Priced] = None) -> List[Tuple]:
        """Greedy swaps for ``experts`` (default: all replicated experts), ascending id."""
        from megatron_moe.balance.cost_model import sync_s_vec
        ops: List[Tuple] = []
        slots = self.table.slots
        if priced is None:
            priced = _Priced(origin, self.table.counts(), self.cost)
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

    # -- Alg. 1 -----------------------------------------------------------------------------------
    def step(self, origin: np.ndarray) -> List[Tuple]:
        origin = np.asarray(origin)
        if origin.shape != (self.num_ranks, self.num_experts):
            raise ValueError(f"flexmoe: counts shape {origin.shape} != ({self.num_ranks}, {self.num_experts})")
        ops: List[Tuple] = []
        priced = _Priced(origin, self.table.counts(), self.cost)
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

    # -- balance interface -------------------------------------------------------------------
    def placement(self) -> Placement:
        owner = default_owner(self.num_experts, self.num_ranks)
        n = self.table.counts()
        sets = [sorted(set(np.nonzero(n[e])[0].tolist()) | {int(owner[e])}) for e in range(self.num_experts)]
        return Placement(sets, self.num_ranks, n.tolist()).validate()

    @staticmethod
    def _key(placement: Placement):
        vx = None if placement.vexperts is None else tuple(tuple(r) for r in placement.vexperts)
        return tuple(tuple(s) for s in placement.replica_sets), vx

    def plan(self, counts, current: Optional[Placement] = None) -> Placement:
        """One scheduler step from ``counts``.  With ``current`` (the placement the layer ran), the
        layer's slot table is the one that produced ``current`` (an unknown placement, e.g. plain
        EP at the start, begins from the initial table); without it the policy's own table is used."""
        if current is not None:
            t = self._by_placement.get(self._key(current))
            self.table = (SlotTable(t.slots.copy(), t.num_experts, t.version) if t is not None else
                          SlotTable(initial_slots(self.num_experts, self.num_ranks, self.slots_per_rank),
                                    self.num_experts))
        self.last_ops = self.step(np.asarray(counts))     # the balance manager counts them
        p = self.placement()
        k = self._key(p)
        self._by_placement[k] = SlotTable(self.table.slots.copy(), self.num_experts, self.table.version)
        self._by_placement.move_to_end(k)
        while len(self._by_placement) > self.max_tables:
            self._by_placement.popitem(last=False)
        return p

    def state_dict(self) -> Dict:
        """Checkpointable planner state: the slot tables (identical on every rank)."""
        return {"table": self.table.to_dict(),
                "tables": [t.to_dict() for t in self._by_placement.values()]}

    def load_state_dict(self, d: Dict) -> bool:
        """Restore the slot table; a checkpoint from another EP size / expert count falls back to
        the initial table (returns False) instead of failing."""
        t = SlotTable.from_dict(d["table"], num_ranks=self.num_ranks, num_experts=self.num_experts)
        self._by_placement.clear()
        if t is None or t.slots.shape[1] != self.slots_per_rank:
            self.table = SlotTable(initial_slots(self.num_experts, self.num_ranks, self.slots_per_rank),
                                   self.num_experts)
            return False
        self.table = t
        for td in d.get("tables", []):
            tt = SlotTable.from_dict(td, num_ranks=self.num_ranks, num_experts=self.num_experts)
            if tt is not None:
                self.table, keep = tt, self.table
                self._by_placement[self._key(self.placement())] = tt
                self.table = keep
        return True

    def adjustment_bytes(self, ops: List[Tuple]) -> List[Tuple[int, int, float]]:
        """(src, dst, bytes) transfers the ops need: Expand copies params + optimizer state from
        the source replica (none on the same rank), Migrate swaps both states, Shrink is free."""
        out = []
        sb = float(getattr(self.cost, "state_bytes", 0.0))
        for op in ops:
            if op[0] == "expand" and op[2] != op[3]:
                out.append((op[2], op[3], sb))
            elif op[0] == "migrate":
                _, e, a, _, f, b, _ = op
                out.append((b, a, sb) if f != FREE else (b, a, 0.0))
                out.append((a, b, sb))
        return out
