"""The one Pro-Prophet cost model (design note 2.4, Eqs. 1-8) used by the planner, the tools and the
simulator.

Per MoE layer, with R = inputs each rank receives in one all-to-all and H = inputs each rank computes:

    T_A2A(R)      = max_i R_i * size(input) / B(msg)          (1)  B from a bandwidth-by-size table
    T_FEC(H)      = max_i H_i / t                             (2)
    T_BEC(H)      = 2 * T_FEC(H)                              (3)
    T_Trans(s, n) = s * (D - n) * size(params) / (D * B_x)    (4)
    T_Agg(s, n)   = s * (D - n) * size(grads)  / (D * B_x)    (5)
    T'            = 4 T_A2A + 3 T_FEC + T_Trans + T_Agg       (6)
    T_PTrans      = max(0, T_Trans - T_FEC - T_FNEC)
    T_PAgg        = max(0, T_Agg - T_BEC - T_BNEC)
    T'_full       = 4 T_A2A + 3 T_FEC + T_PTrans + T_PAgg     (8)

Constants come from a calibration profile (``tools/calibrate_balance.py`` writes it) or from the
defaults below; ``CostModel.from_profile(path)`` reads it.
"""

from __future__ import annotations

import dataclasses
import json
from typing import List, Optional, Sequence, Tuple

import numpy as np

__all__ = ["CostModel", "DEFAULT_PROFILE"]

# Documented defaults (docs/balance.md): the paper artifact's A2A bandwidth table (Gb/s by message
# size), 15 Gb/s for Trans/Agg, and a d_model=1024/d_ffn=2048 fp32 expert at 35.7 TFLOP/s.
DEFAULT_PROFILE = {
    "a2a_bandwidth": [[131072, 6e9 / 8], [262144, 16e9 / 8], [1048576, 42e9 / 8], [None, 100e9 / 8]],
    "trans_bandwidth": 15e9 / 8,
    "throughput": 35.7e12 / (4 * 1024 * 2048),
    "input_bytes": 1024 * 4,
    "expert_bytes": 2 * 1024 * 2048 * 4,
    "t_fnec": 0.0,
    "t_bnec": 0.0,
}


def _table(bw) -> List[Tuple[Optional[float], float]]:
    """A bandwidth is a number (bytes/s) or a list of [max_message_bytes or null, bytes/s]."""
    if isinstance(bw, (int, float)):
        return [(None, float(bw))]
    rows = [(None if m is None else float(m), float(b)) for m, b in bw]
    if not rows or rows[-1][0] is not None:
        raise ValueError("bandwidth table must end with a [null, bytes_per_s] row (messages of any size)")
    if any(b <= 0 for _, b in rows):
        raise ValueError(f"bandwidth table has a non-positive bandwidth: {bw}")
    return rows


