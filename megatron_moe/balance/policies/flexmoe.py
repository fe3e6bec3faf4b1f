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
import itertools
import json
from typing import Dict, List, Optional, Tuple

import numpy as np

from megatron_moe.balance.policies.base import (BalancePolicy, Placement, default_owner,  # noqa: F401
                                                register_policy, route_tokens)
from megatron_moe.balance.cost_model import as_planner_cost, sync_s_vec

__all__ = ["SlotTable", "FlexMoEPolicy", "route_real", "route_tokens", "flex_cost", "balance_ratio",
           "initial_slots", "FREE", "Priced", "route_hosts", "sync_hosts", "spill_traffic"]

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

    def copy(self) -> "SlotTable":
        """An independent copy (a table is checked when it is built: a copy needs no second check,
        which set-built every slot per plan)."""
        t = object.__new__(SlotTable)
        t.slots, t.num_experts, t.version = self.slots.copy(), self.num_experts, self.version
        return t

    @property
    def num_ranks(self) -> int:
        return self.slots.shape[0]

    def counts(self) -> np.ndarray:
        """n[e, g] = vExperts of expert e on rank g."""
        used = self.slots >= 0
        g = np.flatnonzero(used) // used.shape[1]                # (np.nonzero(used)[0], without the columns)
        return np.bincount(self.slots[used] * self.num_ranks + g,
                           minlength=self.num_experts * self.num_ranks).reshape(self.num_experts, self.num_ranks)

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


def _ints(a) -> Optional[np.ndarray]:
    """``a`` as an int64 array if every entry is an integer (or an integral float), else None."""
    a = np.asarray(a)
    if a.dtype.kind in "iu":
        return a.astype(np.int64, copy=False)
    if a.dtype.kind == "f" and np.isfinite(a).all() and (a == np.floor(a)).all():
        return a.astype(np.int64)
    return None


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
    pos = s > 0
    if pos.all() and spare.flags.c_contiguous:     # (the same quotients, C-ordered as zeros_like's)
        return keep, spill, spare / s
    frac = np.divide(spare, s, out=np.zeros_like(spare), where=pos)
    return keep, spill, frac


def balance_ratio(loads: np.ndarray) -> float:
    """max / mean rank load (Eq. 6); 1.0 for an all-zero load."""
    loads = np.asarray(loads, dtype=np.float64)
    m = loads.mean()
    return float(loads.max() / m) if m > 0 else 1.0


def flex_cost(origin: np.ndarray, n: np.ndarray, cost, details: bool = False):
    """Eq. 5: max over ranks of compute + all-to-all receive (x4) + replica sync of hosted experts."""
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


def _expert_parts(origin_t: np.ndarray, n: np.ndarray, cost, sync: Optional[np.ndarray] = None):
    """(processed[k, G], seconds[k, G]) of :func:`expert_terms`; ``sync``: ``_sync_rows(cost, n)``
    when the caller has it."""
    keep, spill, frac = route_real(origin_t.T, n)
    ssum = spill.sum(axis=1, keepdims=True)
    proc = keep + ssum * frac
    t = cost.compute_s(proc)
    if cost.pair_s_per_input is not None:
        t = t + 4.0 * frac * _pair_product(spill, cost, ssum)
    hosts = n > 0
    return proc, t + (_sync_rows(cost, n) if sync is None else sync)[:, None] * hosts


def _pair_structure(cost):
    """(c_in, c_out, onehot[G, nodes], node index[G]) when the per-input link cost is one rate
    within a node and one between nodes, else False; checked once per cost object."""
    st = cost.cache.pair_structure
    if st is None:
        pair = cost.pair_s_per_input
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
            st = (c_in, c_out, onehot, inv)
        cost.cache.pair_structure = st
    return st


