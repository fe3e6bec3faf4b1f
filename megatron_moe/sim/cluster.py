"""Cluster description for the simulator and the planners' pricing of operations.

``Cluster`` holds the machine (nodes x GPUs, link bandwidths and latencies) and the model constants
(expert throughput, bytes per input, expert parameter / optimizer-state bytes, non-MoE block times).
It is built from a topology JSON (same keys as ``megatron_moe/runtime/topology.py``'s ``--topology-file``) or
from a calibration profile JSON (keys below), and it is the single place the simulator reads
constants from; ``planner_cost()`` turns it into the cost object the policies consume.

Profile / topology JSON keys (all optional; units in the names)::

    ranks_per_node, intra_bandwidth_gbps, inter_bandwidth_gbps,   # GB/s per direction per rank
    intra_latency_us, inter_latency_us,
    expert_tokens_per_s,      # forward expert throughput of one device (inputs/s); backward = 2x time
    bytes_per_input,          # hidden * dtype bytes
    expert_param_bytes, expert_state_bytes (params + optimizer state), t_fnec_s, t_bnec_s,
    hidden_size, ffn_hidden_size, dtype_bytes, device_flops   # used only when the above are absent

Defaults model an A100-class node (8 GPUs, NVLink 150 GB/s, 25 GB/s NIC per GPU), hidden 1024,
ffn 4096, bf16, 100 TFLOP/s achieved; they are placeholders to be replaced by a calibration run.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Optional

import numpy as np

__all__ = ["Cluster", "load_cluster"]


def _by_size(table, nbytes: np.ndarray) -> np.ndarray:
    """The value of ``table`` ([[max_bytes or None, value], ...], ascending, None = any size) for each
    size in ``nbytes``: the first row whose limit is at least the size."""
    limits = np.array([np.inf if m is None else m for m, _ in table])
    values = np.array([v for _, v in table], dtype=np.float64)
    return values[np.minimum(np.searchsorted(limits, nbytes, side="left"), len(values) - 1)]


@dataclasses.dataclass
class Cluster:
    num_gpus: int
    ranks_per_node: int = 8
    intra_bw: float = 150e9          # bytes/s per direction
    inter_bw: float = 25e9
    intra_lat: float = 5e-6          # seconds per message
    inter_lat: float = 10e-6
    hidden_size: int = 1024
    ffn_hidden_size: int = 4096
    dtype_bytes: int = 2
    device_flops: float = 100e12     # achieved GEMM FLOP/s
    expert_tokens_per_s: Optional[float] = None
    bytes_per_input: Optional[float] = None
    expert_param_bytes: Optional[float] = None
    expert_state_bytes: Optional[float] = None
    t_fnec_s: Optional[float] = None
    t_bnec_s: Optional[float] = None
    inputs_per_rank: int = 8192      # only for the default non-MoE time estimate
    a2a_bw_table: Optional[list] = None   # [[max_msg_bytes|None, bytes/s], ...] from a calibration
    intra_pair_bw: Optional[float] = None  # faster link between local ranks 2i and 2i+1 (NVLink bridge pairs)
    node_inter_bw: Optional[float] = None  # all NICs of a node together (inter_bw = what one rank can drive)
    msg_efficiency: Optional[list] = None  # [[max_bytes|None, fraction of link rate], ...] by a rank's all-to-all volume
    bcast_efficiency: float = 1.0    # achieved fraction of the link rate of a broadcast / reduce (Trans, Agg, shadows)
    t_step_s: float = 0.0            # per-iteration time outside the MoE blocks (dense all-reduce, optimizer, LM head)
    source: str = "defaults"

    def __post_init__(self):
        if self.num_gpus < 1 or self.ranks_per_node < 1:
            raise ValueError(f"cluster ({self.source}): num_gpus and ranks_per_node must be >= 1")
        if self.num_gpus % self.ranks_per_node and self.num_gpus > self.ranks_per_node:
            raise ValueError(f"cluster ({self.source}): --gpus {self.num_gpus} is not a multiple "
                             f"of ranks_per_node={self.ranks_per_node} (--ranks-per-node)")
        for f in ("intra_bw", "inter_bw", "device_flops", "bcast_efficiency"):
            if not getattr(self, f) > 0:
                raise ValueError(f"cluster ({self.source}): {f} must be > 0")
        h, f, b = self.hidden_size, self.ffn_hidden_size, self.dtype_bytes
        if self.expert_tokens_per_s is None:
            self.expert_tokens_per_s = self.device_flops / (4.0 * h * f)   # 2 GEMMs, FMA = 2 flops
        if self.bytes_per_input is None:
            self.bytes_per_input = float(h * b)
        if self.expert_param_bytes is None:
            self.expert_param_bytes = float(2 * h * f * b)
        if self.expert_state_bytes is None:
            # params + fp32 master + Adam m, v (mixed precision): b + 12 bytes per parameter
            self.expert_state_bytes = float(2 * h * f * (b + 12))
        if self.t_fnec_s is None:
            # attention block of a transformer layer: ~ 4*h^2 (qkv+proj) *2 flops per token, tokens =
            # inputs_per_rank / top_k(2); a rough placeholder replaced by calibration
            self.t_fnec_s = 8.0 * h * h * (self.inputs_per_rank / 2) / self.device_flops
        if self.t_bnec_s is None:
            self.t_bnec_s = 2.0 * self.t_fnec_s

    def volume_efficiency(self, nbytes) -> np.ndarray:
        """Achieved fraction of the link rate of an all-to-all in which one rank exchanges
        ``nbytes`` in all (``msg_efficiency``; 1 without a table)."""
        nbytes = np.asarray(nbytes, dtype=np.float64)
        if not self.msg_efficiency:
            return np.ones_like(nbytes)
        return _by_size(self.msg_efficiency, nbytes)

    # -- bandwidth by message size (the calibration table caps the link rate for small messages)
    def transfer_time(self, nbytes, intra) -> np.ndarray:
        """Seconds to move ``nbytes`` (array) as single messages over intra/inter links."""
        nbytes = np.asarray(nbytes, dtype=np.float64)
        bw = np.where(intra, self.intra_bw, self.inter_bw)
        if self.a2a_bw_table:
            bw = np.minimum(bw, _by_size(self.a2a_bw_table, nbytes))
        return nbytes / bw

    @classmethod
    def from_cost_model(cls, num_gpus: int, cm, ranks_per_node: int = 8, intra_bw: Optional[float] = None,
                        inter_bw: Optional[float] = None, source: str = "cost model", **kw) -> "Cluster":
        """Constants from the balance engineer's ``CostModel`` (the one cost model training uses):
        expert throughput, input / expert bytes, FNEC/BNEC times and the A2A bandwidth-by-message-size
        table.  Link rates default to the table's large-message bandwidth (no topology file)."""
        table = [[m, b] for m, b in cm.to_dict()["a2a_bandwidth"]]
        big = float(table[-1][1])
        if cm.a2a_latency > 0:            # the calibrated per-peer all-to-all latency (gloo here)
            kw.setdefault("intra_lat", float(cm.a2a_latency))
            kw.setdefault("inter_lat", float(cm.a2a_latency))
        return cls(num_gpus=num_gpus, ranks_per_node=min(ranks_per_node, num_gpus),
                   intra_bw=intra_bw or big, inter_bw=inter_bw or big,
                   expert_tokens_per_s=float(cm.throughput), bytes_per_input=float(cm.input_bytes),
                   expert_param_bytes=float(cm.expert_bytes),
                   # fp32 params + Adam m, v: what training's persistent replicas move on Expand
                   expert_state_bytes=float(cm.expert_bytes) * 3.0,
                   t_fnec_s=float(cm.t_fnec), t_bnec_s=float(cm.t_bnec), a2a_bw_table=table,
                   source=source, **kw)

    # -- topology helpers (vectorised over rank index arrays) --------------------------------
    def node_of(self, ranks):
        return np.asarray(ranks) // self.ranks_per_node

    def local_bw(self, l: int) -> np.ndarray:
        """[l, l] bytes/s between the local ranks of one node (NVLink pairs 2i <-> 2i+1 when set)."""
        bw = np.full((l, l), float(self.intra_bw))
        if self.intra_pair_bw:
            i = np.arange(l)
            bw[(i[:, None] // 2) == (i[None, :] // 2)] = self.intra_pair_bw
        return bw

    def link_seconds_per_byte(self, ranks: np.ndarray) -> np.ndarray:
        """[P, P] seconds per byte between the given global ranks (0 on the diagonal)."""
        ranks = np.asarray(ranks)
        n = self.node_of(ranks)
        same = n[:, None] == n[None, :]
        intra = np.full(same.shape, 1.0 / self.intra_bw)
        if self.intra_pair_bw:
            loc = ranks % self.ranks_per_node
            intra = np.where(loc[:, None] // 2 == loc[None, :] // 2, 1.0 / self.intra_pair_bw, intra)
        c = np.where(same, intra, 1.0 / self.inter_bw)
        np.fill_diagonal(c, 0.0)
        return c

    def bottleneck_bw(self, ranks) -> float:
        ranks = np.asarray(ranks)
        if len(ranks) <= 1:
            return math.inf
        return self.intra_bw if len(np.unique(self.node_of(ranks))) == 1 else self.inter_bw

    def max_lat(self, ranks) -> float:
        ranks = np.asarray(ranks)
        return self.intra_lat if len(np.unique(self.node_of(ranks))) <= 1 else self.inter_lat

    # -- collective formulas ----------------------------------------------------------------
    def broadcast_time(self, nbytes: float, ranks) -> float:
        """Ring-pipelined broadcast (or reduce) of ``nbytes`` over ``ranks``: every ring link carries
        ``nbytes`` once (FasterMoE note 2.3), the slowest link sets the rate, of which the collective
        achieves ``bcast_efficiency``, plus k - 1 hops of the slowest link's latency. The formula is
        ``cost_model.broadcast_s``, the one Pro-Prophet's planner prices Eq. 4/5 with (``cost_model``)."""
        from megatron_moe.balance.cost_model import broadcast_s
        if len(ranks) <= 1:
            return 0.0
        return broadcast_s(nbytes, len(ranks), self.bottleneck_bw(ranks) * self.bcast_efficiency,
                           self.max_lat(ranks))

    def allreduce_time(self, nbytes: float, ranks) -> float:
        """Ring all-reduce: each rank sends 2(k-1)/k * nbytes."""
        k = len(ranks)
        if k <= 1 or nbytes <= 0:
            return 0.0
        return 2.0 * (k - 1) / k * nbytes / self.bottleneck_bw(ranks) + 2 * (k - 1) * self.max_lat(ranks)

    def p2p_time(self, nbytes: float, a: int, b: int) -> float:
        if a == b:
            return 0.0
        same = self.node_of(a) == self.node_of(b)
        return nbytes / (self.intra_bw if same else self.inter_bw) + (self.intra_lat if same else self.inter_lat)

    def cost_model(self, ranks):
        """The balance ``CostModel`` with this cluster's constants for an EP group (Pro-Prophet's
        planner prices with it): the group's bottleneck link rate, capped by the calibrated
        bandwidth-by-size table when there is one. Trans/Agg (Eq. 4/5) are priced as
        ``broadcast_time`` charges them: ring form, the bottleneck rate x ``bcast_efficiency`` and
        the group's hop latency, so a plan that replicates to the whole group is priced exactly
        (a replica subset inside one node is charged the faster intra-node link: priced high)."""
        from megatron_moe.balance.cost_model import CostModel
        bw = self.bottleneck_bw(ranks)
        bw = self.intra_bw if not np.isfinite(bw) else bw
        if self.a2a_bw_table:
            table = [[m, min(b, bw)] for m, b in self.a2a_bw_table]
        elif self.msg_efficiency:        # Eq. 1 looks the rate up by the busiest rank's volume, as here
            table = [[m, f * bw] for m, f in self.msg_efficiency]
        else:
            table = bw
        return CostModel(input_bytes=self.bytes_per_input, expert_bytes=self.expert_param_bytes,
                         throughput=self.expert_tokens_per_s, a2a_bandwidth=table,
                         trans_bandwidth=bw * self.bcast_efficiency,
                         trans_latency=self.max_lat(ranks), trans_ring=True,
                         t_fnec=self.t_fnec_s, t_bnec=self.t_bnec_s)

    def planner_cost(self, ranks) -> "PlannerCost":
        from megatron_moe.balance.cost_model import PlannerCost
        return PlannerCost.from_cluster(self, np.asarray(ranks))


_GB = 1e9


_BALANCE_KEYS = {"a2a_bandwidth", "trans_bandwidth", "throughput", "input_bytes", "expert_bytes",
                 "t_fnec", "t_bnec"}


def load_cluster(num_gpus: int, path: Optional[str] = None, profile: Optional[str] = None,
                 **overrides) -> Cluster:
    """Cluster for ``num_gpus`` GPUs.

    ``path``: a topology JSON (``--topology``) or a simulator profile.  ``profile``: the balance
    calibration profile (``--moe-balance-profile`` format, read by ``CostModel.from_profile``); when
    given, compute/byte constants and the bandwidth-by-size table come from it and ``path`` only
    supplies the node layout and link rates.
    """
    if profile is not None:
        from megatron_moe.balance.cost_model import CostModel
        cm = CostModel.from_profile(profile)
        topo = load_cluster(num_gpus, path) if path else None
        kw = {}
        if topo is not None:
            kw = dict(ranks_per_node=topo.ranks_per_node, intra_bw=topo.intra_bw, inter_bw=topo.inter_bw)
        kw.update({k: v for k, v in overrides.items() if v is not None})
        return Cluster.from_cost_model(num_gpus, cm, source=profile, **kw)
    kw = {}
    src = "defaults"
    if path:
        try:
            with open(path) as f:
                raw = json.load(f)
        except FileNotFoundError:
            raise FileNotFoundError(f"--topology/--profile {path}: no such file") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{e.lineno}: invalid JSON ({e.msg})") from None
        if not isinstance(raw, dict):
            raise ValueError(f"{path}: expected a JSON object")
        if _BALANCE_KEYS & set(raw) and not {"intra_bandwidth_gbps", "inter_bandwidth_gbps"} & set(raw):
            return load_cluster(num_gpus, None, profile=path, **overrides)
        src = path
        conv = {"intra_bandwidth_gbps": ("intra_bw", _GB), "inter_bandwidth_gbps": ("inter_bw", _GB),
                "intra_latency_us": ("intra_lat", 1e-6), "inter_latency_us": ("inter_lat", 1e-6)}
        fields = {f.name for f in dataclasses.fields(Cluster)}
        for k, v in raw.items():
            if k in conv:
                name, scale = conv[k]
                kw[name] = float(v) * scale
            elif k in fields and k not in ("num_gpus", "source"):
                kw[k] = v
            # unknown keys (comments, other tools' fields) are ignored on purpose
    kw.update({k: v for k, v in overrides.items() if v is not None})
    kw.setdefault("ranks_per_node", 8)
    kw["ranks_per_node"] = min(int(kw["ranks_per_node"]), num_gpus)
    return Cluster(num_gpus=num_gpus, source=src, **kw)