@dataclasses.dataclass
class CostModel:
    input_bytes: float                      # size(input): d_model * bytes per element
    expert_bytes: float                     # size(e.params) == size(e.grads)
    throughput: float                       # t: expert forward inputs/s per rank
    a2a_bandwidth: object = 12.5e9          # B: bytes/s, or [[max_msg_bytes|None, bytes/s], ...]
    trans_bandwidth: Optional[float] = None  # B_x for Trans/Agg (None: the A2A table at expert size)
    t_fnec: float = 0.0                     # non-MoE forward seconds per block (Eq. 8)
    t_bnec: float = 0.0                     # non-MoE backward seconds per block (Eq. 8)

    def __post_init__(self):
        self._a2a = _table(self.a2a_bandwidth)
        for name in ("input_bytes", "expert_bytes", "throughput"):
            if not getattr(self, name) > 0:
                raise ValueError(f"cost model: {name} must be > 0, got {getattr(self, name)}")

    # -- constants -------------------------------------------------------------------------
    def bandwidth(self, message_bytes: float) -> float:
        for limit, bw in self._a2a:
            if limit is None or message_bytes <= limit:
                return bw
        return self._a2a[-1][1]

    def _trans_bw(self) -> float:
        return self.trans_bandwidth if self.trans_bandwidth else self.bandwidth(self.expert_bytes)

    # -- Eqs. 1-5 --------------------------------------------------------------------------
    def t_a2a(self, R) -> float:
        msg = float(np.max(R)) * self.input_bytes if len(R) else 0.0
        return msg / self.bandwidth(msg) if msg > 0 else 0.0

    def t_fec(self, H) -> float:
        return float(np.max(H)) / self.throughput if len(H) else 0.0

    def t_bec(self, H) -> float:
        return 2.0 * self.t_fec(H)

    def t_trans(self, s: int, n: int, D: int) -> float:
        return s * (D - n) * self.expert_bytes / (D * self._trans_bw())

    t_agg = t_trans   # grads and params have the same size in this model

    def t_ptrans(self, H, s: int, n: int, D: int, t_fec_prev: Optional[float] = None) -> float:
        fec = self.t_fec(H) if t_fec_prev is None else t_fec_prev
        return max(0.0, self.t_trans(s, n, D) - fec - self.t_fnec)

    def t_pagg(self, H, s: int, n: int, D: int, t_fec_prev: Optional[float] = None) -> float:
        bec = self.t_bec(H) if t_fec_prev is None else 2.0 * t_fec_prev
        return max(0.0, self.t_agg(s, n, D) - bec - self.t_bnec)

    # -- Eqs. 6 and 8 ----------------------------------------------------------------------
    def layer_time(self, R, H, s: int, n: int, D: int, eq8: bool = False) -> float:
        base = 4.0 * self.t_a2a(R) + 3.0 * self.t_fec(H)
        if eq8:
            return base + self.t_ptrans(H, s, n, D) + self.t_pagg(H, s, n, D)
        return base + self.t_trans(s, n, D) + self.t_agg(s, n, D)

    def trans_split(self, n: int, D: int) -> Tuple[int, int]:
        """Offline block-wise rule (note 2.6): kF experts' Trans fit under FNEC, kB Aggs under BNEC."""
        tx = self.t_trans(1, n, D)
        if tx <= 0:
            return (1 << 30, 1 << 30)
        return int(self.t_fnec // tx), int(self.t_bnec // tx)

    # -- profiles --------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, d: dict, **overrides) -> "CostModel":
        merged = dict(DEFAULT_PROFILE)
        merged.update({k: v for k, v in d.items() if k in DEFAULT_PROFILE})
        merged.update({k: v for k, v in overrides.items() if v is not None})
        return cls(input_bytes=float(merged["input_bytes"]), expert_bytes=float(merged["expert_bytes"]),
                   throughput=float(merged["throughput"]), a2a_bandwidth=merged["a2a_bandwidth"],
                   trans_bandwidth=merged["trans_bandwidth"], t_fnec=float(merged["t_fnec"]),
                   t_bnec=float(merged["t_bnec"]))

    @classmethod
    def from_profile(cls, path: Optional[str], **overrides) -> "CostModel":
        """Read a calibration JSON (``--moe-balance-profile``); None: the documented defaults."""
        if path is None:
            return cls.from_dict({}, **overrides)
        try:
            with open(path) as f:
                d = json.load(f)
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"--moe-balance-profile {path}: cannot read calibration JSON: {exc}") from exc
        if not isinstance(d, dict):
            raise ValueError(f"--moe-balance-profile {path}: expected a JSON object")
        unknown = sorted(set(d) - set(DEFAULT_PROFILE) - {"meta"})
        if unknown:
            raise ValueError(f"--moe-balance-profile {path}: unknown keys {unknown}")
        return cls.from_dict(d, **overrides)

    def to_dict(self) -> dict:
        return {"a2a_bandwidth": [[m, b] for m, b in self._a2a], "trans_bandwidth": self.trans_bandwidth,
                "throughput": self.throughput, "input_bytes": self.input_bytes,
                "expert_bytes": self.expert_bytes, "t_fnec": self.t_fnec, "t_bnec": self.t_bnec}