def _pair_product(spill: np.ndarray, cost, ssum: Optional[np.ndarray] = None) -> np.ndarray:
    """``spill @ cost.pair_s_per_input``.  When the per-input link cost is one rate within a node
    and one between nodes (a simulator cluster without NVLink pairs, or a CostModel's single rate)
    it is computed from per-node sums, O(E x G x nodes) instead of the O(E x G^2) matmul that
    dominated FlexMoE at 256-rank groups; the structure is checked once per cost object.
    ``ssum``: ``spill.sum(axis=1, keepdims=True)`` when the caller has it."""
    st = _pair_structure(cost)
    if st is False:
        return spill @ cost.pair_s_per_input
    c_in, c_out, onehot, _ = st
    node_sum = (spill @ onehot) @ onehot.T                      # [k, G] spill from g's node
    ssum = spill.sum(axis=1, keepdims=True) if ssum is None else ssum
    return c_out * (ssum - node_sum) + c_in * (node_sum - spill)


def _sync_value(cost, row: np.ndarray, hs) -> float:
    """``sync_s_vec`` of one expert whose hosts are ``hs`` (``row`` its count row): it depends only
    on the number of hosts and on whether they span nodes, so it is computed once per such pair by
    ``sync_s_vec`` itself and then looked up (the same float)."""
    cache = cost.cache.sync
    if cache is None:
        cache = cost.cache.sync = {}
        cost.cache.nodes = None if cost.node is None else cost.node.tolist()
    nodes = cost.cache.nodes
    key = (len(hs), nodes is not None and len({nodes[h] for h in hs}) > 1)
    v = cache.get(key)
    if v is None:
        v = cache[key] = float(sync_s_vec(cost, (np.asarray(row) > 0)[None])[0])
    return v


def _sync_rows(cost, n_rows: np.ndarray) -> np.ndarray:
    """``sync_s_vec(cost, n_rows > 0)`` for a few rows, by :func:`_sync_value`."""
    out = np.empty(len(n_rows))
    for i, r in enumerate(n_rows):
        out[i] = _sync_value(cost, r, r.nonzero()[0].tolist())
    return out


def route_hosts(o_t: np.ndarray, n: np.ndarray, ne: np.ndarray) -> Optional[Dict]:
    """:func:`route_real` of ``o_t.T`` on ``n`` (``ne`` its row sums) at the hosts (n > 0) only:
    away from them keep and frac are exactly 0 and spill is the origin count (see
    :func:`_full_parts`, which continues from it). None for counts that are negative or not
    finite; else the host entries (row-major), keep and frac there and the dense spill."""
    tot = o_t.sum(axis=1)                                       # route_real's reduction, same view
    if not np.isfinite(tot).all() or o_t.min() < 0:
        return None
    num_e, num_g = n.shape
    cap = tot / np.maximum(ne, 1)
    flat = np.flatnonzero(n > 0)
    he, hg = np.divmod(flat, num_g)
    k = np.bincount(he, minlength=num_e)                        # hosts per expert
    first = np.cumsum(k) - k
    cap_h = cap[he] * n.ravel()[flat]                           # capacity at the hosts
    o_h = o_t[he, hg]
    keep_h = np.minimum(cap_h, o_h)
    spill = np.array(o_t, order="C")                            # o - 0 away from the hosts
    spill_h = o_h - keep_h
    spill[he, hg] = spill_h
    spare_h = cap_h - keep_h
    s = np.zeros(num_e)                                         # spare.sum(axis=1)
    s[k > 0] = spare_h[first[k > 0]]
    s[k == 2] += spare_h[first[k == 2] + 1]
    many = np.flatnonzero(k > 2)
    if len(many):
        sel = np.flatnonzero(k[he] > 2)
        dense = np.zeros((len(many), num_g))
        dense[np.searchsorted(many, he[sel]), hg[sel]] = spare_h[sel]
        s[many] = dense.sum(axis=1)
    s_h = s[he]
    frac_h = np.divide(spare_h, s_h, out=np.zeros_like(spare_h), where=s_h > 0)
    return dict(he=he, hg=hg, k=k, tot=tot, keep_h=keep_h, spill=spill, spill_h=spill_h, frac_h=frac_h)


