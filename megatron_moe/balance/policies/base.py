"""The placement-policy interface shared by every balancing policy (Pro-Prophet, FasterMoE, FlexMoE,
the simulator).

A policy is a small class: ``plan(counts, current=None) -> Placement`` where ``counts`` is the
[D source ranks x E experts] matrix of inputs (token, expert pairs) and ``current`` the placement in
use. A ``Placement`` is only replica sets: ``replica_sets[e]`` = sorted ranks that compute expert e,
always containing ``owner[e]``. Semantics (design note 2.3): an input from rank d for expert e is
computed on d if d is in S_e, otherwise it goes to owner(e) through the all-to-all.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Sequence, Type

import numpy as np

__all__ = ["Placement", "BalancePolicy", "NoBalancePolicy", "default_owner", "loads",
           "balance_degree", "register_policy", "make_policy", "POLICIES"]


def default_owner(num_experts: int, num_ranks: int) -> np.ndarray:
    """Expert e is owned by rank e*D//E (megatron-core's contiguous split of experts over EP)."""
    if num_experts % num_ranks:
        raise ValueError(f"{num_experts} experts do not divide over {num_ranks} EP ranks")
    return (np.arange(num_experts) * num_ranks) // num_experts


@dataclasses.dataclass
class Placement:
    replica_sets: List[List[int]]          # per expert, sorted ranks computing it (owner included)
    num_ranks: int

    @classmethod
    def plain(cls, num_experts: int, num_ranks: int) -> "Placement":
        owner = default_owner(num_experts, num_ranks)
        return cls([[int(o)] for o in owner], num_ranks)

    @classmethod
    def from_plan(cls, plan, num_experts: int, num_ranks: int) -> "Placement":
        """From a Pro-Prophet plan: list of (expert, excluded ranks); S_e = all ranks - excluded."""
        p = cls.plain(num_experts, num_ranks)
        for e, excluded in plan:
            p.replica_sets[int(e)] = sorted(set(range(num_ranks)) - {int(x) for x in excluded})
        p.validate()
        return p

    @property
    def num_experts(self) -> int:
        return len(self.replica_sets)

    @property
    def owner(self) -> np.ndarray:
        return default_owner(self.num_experts, self.num_ranks)

    def validate(self) -> "Placement":
        owner = self.owner
        for e, s in enumerate(self.replica_sets):
            if list(s) != sorted(set(int(x) for x in s)) or not s:
                raise ValueError(f"placement: replica set of expert {e} must be sorted unique ranks: {s}")
            if int(owner[e]) not in s:
                raise ValueError(f"placement: owner {owner[e]} missing from replica set of expert {e}: {s}")
            if min(s) < 0 or max(s) >= self.num_ranks:
                raise ValueError(f"placement: rank out of range [0,{self.num_ranks}) for expert {e}: {s}")
        return self

    def replicated(self) -> List[int]:
        return [e for e, s in enumerate(self.replica_sets) if len(s) > 1]

    def mask(self) -> np.ndarray:
        """[D, E] bool: rank d computes its own inputs for expert e."""
        m = np.zeros((self.num_ranks, self.num_experts), dtype=bool)
        for e, s in enumerate(self.replica_sets):
            m[s, e] = True
        return m

    def is_plain(self) -> bool:
        return not self.replicated()

    def to_plan(self) -> list:
        return [[e, sorted(set(range(self.num_ranks)) - set(s))] for e, s in enumerate(self.replica_sets)
                if len(s) > 1]

    def to_dict(self) -> dict:
        return {"num_ranks": self.num_ranks, "replica_sets": [list(map(int, s)) for s in self.replica_sets]}

    @classmethod
    def from_dict(cls, d: dict) -> "Placement":
        return cls([list(map(int, s)) for s in d["replica_sets"]], int(d["num_ranks"])).validate()


def loads(counts, placement: Placement):
    """ReplaceInputs: per-rank computed inputs H and A2A-received inputs R under ``placement``."""
    C = np.asarray(counts, dtype=np.float64)
    D, E = C.shape
    m = placement.mask()
    owner = placement.owner
    H = (C * m).sum(axis=1)
    remote = np.where(m, 0.0, C).sum(axis=0)          # per expert: inputs shipped to its owner
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
    if name in ("proprophet", "fastermoe", "flexmoe"):  # each module registers itself
        import importlib

        importlib.import_module(f"megatron_moe.balance.policies.{name}")
    if name not in POLICIES:
        raise ValueError(f"--moe-balance-policy {name!r}: unknown; choose from {sorted(POLICIES)}")
    return POLICIES[name](num_experts=num_experts, num_ranks=num_ranks, **kwargs)
