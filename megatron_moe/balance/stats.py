"""Routing statistics per MoE layer: count matrices, a short history, the locality predictor and the
imbalance figures for the training log.

Counts are the [D source ranks x E experts] matrices all-gathered over the EP group inside
the balanced MoE layer (needed for its all-to-all splits anyway), summed over the micro-batches of an
iteration. The predictor for iteration j+1 is iteration j's matrix ("last", the paper's locality
rule) or an exponential moving average (``ema``, weight ``beta`` on the newest matrix).
"""

from __future__ import annotations

import collections
from typing import Deque, Dict, Optional

import numpy as np

from megatron_moe.balance.policies.base import Placement, balance_degree, loads

__all__ = ["RoutingStats", "imbalance"]


def imbalance(C, placement: Optional[Placement] = None) -> Dict[str, float]:
    """Figures for one layer: per-rank computed max/mean and std under plain EP and ``placement``."""
    C = np.asarray(C, dtype=np.float64)
    D, E = C.shape
    plain = Placement.plain(E, D)
    H0, R0 = loads(C, plain)
    out = {"rank_max_over_mean": float(H0.max() / max(H0.mean(), 1e-12)),
           "expert_max_over_mean": float(C.sum(0).max() / max(C.sum(0).mean(), 1e-12)),
           "balance_before": balance_degree(H0)}
    if placement is not None:
        H1, R1 = loads(C, placement)
        out["balance_after"] = balance_degree(H1)
        out["rank_max_over_mean_after"] = float(H1.max() / max(H1.mean(), 1e-12))
        out["a2a_recv_max_before"] = float(R0.max())
        out["a2a_recv_max_after"] = float(R1.max())
    return out


class RoutingStats:
    def __init__(self, history: int = 4, predictor: str = "last", beta: float = 0.5):
        if predictor not in ("last", "ema"):
            raise ValueError(f"routing predictor {predictor!r}: choose 'last' or 'ema'")
        self.history_len = int(history)
        self.predictor = predictor
        self.beta = float(beta)
        self.history: Dict[int, Deque] = {}       # layer -> deque of (iteration, C)
        self._ema: Dict[int, np.ndarray] = {}

    def add(self, layer: int, iteration: int, C) -> None:
        C = np.asarray(C, dtype=np.float64)
        h = self.history.setdefault(layer, collections.deque(maxlen=self.history_len))
        h.append((int(iteration), C.copy()))
        if layer in self._ema and self._ema[layer].shape == C.shape:
            self._ema[layer] = self.beta * C + (1.0 - self.beta) * self._ema[layer]
        else:
            self._ema[layer] = C.copy()

    def last(self, layer: int) -> Optional[np.ndarray]:
        h = self.history.get(layer)
        return h[-1][1] if h else None

    def predict(self, layer: int) -> Optional[np.ndarray]:
        if layer not in self.history or not self.history[layer]:
            return None
        return self.last(layer) if self.predictor == "last" else self._ema[layer]

    def peek(self, layer: int, C) -> np.ndarray:
        """What ``predict(layer)`` returns after ``add(layer, _, C)``, without recording C (plan-ahead
        runs before the iteration's counts are final for the trace/metrics; same arithmetic)."""
        C = np.asarray(C, dtype=np.float64)
        if self.predictor == "last":
            return C.copy()
        prev = self._ema.get(layer)
        if prev is not None and prev.shape == C.shape:
            return self.beta * C + (1.0 - self.beta) * prev
        return C.copy()

    def state_dict(self) -> dict:
        return {"history_len": self.history_len, "predictor": self.predictor, "beta": self.beta,
                "history": {int(l): [(i, c.tolist()) for i, c in h] for l, h in self.history.items()},
                "ema": {int(l): c.tolist() for l, c in self._ema.items()}}

    def load_state_dict(self, sd: dict) -> None:
        self.history = {}
        for l, items in sd.get("history", {}).items():
            h = collections.deque(maxlen=self.history_len)
            for i, c in items:
                h.append((int(i), np.asarray(c, dtype=np.float64)))
            self.history[int(l)] = h
        self._ema = {int(l): np.asarray(c, dtype=np.float64) for l, c in sd.get("ema", {}).items()}