def spill_traffic(r: Dict, into: np.ndarray) -> np.ndarray:
    """``into[dst, src]`` = inputs src sends dst by the real-number router (``spill.T @ frac``
    transposed) from its host entries ``r`` (:func:`route_hosts`): summed over the at most S
    experts a rank hosts (frac is zero elsewhere), in expert order; no E x G x G matmul."""
    he, hg, frac_h, spill = r["he"], r["hg"], r["frac_h"], r["spill"]
    sel = np.flatnonzero(frac_h > 0)
    sel = sel[np.argsort(hg[sel], kind="stable")]            # by destination rank
    d = hg[sel]
    pos = np.arange(len(d))
    nth = pos - np.maximum.accumulate(np.where(np.r_[True, d[1:] != d[:-1]], pos, 0))
    rest = np.ones(into.shape[0], dtype=bool)
    for k in range(int(nth.max()) + 1 if len(d) else 0):   # k-th expert hosted by each rank
        m = sel[nth == k]
        rows = spill[he[m]]
        rows *= frac_h[m, None]
        if k == 0:
            if len(m) == len(rest) and not into.flags.c_contiguous:
                # every rank (hg[m] ascending, unique: all of them in order) into the callers'
                # transposed view: in bands of 16 rows, ~4x faster than one scatter writing columns
                for i in range(0, len(m), 16):
                    into[i:i + 16] = rows[i:i + 16]
            else:
                into[hg[m]] = rows
            rest[hg[m]] = False
        else:
            into[hg[m]] += rows
    into[rest] = 0.0
    return into


def _full_parts(o_t: np.ndarray, n: np.ndarray, ne: np.ndarray, cost):
    """:func:`_expert_parts` of every expert, computed at the hosts (n > 0) only: elsewhere keep,
    spare, frac, processed inputs and seconds are exactly 0 and spill is the origin count, so the
    same float operations on the host entries, and the same numpy reductions over dense rows where
    the order of a sum matters (a row sum of one or two nonzeros is exact in any order), give the
    same values bit for bit (tests/test_flexmoe_speed.py compares them with the dense pricing).
    The dense version made 13+ full E x G temporaries per call; at 256-rank groups pricing each
    step's table dominated.  Returns None (caller prices densely) for counts that are negative or
    not finite, else the host entries (row-major, as ``np.nonzero``) and what they need."""
    r = route_hosts(o_t, n, ne)
    if r is None:
        return None
    he, hg, k, tot, keep_h, spill, spill_h, frac_h = (r[x] for x in ("he", "hg", "k", "tot", "keep_h", "spill",
                                                                   "spill_h", "frac_h"))
    ssum = spill.sum(axis=1)
    proc_h = keep_h + ssum[he] * frac_h
    t_h = cost.compute_s(proc_h)
    if cost.pair_s_per_input is not None:
        st = _pair_structure(cost)
        if st is False:
            pp_h = (spill @ cost.pair_s_per_input)[he, hg]
        else:
            c_in, c_out, onehot, inv = st
            # ((spill @ onehot) @ onehot.T)[e, g] is (spill @ onehot)[e, node of g]: a 0/1 product
            node_h = (spill @ onehot)[he, inv[hg]]
            pp_h = c_out * (ssum[he] - node_h) + c_in * (node_h - spill_h)
        t_h = t_h + 4.0 * frac_h * pp_h
    sync_e = sync_hosts(cost, n, he, hg, k)
    t_h = t_h + sync_e[he]
    return dict(he=he, hg=hg, k=k, keep_h=keep_h, frac_h=frac_h, spill=spill, sync_e=sync_e, tot=tot,
                proc_h=proc_h, t_h=t_h)


