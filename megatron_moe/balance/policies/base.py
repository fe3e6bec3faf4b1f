"""The placement-policy interface shared by every balancing policy (Pro-Prophet, FasterMoE, FlexMoE,
the simulator).

A policy is a small class: ``plan(counts, current=None) -> Placement`` where ``counts`` is the
[D source ranks x E experts] matrix of inputs (token, expert pairs) and ``current`` the placement in
use. A ``Placement`` is only replica sets: ``replica_sets[e]`` = sorted ranks that compute expert e,
always containing ``owner[e]``. Semantics (design note 2.3): an input from rank d for expert e is
computed on d if d is in S_e, otherwise it goes to owner(e) through the all-to-all.

A placement may also carry FlexMoE vExpert counts (``vexperts[e][g]``): then the flexible token router
(FlexMoE Alg. 3, ``route_tokens`` below) decides the split instead: each source keeps what fits its
local vExperts and spreads the overflow over the other replica ranks proportionally to their spare
room. ``dispatch_matrix`` gives either rule as ``send[e, src, dst]``; the layer executes only that.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Dict, List, Optional, Sequence, Type

import numpy as np

__all__ = ["Placement", "BalancePolicy", "NoBalancePolicy", "default_owner", "loads", "dispatch_matrix",
           "balance_degree", "route_tokens", "register_policy", "make_policy", "POLICIES"]


def default_owner(num_experts: int, num_ranks: int) -> np.ndarray:
    """Expert e is owned by rank e*D//E (megatron-core's contiguous split of experts over EP)."""
    if num_experts % num_ranks:
        raise ValueError(f"{num_experts} experts do not divide over {num_ranks} EP ranks")
    return (np.arange(num_experts) * num_ranks) // num_experts


@dataclasses.dataclass
class Placement:
    replica_sets: List[List[int]]          # per expert, sorted ranks computing it (owner included)
    num_ranks: int
    # FlexMoE: vexperts[e][g] = vExpert slots of e on rank g (None: Pro-Prophet locality rule).  The
    # owner is in replica_sets even with 0 slots: it holds the master copy that Trans sends out.
    vexperts: Optional[List[List[int]]] = None

    @classmethod
    def plain(cls, num_experts: int, num_ranks: int) -> "Placement":
        owner = default_owner(num_experts, num_ranks)
        return cls([[o] for o in owner.tolist()], num_ranks)

    @classmethod
    def from_plan(cls, plan, num_experts: int, num_ranks: int) -> "Placement":
        """From a Pro-Prophet plan: list of (expert, excluded ranks); S_e = all ranks - excluded."""
        p = cls.plain(num_experts, num_ranks)
        owner, ok = p.owner, True
        for e, excluded in plan:     # (n = 0, nothing excluded: every rank, the same list)
            ex = {int(x) for x in excluded}
            p.replica_sets[int(e)] = sorted(set(range(num_ranks)) - ex) if ex else list(range(num_ranks))
            ok = ok and int(owner[int(e)]) not in ex
        # the sets built here are sorted unique ranks in range: keeping its owner is what can fail
        # (validate raises the one-line error then; it is the same check as validate's otherwise)
        return p if ok else p.validate()

    @property
    def num_experts(self) -> int:
        return len(self.replica_sets)

    @property
    def owner(self) -> np.ndarray:
        return default_owner(self.num_experts, self.num_ranks)

    def _valid_fast(self, vexperts_array=None) -> bool:
        """Vectorised ``validate`` for the common case (replica sets of Python ints, integer
        vExperts): True only if the placement is valid; anything else goes through the per-expert
        checks below, which raise the one-line error."""
        sets, E, D = self.replica_sets, self.num_experts, self.num_ranks
        lens = np.fromiter(map(len, sets), dtype=np.int64, count=E)
        if E == 0 or lens.min() < 1:
            return False
        flat = list(itertools.chain.from_iterable(sets))
        if not set(map(type, flat)) <= {int}:
            return False
        a = np.asarray(flat, dtype=np.int64)
        if a.min() < 0 or a.max() >= D:
            return False
        inner = np.ones(len(a) - 1, dtype=bool)           # consecutive entries of one set
        inner[np.cumsum(lens)[:-1] - 1] = False
        if (np.diff(a)[inner] <= 0).any():
            return False
        m = np.zeros((D, E), dtype=bool)
        m[a, np.repeat(np.arange(E), lens)] = True
        if not m[self.owner, np.arange(E)].all():
            return False
        if self.vexperts is not None:
            n = np.asarray(self.vexperts) if vexperts_array is None else vexperts_array
            if n.shape != (E, D) or n.dtype.kind not in "iu" or (n < 0).any() or (n.sum(axis=1) < 1).any():
                return False
            if ((n != 0) & ~m.T).any():
                return False
        return True

    def validate(self, vexperts_array: Optional[np.ndarray] = None) -> "Placement":
        """Raise a one-line ValueError unless the placement is well formed; ``vexperts_array``: the
        caller's array holding the same counts as ``vexperts`` (spares converting the lists)."""
        if self._valid_fast(vexperts_array):
            return self
        owner = self.owner
        for e, s in enumerate(self.replica_sets):
            if len(s) == 1 and type(s[0]) is int and s[0] == owner[e]:
                continue                                    # plain expert (the common case)
            a = np.asarray(s)
            if not len(s) or a.ndim != 1 or a.dtype.kind not in "iu" or (len(a) > 1 and (np.diff(a) <= 0).any()):
                raise ValueError(f"placement: replica set of expert {e} must be sorted unique ranks: {s}")
            if a[0] < 0 or a[-1] >= self.num_ranks:
                raise ValueError(f"placement: rank out of range [0,{self.num_ranks}) for expert {e}: {s}")
            if len(a) == 1 and a[0] != owner[e] or len(a) > 1 and not (a == owner[e]).any():
                raise ValueError(f"placement: owner {owner[e]} missing from replica set of expert {e}: {s}")
        if self.vexperts is not None:
            n = np.asarray(self.vexperts)
            if n.shape != (self.num_experts, self.num_ranks) or (n < 0).any():
                raise ValueError(f"placement: vexperts must be non-negative [{self.num_experts}, "
                                 f"{self.num_ranks}] counts, got shape {n.shape}")
            for e, s in enumerate(self.replica_sets):
                if n[e].sum() < 1 or not set(np.nonzero(n[e])[0].tolist()) <= set(s):
                    raise ValueError(f"placement: expert {e} needs >= 1 vExpert, all on ranks of its "
                                     f"replica set {s}: {n[e].tolist()}")
        return self

    def replicated(self) -> List[int]:
        """Experts with more than one replica, in order (lengths counted in C: auto asks per plan)."""
        lens = np.fromiter(map(len, self.replica_sets), dtype=np.int64, count=len(self.replica_sets))
        return np.flatnonzero(lens > 1).tolist()

    def mask(self) -> np.ndarray:
        """[D, E] bool: rank d computes its own inputs for expert e."""
        m = np.zeros((self.num_ranks, self.num_experts), dtype=bool)
        lens = np.fromiter(map(len, self.replica_sets), dtype=np.int64, count=self.num_experts)
        ranks = np.fromiter(itertools.chain.from_iterable(self.replica_sets), dtype=np.int64, count=int(lens.sum()))
        m[ranks, np.repeat(np.arange(self.num_experts), lens)] = True
        return m

    @property
    def has_vexperts(self) -> bool:
        """``vexperts is not None`` (FlexMoE's router), without building lists that are built lazily."""
        return self.vexperts is not None

    def is_plain(self) -> bool:
        return not self.replicated()

    def dispatch(self, counts) -> np.ndarray:
        return dispatch_matrix(counts, self)

    def to_plan(self) -> list:
        return [[e, sorted(set(range(self.num_ranks)) - set(s))] for e, s in enumerate(self.replica_sets)
                if len(s) > 1]

    def to_dict(self) -> dict:
        d = {"num_ranks": self.num_ranks, "replica_sets": [list(map(int, s)) for s in self.replica_sets]}
        if self.vexperts is not None:
            d["vexperts"] = [list(map(int, r)) for r in self.vexperts]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "Placement":
        vx = d.get("vexperts")
        return cls([list(map(int, s)) for s in d["replica_sets"]], int(d["num_ranks"]),
                   None if vx is None else [list(map(int, r)) for r in vx]).validate()


def _largest_remainder(total: int, weights: np.ndarray) -> np.ndarray:
    """Split integer ``total`` proportionally to ``weights``; deterministic (ties -> lower index)."""
    w = np.asarray(weights, dtype=np.float64)
    if total <= 0 or w.sum() <= 0:
        return np.zeros(len(w), dtype=np.int64)
    q = total * w / w.sum()
    base = np.floor(q).astype(np.int64)
    rem = int(total - base.sum())
    if rem:
        order = np.lexsort((np.arange(len(w)), -(q - base)))
        base[order[:rem]] += 1
    return base