def sync_hosts(cost, n: np.ndarray, he: np.ndarray, hg: np.ndarray, k: np.ndarray) -> np.ndarray:
    """``sync_s_vec(cost, n > 0)`` from the host entries (``he`` ascending, ``k`` hosts per row)."""
    if cost.grad_bytes <= 0:
        return np.zeros(n.shape[0])
    multi = np.zeros(n.shape[0], dtype=bool)
    if cost.node is not None and len(he):
        nd = cost.node[hg]
        rows = np.flatnonzero(k)
        starts = (np.cumsum(k) - k)[rows]
        multi[rows] = np.minimum.reduceat(nd, starts) != np.maximum.reduceat(nd, starts)
    key = 2 * k + multi
    lut = cost.cache.sync_lut
    if lut is None or len(lut) < 2 * n.shape[1] + 2:
        lut = cost.cache.sync_lut = np.full(2 * n.shape[1] + 2, np.nan)
    out = lut[key]
    for e in np.flatnonzero(np.isnan(out)):                     # first time for this (hosts, spans)
        if np.isnan(lut[key[e]]):
            lut[key[e]] = _sync_value(cost, n[e], n[e].nonzero()[0].tolist())
        out[e] = lut[key[e]]
    return out


class Priced:
    """Per-expert rows of Eq. 5 for one count matrix, updated row by row as the slot table changes
    (the scheduler loop changes two experts per accepted pair; pricing all E x G again per
    candidate dominated large simulations).  The first pricing is :func:`_full_parts` (host
    entries only); a candidate's rows priced by :meth:`trial` are kept and reused when the
    candidate is accepted (a row's price depends only on its origin and count rows).  The rows
    are held sparse (row-major entries: rank, processed inputs, seconds); the per-rank sums are
    ``np.bincount`` over them in expert order, the same additions as the dense column sum."""

    def __init__(self, origin, n, cost, copy: bool = True):
        """``copy=False``: ``n`` is a fresh array nobody else holds (``SlotTable.counts()``), kept."""
        origin = np.asarray(origin, dtype=np.float64)
        self.o_t, self.cost = origin.T, cost
        self.n = np.array(n) if copy else n             # (updated in place below)
        self.ne = self.n.sum(axis=1)                    # vExperts per expert, kept up to date
        self.route = r = _full_parts(self.o_t, self.n, self.ne, cost)
        if r is None:
            # per-expert inputs (the policy maker's numerator); the router's sum is the same one
            self.tot = origin.sum(axis=0)
            self.sync_e = sync_s_vec(cost, self.n > 0)
            self._ptr = np.zeros(self.n.shape[0] + 1, dtype=np.int64)
            self._g, self._p, self._t = np.zeros(0, dtype=np.int64), np.zeros(0), np.zeros(0)
            self._set_rows(range(self.n.shape[0]), *_expert_parts(self.o_t, self.n, cost))
        else:
            self.tot, self.sync_e = r["tot"], r["sync_e"].copy()
            self._ptr = np.concatenate([[0], np.cumsum(r["k"])])
            self._g, self._p, self._t = r["hg"], r["proc_h"], r["t_h"]
            self.base = np.bincount(self._g, weights=self._t, minlength=self.n.shape[1])
        self._rows: Dict = {}                           # (expert, count row bytes) -> (proc, seconds, sync)

    def _set_rows(self, rows, proc: np.ndarray, terms: np.ndarray) -> None:
        """Replace the entries of ``rows`` (ascending) by the nonzeros of their dense rows."""
        ptr, old, gs, ps, ts, at = self._ptr, self._ptr.copy(), [], [], [], 0
        keep = (proc != 0) | (terms != 0)                      # (all rows at once)
        for i, e in enumerate(rows):
            a, b = old[e], old[e + 1]
            nz = np.flatnonzero(keep[i])
            gs += [self._g[at:a], nz]
            ps += [self._p[at:a], proc[i][nz]]
            ts += [self._t[at:a], terms[i][nz]]
            ptr[e + 1:] += len(nz) - (b - a)
            at = b
        self._g = np.concatenate(gs + [self._g[at:]])
        self._p = np.concatenate(ps + [self._p[at:]])
        self._t = np.concatenate(ts + [self._t[at:]])
        self.base = np.bincount(self._g, weights=self._t, minlength=self.n.shape[1])

    def _dense(self, values: np.ndarray, rows) -> np.ndarray:
        out = np.zeros((len(rows), self.n.shape[1]))
        for i, e in enumerate(rows):
            a, b = self._ptr[e], self._ptr[e + 1]
            out[i, self._g[a:b]] = values[a:b]
        return out

    @property
    def proc(self) -> np.ndarray:
        """Dense ``[E, G]`` processed inputs (for checks; the planner reads the sparse rows)."""
        return self._dense(self._p, range(self.n.shape[0]))

    @property
    def terms(self) -> np.ndarray:
        """Dense ``[E, G]`` seconds of Eq. 5 per expert and rank."""
        return self._dense(self._t, range(self.n.shape[0]))

    def time(self) -> float:
        return float(self.base.max())

    def loads(self) -> np.ndarray:
        return np.bincount(self._g, weights=self._p, minlength=self.n.shape[1])

    def trial(self, rows, n_rows, sync: Optional[np.ndarray] = None) -> float:
        """Modelled time with ``rows`` of n replaced by ``n_rows`` (``sync``: their ``_sync_rows``
        when the caller has it; kept with the rows, as their prices, for an accepted candidate)."""
        sync = _sync_rows(self.cost, n_rows) if sync is None else sync
        proc, t = _expert_parts(self.o_t[rows], n_rows, self.cost, sync)
        for i, e in enumerate(rows):
            self._rows[(int(e), n_rows[i].tobytes())] = (proc[i], t[i], sync[i])
        return float((self.base - self._dense(self._t, rows).sum(axis=0) + t.sum(axis=0)).max())

    def update(self, n) -> None:
        rows = np.nonzero((np.asarray(n) != self.n).any(axis=1))[0]
        if len(rows):
            self.n = np.array(n)
            self.ne = self.n.sum(axis=1)
            self._reprice(rows)

    def apply(self, plan) -> None:
        """Follow a policy-maker plan (shrink / expand ops) without recounting the slot table."""
        rows = set()
        for op in plan:
            if op[0] == "shrink":
                self.n[op[1], op[2]] -= 1
                self.ne[op[1]] -= 1
            elif op[0] == "expand":
                self.n[op[1], op[3]] += 1
                self.ne[op[1]] += 1
            rows.add(op[1])
        self._reprice(sorted(rows))

    def swap(self, e: int, a: int, b: int, f: int) -> None:
        """Follow a Migrate swap: a vExpert of e moves a -> b, one of f (or FREE) b -> a."""
        self.n[e, a] -= 1
        self.n[e, b] += 1
        if f != FREE:
            self.n[f, b] -= 1
            self.n[f, a] += 1
        self._reprice(sorted({e} | ({f} if f != FREE else set())))

    def _reprice(self, rows) -> None:
        rows = [int(e) for e in rows]
        hits = [self._rows.get((e, self.n[e].tobytes())) for e in rows]
        if all(h is not None for h in hits):
            proc, terms = np.array([h[0] for h in hits]), np.array([h[1] for h in hits])
            sync = [h[2] for h in hits]
        else:
            sync = _sync_rows(self.cost, self.n[rows])
            proc, terms = _expert_parts(self.o_t[rows], self.n[rows], self.cost, sync)
        self._rows.clear()
        self._set_rows(rows, proc, terms)
        self.sync_e[rows] = sync

    def dispatch(self, local: Optional[np.ndarray] = None, traffic: Optional[np.ndarray] = None):
        """What the simulator runs for these counts and the table they were priced with (call it
        before a step moves the table): ``local[G, E]`` inputs computed where they originate,
        ``traffic[G, G]`` inputs sent (``spill.T @ frac``, summed over the hosts: frac is zero
        elsewhere, and a rank hosts at most its slot count of experts) and ``agg[G]`` replica-sync
        seconds per rank.  ``local`` and ``traffic`` may be given to be filled in place."""
        num_e, num_g = self.n.shape
        local = np.empty((num_g, num_e)) if local is None else local
        traffic = np.empty((num_g, num_g)) if traffic is None else traffic
        if self.route is None:
            keep, spill, frac = route_real(self.o_t.T, self.n)
            hosts = self.n > 0
            local[...], traffic[...] = keep.T, spill.T @ frac
            return local, traffic, (sync_s_vec(self.cost, hosts)[:, None] * hosts).sum(axis=0)
        r = self.route
        he, hg = r["he"], r["hg"]
        local.fill(0.0)
        local[hg, he] = r["keep_h"]
        spill_traffic(r, traffic.T)                               # [dst, src] view
        self.dispatched = traffic                                 # (auto prices this table from it)
        agg = np.bincount(hg, weights=r["sync_e"][he], minlength=num_g)
        return local, traffic, agg


class _TablePlacement(Placement):
    """A slot table's Placement (:meth:`FlexMoEPolicy.plan`) held as its count array ``n[e, g]``:
    replica set of e = ranks with a vExpert of e, plus its owner (the master copy); vexperts = n.
    The lists (``replica_sets``, ``vexperts``: E x G Python ints) are built on first read (at 256-rank
    groups building and checking them was ~15% of auto's time, which reads the arrays only).
    Once they are read, the arrays no longer answer for them (a caller may edit the lists): every
    method then runs :class:`Placement`'s own code on the lists. Equal to a Placement with equal
    fields, as a Placement is."""

    def __init__(self, n: np.ndarray, owner: np.ndarray, num_ranks: int, checked: bool = False):
        hosts = n != 0
        hosts[np.arange(n.shape[0]), owner] = True           # the owner keeps the master copy
        self.num_ranks = int(num_ranks)
        self._n, self._hosts = n, hosts
        # row by row: sorted (the flat indices' columns: np.nonzero's second array, without its first)
        self._flat = np.flatnonzero(hosts)
        self._ranks, self._lens = self._flat % hosts.shape[1], hosts.sum(axis=1)
        self._sets = self._vx = self._akey = None
        if not checked:
            self.validate()

    def _lazy(self) -> bool:
        return self._sets is None and self._vx is None

    def _array_key(self):
        """:meth:`FlexMoEPolicy._list_key` of this placement, from its arrays (made once)."""
        if self._akey is None:
            self._akey = (self._lens.astype(np.int64).tobytes(), self._ranks.astype(np.int64).tobytes(),
                          ("hosts", self._n.shape, self._n.ravel()[self._flat].tobytes()))   # (= _n[_hosts])
        return self._akey

    def _build(self) -> None:
        if self._lazy():
            rl = self._ranks.tolist()
            end = np.cumsum(self._lens).tolist()
            self._sets = [rl[a:b] for a, b in zip([0] + end[:-1], end)]
            self._vx = self._n.tolist()

    @property
    def replica_sets(self) -> List[List[int]]:
        self._build()
        return self._sets

    @replica_sets.setter
    def replica_sets(self, v) -> None:
        self._build()
        self._sets = v

    @property
    def vexperts(self) -> List[List[int]]:
        self._build()
        return self._vx

    @vexperts.setter
    def vexperts(self, v) -> None:
        self._build()
        self._vx = v

    @property
    def has_vexperts(self) -> bool:
        return True if self._lazy() else self._vx is not None

    @property
    def num_experts(self) -> int:
        return len(self._lens) if self._lazy() else len(self._sets)

    def vexperts_array(self) -> Optional[np.ndarray]:
        """The int64 count array while the lists are unread (None after)."""
        return self._n if self._lazy() else None

    def replicated(self) -> List[int]:
        return np.flatnonzero(self._lens > 1).tolist() if self._lazy() else super().replicated()

    def mask(self) -> np.ndarray:
        if not self._lazy():
            return super().mask()
        return self._hosts.T.copy()

    def validate(self, vexperts_array: Optional[np.ndarray] = None) -> "Placement":
        if self._lazy() and not ((self._n < 0).any() or (self._n.sum(axis=1) < 1).any()):
            return self                                       # well formed by construction
        self._build()
        return super().validate(vexperts_array)

    def __eq__(self, other):
        if not isinstance(other, Placement):
            return NotImplemented
        return (self.replica_sets, self.num_ranks, self.vexperts) == (other.replica_sets, other.num_ranks,
                                                                      other.vexperts)

    __hash__ = None


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

    def _nearest(self, hosts: np.ndarray, g: int) -> int:
        """``min(hosts, key=lambda h: (self._link(h, g), h))`` for ascending ``hosts``: the first
        smallest link (vectorised; the loop where a link is NaN, which orders by position)."""
        if self.cost.link_s_per_byte is None:
            link = np.zeros(len(hosts))
        else:
            link = self.cost.link_s_per_byte[hosts, g].astype(np.float64)
            if np.isnan(link).any():
                return int(min(hosts, key=lambda h: (self._link(h, g), h)))
        link[hosts == g] = -1.0
        return int(hosts[np.argmin(link)])

    # -- Alg. 2 -----------------------------------------------------------------------------------
    def make_plan(self, origin: np.ndarray, priced: Optional[Priced] = None) -> List[Tuple]:
        """One (Shrink, Expand) pair or a lone Expand; ``priced`` (the scheduler loop's running
        pricing of this ``origin`` and the current table) avoids pricing every expert again."""
        slots = self.table.slots
        if priced is None:
            priced = Priced(origin, self.table.counts(), self.cost, copy=False)
        n = priced.n
        t0 = priced.time()
        ne = priced.ne
        cap = priced.tot / ne
        e_hot = int(np.argmax(cap))                         # argmax returns the lowest id on ties
        hot_hosts = np.nonzero(n[e_hot])[0]
        free = np.flatnonzero(slots.ravel() == FREE)         # rank-major, as np.argwhere
        cands = []                                          # (g, s, e_cold or FREE)
        if len(free):
            cands = [(int(i) // slots.shape[1], int(i) % slots.shape[1], FREE) for i in free]
        else:
            ok = ne >= 2
            ok[e_hot] = False
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
        src = self._nearest(hot_hosts, g)
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
                priced: Optional[Priced] = None) -> List[Tuple]:
        """Greedy swaps for ``experts`` (default: all replicated experts), ascending id."""
        ops: List[Tuple] = []
        slots = self.table.slots
        if priced is None:
            priced = Priced(origin, self.table.counts(), self.cost, copy=False)
        n = priced.n                                        # follows the swaps (priced.swap)
        cands = range(self.num_experts) if experts is None else sorted(set(experts))
        for _ in range(self.max_migrations):
            sync_e = priced.sync_e
            sync = sync_e.sum()
            if sync <= 0:
                break
            t0 = priced.time()
            found = None
            for e in cands:
                hs = n[e].nonzero()[0].tolist()
                if len(hs) < 2:
                    continue
                ne_row = dict(zip(hs, n[e, hs].tolist()))
                a = min(hs, key=lambda h: (ne_row[h], h))              # e's thinnest host
                sa = int(np.nonzero(slots[a] == e)[0][0])
                for b in sorted(hs, key=lambda h: (-ne_row[h], h)):
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
                        sync1 = _sync_rows(self.cost, r1)
                        s1 = sync - sync_e[rows].sum() + sync1.sum()
                        if not s1 < sync:
                            continue
                        if priced.trial(rows, r1, sync1) <= t0 * (1 + 1e-12):   # Eq. 5 does not rise
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
            priced.swap(e, a, b, f)
            ops.append(("migrate", e, a, sa, f, b, sb))
        return ops

    # -- Alg. 1 -----------------------------------------------------------------------------------
    def price(self, origin: np.ndarray, counts: Optional[np.ndarray] = None) -> Priced:
        """Eq. 5 of ``origin`` on the current slot table; :meth:`Priced.dispatch` gives what the
        simulator runs with it, and ``step(origin, priced)`` starts from it (call dispatch first:
        the step updates it). ``counts``: the table's ``counts()`` when the caller just made them
        (a fresh array, kept and updated by the pricing)."""
        return Priced(origin, self.table.counts() if counts is None else counts, self.cost, copy=False)

    def step(self, origin: np.ndarray, priced: Optional[Priced] = None) -> List[Tuple]:
        origin = np.asarray(origin)
        if origin.shape != (self.num_ranks, self.num_experts):
            raise ValueError(f"flexmoe: counts shape {origin.shape} != ({self.num_ranks}, {self.num_experts})")
        ops: List[Tuple] = []
        priced = self.price(origin) if priced is None else priced
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
        return self._placement_key(self.table.counts())[0]

    def _placement_key(self, n: np.ndarray):
        """(the slot table's placement for its counts ``n``, its :meth:`_key`), the key from the
        arrays the placement is built from (what ``_key`` computes from its lists)."""
        # (a slot table's counts: non-negative, every expert >= 1 vExpert; SlotTable and _apply check it)
        p = _TablePlacement(np.asarray(n, dtype=np.int64), default_owner(self.num_experts, self.num_ranks),
                            self.num_ranks, checked=True)
        return p, p._array_key()

    @staticmethod
    def _key(placement: Placement):
        if isinstance(placement, _TablePlacement) and placement._lazy():
            return placement._array_key()
        return FlexMoEPolicy._list_key(placement)

    @staticmethod
    def _list_key(placement: Placement):
        """The slot-table index of a placement: equal for placements with equal replica sets and
        vExpert counts (as tuples of their lists compare), as int64 bytes (building tuples of all
        E x G counts per plan was a large part of auto's time at 256-rank groups); lists holding
        anything but integers (or integral floats) keep the tuple form."""
        sets, vx = placement.replica_sets, placement.vexperts
        lens = np.fromiter(map(len, sets), dtype=np.int64, count=len(sets))
        flat, n = _ints(list(itertools.chain.from_iterable(sets))), None
        if flat is not None and flat.ndim == 1 and vx is not None:
            try:
                n = _ints(np.asarray(vx))
            except ValueError:                                 # ragged lists
                n = None
        if flat is None or flat.ndim != 1 or (vx is not None and (n is None or n.ndim != 2)):
            return tuple(map(tuple, sets)), (None if vx is None else tuple(map(tuple, vx)))
        if vx is None:
            return lens.tobytes(), flat.tobytes(), None
        if n.shape == (len(sets), placement.num_ranks) and (len(flat) == 0 or 0 <= flat.min() <= flat.max() < n.shape[1]):
            hosts = np.zeros(n.shape, dtype=bool)
            hosts[np.repeat(np.arange(len(sets)), lens), flat] = True
            if np.count_nonzero(n) == np.count_nonzero(n[hosts]):
                # every count sits on a replica rank (any valid placement): the counts there say
                # it all (the E x G bytes cost more to hash per plan)
                return lens.tobytes(), flat.tobytes(), ("hosts", n.shape, n[hosts].tobytes())
        return lens.tobytes(), flat.tobytes(), (n.shape, n.tobytes())

    def plan(self, counts, current: Optional[Placement] = None, priced: Optional[Priced] = None) -> Placement:
        """One scheduler step from ``counts``.  With ``current`` (the placement the layer ran), the
        layer's slot table is the one that produced ``current`` (an unknown placement, e.g. plain
        EP at the start, begins from the initial table); without it the policy's own table is used.
        ``priced``: this table's :meth:`price` of ``counts`` when the caller has it (as ``step``).
        A step that leaves the table's counts as the last plan's returns that same Placement
        object (equal content; auto's per-placement caches then hit)."""
        if current is not None:
            t = self._by_placement.get(self._key(current))
            self.table = (t.copy() if t is not None else
                          SlotTable(initial_slots(self.num_experts, self.num_ranks, self.slots_per_rank),
                                    self.num_experts))
        self.last_ops = self.step(np.asarray(counts), priced)     # the balance manager counts them
        n = self.table.counts()
        last = getattr(self, "_last_plan", None)
        if last is not None and np.array_equal(last[2], n):
            p, k = last[0], last[1]
        else:
            p, k = self._placement_key(n)
            self._last_plan = (p, k, n)
        self._by_placement[k] = self.table.copy()
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