def route_tokens(origin: np.ndarray, n: np.ndarray) -> np.ndarray:
    """Integer Alg. 3: ``send[e, src, dst]`` with exact row sums (nothing dropped).

    Per-replica capacities are the largest-remainder split of I_e over vExperts; each source keeps
    min(capacity, origin) locally and splits its overflow over the other replicas by largest
    remainder on their spare room.  Identical on every rank (integer arithmetic, fixed order).
    """
    origin = np.asarray(origin, dtype=np.int64)
    g_n, e_n = origin.shape
    send = np.zeros((e_n, g_n, g_n), dtype=np.int64)
    for e in range(e_n):
        col = origin[:, e]
        capacity = _largest_remainder(int(col.sum()), n[e])
        keep = np.minimum(capacity, col)
        spare = capacity - keep
        for g in range(g_n):
            send[e, g, g] = keep[g]
            spill = int(col[g] - keep[g])
            if spill:
                w = spare.copy()
                w[g] = 0
                if w.sum() <= 0:
                    raise AssertionError("flexmoe router: overflow with no spare capacity")
                send[e, g] += _largest_remainder(spill, w)
    return send


def dispatch_matrix(counts, placement: Placement) -> np.ndarray:
    """``send[e, src, dst]``: how many of rank src's inputs for expert e rank dst computes.

    Without vExperts (Pro-Prophet, FasterMoE): all on src if src is in S_e, else all on the owner.
    With vExperts (FlexMoE): the integer flexible token router (locality first, overflow spread over
    the other replicas proportionally to spare capacity; identical on every rank).
    """
    C = np.asarray(counts)
    if np.any(C != np.round(C)) or (C < 0).any():
        raise ValueError("dispatch_matrix: counts must be non-negative integers")
    C = C.astype(np.int64)
    D, E = C.shape
    if (D, E) != (placement.num_ranks, placement.num_experts):
        raise ValueError(f"dispatch_matrix: counts {C.shape} vs placement ({placement.num_ranks}, "
                         f"{placement.num_experts})")
    if placement.vexperts is not None:
        return route_tokens(C, np.asarray(placement.vexperts, dtype=np.int64))
    send = np.zeros((E, D, D), dtype=np.int64)
    m = placement.mask()
    owner = placement.owner
    src = np.arange(D)
    for e in range(E):
        send[e, src[m[:, e]], src[m[:, e]]] = C[m[:, e], e]
        send[e, src[~m[:, e]], owner[e]] = C[~m[:, e], e]
    return send


def loads(counts, placement: Placement, mask: Optional[np.ndarray] = None, away: Optional[np.ndarray] = None):
    """ReplaceInputs: per-rank computed inputs H and A2A-received inputs R under ``placement``
    (``mask``: its ``placement.mask()`` when the caller has it already; ``away``: then also
    ``np.where(mask, 0, counts)``, the inputs each source sends to the owners)."""
    if placement.vexperts is not None:
        send = dispatch_matrix(np.rint(np.asarray(counts, dtype=np.float64)), placement)
        H = send.sum(axis=(0, 1)).astype(np.float64)
        R = H - np.einsum("egg->g", send).astype(np.float64)
        return H, R
    C = np.asarray(counts, dtype=np.float64)
    D, E = C.shape
    m = placement.mask() if mask is None else mask
    owner = placement.owner
    H = (C * m).sum(axis=1)
    remote = (np.where(m, 0.0, C) if away is None else away).sum(axis=0)   # per expert: inputs shipped to its owner
    R = np.zeros(D)
    np.add.at(R, owner, remote)
    H = H + R
    return H, R


def balance_degree(H) -> float:
    """Balance degree (note 2.7): population std over ranks of computed inputs."""
    return float(np.std(np.asarray(H, dtype=np.float64)))


class BalancePolicy:
    """Base class: map a [D x E] count matrix (+ the current placement) to a Placement."""

    name = "base"

    def __init__(self, num_experts: int, num_ranks: int, **kwargs):
        self.num_experts, self.num_ranks = int(num_experts), int(num_ranks)

    def plan(self, counts, current: Optional[Placement] = None) -> Placement:   # pragma: no cover
        raise NotImplementedError


class NoBalancePolicy(BalancePolicy):
    """``--moe-balance-policy none``: plain expert parallelism."""

    name = "none"

    def plan(self, counts, current=None) -> Placement:
        return Placement.plain(self.num_experts, self.num_ranks)


POLICIES: Dict[str, Type[BalancePolicy]] = {"none": NoBalancePolicy}


def register_policy(cls: Type[BalancePolicy]) -> Type[BalancePolicy]:
    POLICIES[cls.name] = cls
    return cls


def make_policy(name: str, num_experts: int, num_ranks: int, **kwargs) -> BalancePolicy:
    if name not in POLICIES:
        raise ValueError(f"--moe-balance-policy {name!r}: unknown; choose from {sorted(POLICIES)}")
    return POLICIES[name](num_experts=num_experts, num_ranks=num_ranks, **kwargs)
