"""The one cost model of the project: every planner, policy, the block-wise scheduler, the tools and
the simulator import it from here (the simulator depends on this module, never the reverse; a test
checks that nothing under ``megatron_moe/balance`` imports ``megatron_moe.sim``).

* ``CostModel``: the calibrated constants and the Pro-Prophet equations (design note 2.4, Eqs. 1-8).
  Calibration (``tools/calibrate_balance.py``, ``bench/policies.py``) writes its profile with
  ``save_profile``; training (``--moe-balance-profile``), the tools and the simulator read it with
  ``CostModel.from_profile``.
* ``PlannerCost``: the same constants as the per-rank pricing the FasterMoE / FlexMoE policies
  consume (``CostModel.planner_cost(D)`` in training; ``PlannerCost.from_cluster`` in the simulator,
  which adds per-link rates and the node layout).

Per MoE layer, with R = inputs each rank receives in one all-to-all and H = inputs each rank computes:

    T_A2A(R)      = max_i R_i * size(input) / B(msg)          (1)  B from a bandwidth-by-size table
    T_FEC(H)      = max_i H_i / t                             (2)
    T_BEC(H)      = 2 * T_FEC(H)                              (3)
    T_Trans(s, n) = s * (D - n) * size(params) / (D * B_x)    (4)  + s * (D - n - 1) * lambda_x
    T_Agg(s, n)   = s * (D - n) * size(grads)  / (D * B_x)    (5)  + s * (D - n - 1) * lambda_x
    T'            = 4 T_A2A + 3 T_FEC + T_Trans + T_Agg       (6)
    T_PTrans      = max(0, T_Trans - T_FEC - T_FNEC)
    T_PAgg        = max(0, T_Agg - T_BEC - T_BNEC)
    T'_full       = 4 T_A2A + 3 T_FEC + T_PTrans + T_PAgg     (8)

Eqs. 4/5 are the paper's (Pro-Prophet Sec. IV-B: one expert's bytes over the D - n receiving ranks,
spread over the D ranks' links) plus our per-hop latency lambda_x (``trans_latency``: the receiving
ranks are reached one hop after another; 0 by default, so a profile without it prices as the paper).
With ``trans_ring`` the bandwidth term is instead the ring-pipelined broadcast's, size / B_x for any
fan-out (every link of the ring carries the expert once), so

    T_Trans(s, n) = s * broadcast_s(size(params), D - n, B_x, lambda_x)         (4, ring)

which is exactly what the simulator charges a Pro-Prophet plan (``Cluster.broadcast_time`` calls
``broadcast_s``; ``Cluster.cost_model`` sets ``trans_ring``, B_x = bottleneck link x broadcast
efficiency and lambda_x = its latency). Without those terms the planner priced one Trans at size / B_x
whatever D was, and at 256 GPUs replicated ~5x more than the simulator then charged for (docs/balance.md).

Constants come from a calibration profile (``tools/calibrate_balance.py`` writes it) or from the
defaults below; ``CostModel.from_profile(path)`` reads it.
"""

from __future__ import annotations

import dataclasses
import json
from typing import List, Optional, Sequence, Tuple

import numpy as np

__all__ = ["CostModel", "DEFAULT_PROFILE", "broadcast_s", "PlannerCost", "save_profile", "as_planner_cost",
           "sync_s_vec", "a2a_s", "planner_cost_from_cost_model", "OffloadCost", "rank_time_s", "a2a_crosses"]

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
    "a2a_latency": 0.0,
    "trans_latency": 0.0,
    "trans_ring": False,
}


def broadcast_s(nbytes: float, k: int, bandwidth: float, hop_latency: float = 0.0) -> float:
    """One ring-pipelined broadcast (or reduce) of ``nbytes`` over ``k`` ranks: every ring link
    carries the bytes once at ``bandwidth`` (the slowest link's achieved rate), and the last rank is
    reached after k - 1 hops of ``hop_latency``. The one formula for Trans / Agg / FasterMoE's shadow
    broadcast: the simulator charges it (``Cluster.broadcast_time``), Pro-Prophet's Eq. 4/5 price it
    (``CostModel.t_trans`` with ``trans_ring``)."""
    if k <= 1 or nbytes <= 0:
        return 0.0
    return nbytes / bandwidth + (k - 1) * hop_latency


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
    a2a_latency: float = 0.0                # fixed seconds per peer of one all-to-all round (calibrated)
    trans_latency: float = 0.0              # lambda_x: seconds per hop of one Trans/Agg (Eq. 4/5 latency term)
    trans_ring: bool = False                # Eq. 4/5 bandwidth term: False the paper's (D-n)/D, True ring broadcast

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
        return self.t_a2a_of_max(float(np.max(R)) if len(R) else 0.0)

    def t_a2a_of_max(self, r_max: float) -> float:
        """Eq. 1 from max(R) (the busiest rank's received inputs)."""
        msg = r_max * self.input_bytes
        return msg / self.bandwidth(msg) if msg > 0 else 0.0

    def t_fec(self, H) -> float:
        return float(np.max(H)) / self.throughput if len(H) else 0.0

    def t_bec(self, H) -> float:
        return 2.0 * self.t_fec(H)

    def t_trans(self, s: int, n: int, D: int) -> float:
        """Eq. 4: s experts each sent to D - n ranks (module docstring for the two bandwidth forms)."""
        k = D - n
        if self.trans_ring:
            return s * broadcast_s(self.expert_bytes, k, self._trans_bw(), self.trans_latency)
        t = s * k * self.expert_bytes / (D * self._trans_bw())
        return t + s * (k - 1) * self.trans_latency if self.trans_latency and k > 1 else t

    t_agg = t_trans   # grads and params have the same size in this model

    def t_ptrans(self, H, s: int, n: int, D: int, t_fec_prev: Optional[float] = None) -> float:
        fec = self.t_fec(H) if t_fec_prev is None else t_fec_prev
        return max(0.0, self.t_trans(s, n, D) - fec - self.t_fnec)

    def t_pagg(self, H, s: int, n: int, D: int, t_fec_prev: Optional[float] = None) -> float:
        bec = self.t_bec(H) if t_fec_prev is None else 2.0 * t_fec_prev
        return max(0.0, self.t_agg(s, n, D) - bec - self.t_bnec)

    # -- Eqs. 6 and 8 ----------------------------------------------------------------------
    def layer_time(self, R, H, s: int, n: int, D: int, eq8: bool = False) -> float:
        if eq8:
            base = 4.0 * self.t_a2a(R) + 3.0 * self.t_fec(H)
            return base + self.t_ptrans(H, s, n, D) + self.t_pagg(H, s, n, D)
        return self.layer_time_of_max(float(np.max(R)) if len(R) else 0.0,
                                      float(np.max(H)) if len(H) else 0.0, self.t_trans(s, n, D))

    def layer_time_of_max(self, r_max: float, h_max: float, trans_s: float) -> float:
        """Eq. 6 (``layer_time`` without eq8) from max(R), max(H) and ``t_trans(s, n, D)`` (= t_agg):
        the same arithmetic, for Pro-Prophet's search, which has those at hand every step."""
        return self.layer_time_of_parts(self.a2a_term_of_max(r_max), h_max, trans_s)

    def a2a_term_of_max(self, r_max: float) -> float:
        """Eq. 6's all-to-all term (4 x Eq. 1) from max(R)."""
        return 4.0 * self.t_a2a_of_max(r_max)

    def layer_time_of_parts(self, a2a_term: float, h_max: float, trans_s: float) -> float:
        """Eq. 6 from its all-to-all term (:meth:`a2a_term_of_max`), max(H) and ``t_trans``: the
        search keeps the all-to-all term while max(R) does not move."""
        return a2a_term + 3.0 * (h_max / self.throughput) + trans_s + trans_s

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
                   t_bnec=float(merged["t_bnec"]), a2a_latency=float(merged["a2a_latency"]),
                   trans_latency=float(merged["trans_latency"]), trans_ring=bool(merged["trans_ring"]))

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

    def planner_cost(self, num_ranks: int) -> "PlannerCost":
        """These constants as the per-rank pricing the FasterMoE / FlexMoE policies consume."""
        return planner_cost_from_cost_model(self, num_ranks)

    def to_dict(self) -> dict:
        return {"a2a_bandwidth": [[m, b] for m, b in self._a2a], "trans_bandwidth": self.trans_bandwidth,
                "throughput": self.throughput, "input_bytes": self.input_bytes,
                "expert_bytes": self.expert_bytes, "t_fnec": self.t_fnec, "t_bnec": self.t_bnec,
                "a2a_latency": self.a2a_latency, "trans_latency": self.trans_latency,
                "trans_ring": self.trans_ring}


def save_profile(path: str, profile: dict) -> dict:
    """Write a calibration profile (the one writer: ``tools/calibrate_balance.py`` and
    ``bench/policies.py`` call it). The profile is validated by building the ``CostModel`` it
    describes first, so a file that training would refuse is never written."""
    unknown = sorted(set(profile) - set(DEFAULT_PROFILE) - {"meta"})
    if unknown:
        raise ValueError(f"cost model profile {path}: unknown keys {unknown}")
    CostModel.from_dict(profile)
    with open(path, "w") as f:
        json.dump(profile, f, indent=1)
    return profile


# -- the per-rank pricing the FasterMoE / FlexMoE policies consume --------------------------------
class PricingCache:
    """Values FlexMoE's pricing derives from one ``PlannerCost`` and reads at every planner step,
    computed once per cost object. The cost owns it (``PlannerCost.cache``): every policy pricing
    with the same cost (the simulator's EP groups share one) shares it, and another cost (a new
    object, e.g. from ``dataclasses.replace``) starts empty."""

    __slots__ = ("pair_structure", "sync", "nodes", "sync_lut")

    def __init__(self):
        self.pair_structure = None   # (c_in, c_out, onehot[G, nodes], node index[G]), or False
        self.sync = None             # {(hosts, spans nodes): replica-group sync seconds}
        self.nodes = None            # the cost's node ids as a list (the sync key reads them)
        self.sync_lut = None         # the same seconds by 2 x hosts + spans nodes (NaN: not yet)


@dataclasses.dataclass
class PlannerCost:
    """Policies never read raw constants: they call these methods, so the same policy code runs
    inside training (built from the calibration profile) and inside the simulator (built from a
    ``Cluster``). All times are seconds; "input" = one (token, expert) pair."""
    fwd_s_per_input: float              # forward expert compute per input (backward = 2x)
    a2a_s_per_input: float             # one all-to-all round per received input at the average bandwidth
    param_collective_s: float          # one broadcast (or reduce) of one expert's parameters over the group
    pair_s_per_input: Optional[np.ndarray] = None   # [P, P] per-input seconds src -> dst (0 diagonal)
    grad_bytes: float = 0.0
    state_bytes: float = 0.0
    link_s_per_byte: Optional[np.ndarray] = None     # [P, P]
    node: Optional[np.ndarray] = None                # [P] node id of each group rank
    intra_bw: float = float("inf")
    inter_bw: float = float("inf")
    lat: float = 0.0
    a2a_lat_s: float = 0.0              # fixed latency of one all-to-all round (one message per peer)
    cache: PricingCache = dataclasses.field(default_factory=PricingCache, init=False, repr=False,
                                            compare=False)

    @classmethod
    def from_cluster(cls, cl, ranks: np.ndarray) -> "PlannerCost":
        """From a simulator ``Cluster`` (duck-typed: this module imports nothing from the simulator)."""
        ranks = np.asarray(ranks)
        link = cl.link_seconds_per_byte(ranks)
        bw = cl.bottleneck_bw(ranks)
        a2a = cl.bytes_per_input / bw if np.isfinite(bw) else 0.0
        node = cl.node_of(ranks)
        n = len(np.unique(node))
        local = len(ranks) // max(1, n)
        # one message per peer, on one stream (the simulator's flat all-to-all): the local peers at
        # the intra-node latency, the peers on other nodes at the inter-node one
        a2a_lat = (local - 1) * cl.intra_lat + (n - 1) * local * cl.inter_lat if len(ranks) > 1 else 0.0
        return cls(fwd_s_per_input=1.0 / cl.expert_tokens_per_s, a2a_s_per_input=a2a,
                   param_collective_s=cl.broadcast_time(cl.expert_param_bytes, ranks),
                   pair_s_per_input=link * cl.bytes_per_input, grad_bytes=cl.expert_param_bytes,
                   state_bytes=cl.expert_state_bytes, link_s_per_byte=link,
                   node=node, intra_bw=cl.intra_bw, inter_bw=cl.inter_bw,
                   lat=cl.max_lat(ranks), a2a_lat_s=float(a2a_lat))

    @classmethod
    def from_paper(cls, hidden: int, alpha: float, flops: float, net_elems_per_s: float,
                   num_ranks: int) -> "PlannerCost":
        """FasterMoE's simplified constants (note 2.5): H, alpha = ffn/H, P, W_net in elements/s."""
        fwd = 4.0 * alpha * hidden * hidden / flops
        a2a = hidden / net_elems_per_s
        param = 2.0 * alpha * hidden * hidden / net_elems_per_s
        pair = np.full((num_ranks, num_ranks), a2a)
        np.fill_diagonal(pair, 0.0)
        return cls(fwd_s_per_input=fwd, a2a_s_per_input=a2a, param_collective_s=param,
                   pair_s_per_input=pair)

    @property
    def num_ranks(self) -> int:
        return 0 if self.pair_s_per_input is None else self.pair_s_per_input.shape[0]

    def compute_s(self, inputs) -> np.ndarray:
        """Forward + backward expert compute (3 GEMM rounds) for ``inputs`` per rank."""
        return 3.0 * self.fwd_s_per_input * np.asarray(inputs, dtype=np.float64)

    def sync_s(self, ranks: Sequence[int]) -> float:
        """Ring all-reduce of one expert's gradients over ``ranks`` (group-local indices)."""
        k = len(ranks)
        if k <= 1 or self.grad_bytes <= 0:
            return 0.0
        nodes = self.node[np.asarray(ranks)] if self.node is not None else np.zeros(1)
        bw = self.intra_bw if len(np.unique(nodes)) == 1 else self.inter_bw
        return 2.0 * (k - 1) / k * self.grad_bytes / bw + 2 * (k - 1) * self.lat

    def state_move_s(self, a: int, b: int) -> float:
        if a == b or self.link_s_per_byte is None:
            return 0.0
        return self.state_bytes * float(self.link_s_per_byte[a, b]) + self.lat


def sync_s_vec(cost: PlannerCost, hosts: np.ndarray) -> np.ndarray:
    """Vectorised :meth:`PlannerCost.sync_s` for a boolean host matrix ``hosts[E, P]``."""
    k = hosts.sum(axis=1).astype(np.float64)
    out = np.zeros(hosts.shape[0])
    if cost.grad_bytes <= 0:
        return out
    if cost.node is not None:
        onehot = getattr(cost, "_node_onehot", None)
        if onehot is None:
            nodes = np.unique(cost.node)
            onehot = (cost.node[:, None] == nodes[None, :]).astype(np.float64)   # [P, nodes]
            cost._node_onehot = onehot
        spans = (hosts.astype(np.float64) @ onehot > 0).sum(axis=1)
    else:
        spans = np.ones(hosts.shape[0])
    bw = np.where(spans > 1, cost.inter_bw, cost.intra_bw)
    m = k > 1
    out[m] = 2.0 * (k[m] - 1) / k[m] * cost.grad_bytes / bw[m] + 2 * (k[m] - 1) * cost.lat
    return out


def rank_time_s(cost: PlannerCost, processed, traffic) -> np.ndarray:
    """Per-rank seconds of one MoE layer without replica upkeep: forward + backward compute of the
    ``processed[g]`` inputs plus 4 all-to-alls of ``traffic[src, dst]`` inputs. An all-to-all is a
    collective, so every rank waits for the slowest one: its time is the largest per-rank send or
    receive time over the links plus the round's fixed per-peer latency ``a2a_lat_s`` (as the
    simulator's flat model, without its per-node NIC sharing); zero when no input crosses ranks
    (``a2a_crosses``: the runtime skips such all-to-alls).
    ``--moe-balance-policy auto`` prices every candidate with it (plus each candidate's replica
    terms), so they compare on one scale."""
    t = cost.compute_s(processed)
    if cost.pair_s_per_input is not None and a2a_crosses(traffic):
        w = np.asarray(traffic, dtype=np.float64) * cost.pair_s_per_input
        t = t + 4.0 * (float(max(w.sum(axis=0).max(), w.sum(axis=1).max())) + cost.a2a_lat_s)
    return t


def a2a_crosses(traffic):
    """Whether an all-to-all with the EP group's matrix ``traffic[..., src, dst]`` (non-negative)
    moves anything between two ranks (one bool per leading index). When it does not, the runtime
    skips it (``balance/layer.py``: every rank holds the same all-gathered counts, so all skip
    together) and the simulator (``sim/alltoall.py``) charges nothing for it, so it is priced at
    zero here, latency included."""
    w = np.asarray(traffic, dtype=np.float64)
    return w.sum(axis=(-2, -1)) - np.trace(w, axis1=-2, axis2=-1) > 0


def planner_cost_from_cost_model(cm, num_ranks: int) -> PlannerCost:
    """PlannerCost priced by a ``CostModel`` (the one training uses):
    forward compute 1/t, all-to-all via ``cm.t_a2a`` (bandwidth by message size), one expert's
    parameter broadcast = ``cm.t_trans(1, 0, D)`` (and the gradient reduce = ``cm.t_agg``); one
    all-to-all round's fixed time = ``cm.a2a_latency`` per peer and the collectives' per-hop latency
    = ``cm.trans_latency`` (as ``PlannerCost.from_cluster`` takes both from the cluster)."""
    big = cm.bandwidth(float("inf"))
    pair = np.full((num_ranks, num_ranks), cm.input_bytes / big)
    np.fill_diagonal(pair, 0.0)
    pc = PlannerCost(fwd_s_per_input=1.0 / cm.throughput, a2a_s_per_input=cm.input_bytes / big,
                     param_collective_s=cm.t_trans(1, 0, num_ranks), pair_s_per_input=pair,
                     grad_bytes=float(cm.expert_bytes), state_bytes=4.0 * float(cm.expert_bytes),
                     link_s_per_byte=pair / cm.input_bytes, node=np.zeros(num_ranks, dtype=np.int64),
                     intra_bw=cm._trans_bw() if hasattr(cm, "_trans_bw") else big,
                     inter_bw=cm._trans_bw() if hasattr(cm, "_trans_bw") else big,
                     lat=float(getattr(cm, "trans_latency", 0.0)),
                     a2a_lat_s=(num_ranks - 1) * float(getattr(cm, "a2a_latency", 0.0)))
    pc.cost_model = cm
    return pc


def as_planner_cost(cost, num_ranks: int) -> PlannerCost:
    """Accept a PlannerCost, a ``CostModel`` or None (the CostModel's documented defaults)."""
    if isinstance(cost, PlannerCost):
        return cost
    if cost is None:
        cost = CostModel.from_profile(None)
    return planner_cost_from_cost_model(cost, num_ranks)


def a2a_s(cost, inputs: float) -> float:
    """One all-to-all round for a rank receiving ``inputs`` inputs (the CostModel's Eq. 1 when the
    PlannerCost was built from it, else the linear per-input rate)."""
    cm = getattr(cost, "cost_model", None)
    if cm is not None:
        return cm.t_a2a(np.array([inputs]))
    return cost.a2a_s_per_input * inputs


# -- MoESys expert offload (megatron_moe/offload, docs/offload.md) ----------------------------------
@dataclasses.dataclass
class OffloadCost:
    """Prices ``--moe-expert-offload``: per MoE layer, copying its local experts over the host link
    against computing the layer. Forward copies layer i+1 while layer i computes; backward copies
    layer i-1 while layer i computes (2x the forward FLOPs). With K >= 2 device slots one link
    moves one layer per layer step, so a layer takes max(compute, copy) and offloading is free when
    copy <= forward compute, i.e. tokens per expert >= FLOPS * bytes/param / (2 * link bandwidth)
    (about 12k tokens per expert for bf16 on an A100 over PCIe 4). SSD misses add their read time
    to the copy (the copy thread reads the file before it copies).
    """
    layer_expert_bytes: float            # one MoE layer's local expert parameters (compute dtype)
    link_bandwidth: float                # measured host->device bytes/s
    layer_forward_s: float               # forward seconds of one whole layer (attention + MoE)
    num_layers: int                      # MoE layers on this rank
    ssd_read_bytes_per_layer: float = 0.0
    ssd_bandwidth: Optional[float] = None

    def t_copy(self) -> float:
        ssd = self.ssd_read_bytes_per_layer / self.ssd_bandwidth if self.ssd_bandwidth else 0.0
        return self.layer_expert_bytes / self.link_bandwidth + ssd

    def step_s(self) -> float:
        """Modelled forward+backward seconds with offload: the first layer's copy is exposed,
        then max(compute, copy) per layer in each direction."""
        c, f = self.t_copy(), self.layer_forward_s
        return c + self.num_layers * (max(f, c) + max(2 * f, c))

    def resident_step_s(self) -> float:
        return self.num_layers * 3 * self.layer_forward_s

    def slowdown(self) -> float:
        return self.step_s() / self.resident_step_s()

    def is_free(self) -> bool:
        """The copy hides under the compute of one layer (the MoESys condition)."""
        return self.t_copy() <= self.layer_forward_s

    @classmethod
    def from_cost_model(cls, cm: "CostModel", inputs_per_rank: float, num_local_experts: int,
                        num_layers: int, link_bandwidth: float, t_nonexpert_s: float = 0.0,
                        **kw) -> "OffloadCost":
        """The same calibrated constants the planners and the simulator use: one layer's expert
        compute is Eq. 2 (inputs / throughput), its copy is its local experts' ``expert_bytes``."""
        return cls(layer_expert_bytes=num_local_experts * cm.expert_bytes,
                   link_bandwidth=link_bandwidth,
                   layer_forward_s=cm.t_fec(np.array([inputs_per_rank])) + t_nonexpert_s,
                   num_layers=num_layers, **kw)

    @staticmethod
    def min_tokens_per_expert(flops: float, bytes_per_param: float, link_bandwidth: float) -> float:
        """Expert forward = 2 FLOPs per parameter per token; copy = bytes_per_param per parameter."""
        return flops * bytes_per_param / (2.0 * link_bandwidth)


# -- MoESys ring-memory inference (megatron_moe/inference/ring_memory.py, docs/inference.md) ------
@dataclasses.dataclass
class RingMemoryCost:
    """Prices ``--ring-memory-slots K`` (moesys.md 2.10): N layers' weights streamed through K
    device slots. Compute runs one layer at a time, one link copies one layer at a time, and each
    slot cycles once per K layers through one compute and one copy, so a layer takes
    max(compute, copy, (compute + copy) / K). The link keeps up (the ring costs nothing) when that
    equals the compute: copy <= compute and copy <= (K - 1) compute; K = 1 never hides a copy.
    Device memory for the layers' weights is K/N of resident.
    """
    layer_bytes: float                   # one layer's weights (largest layer)
    link_bandwidth: float                # host->device bytes/s
    layer_forward_s: float               # one layer's forward (one decode or prefill step)
    slots: int                           # K
    num_layers: int                      # N

    def t_copy(self) -> float:
        return self.layer_bytes / self.link_bandwidth

    def layer_s(self) -> float:
        c, f = self.t_copy(), self.layer_forward_s
        return max(f, c, (f + c) / self.slots) if self.slots < self.num_layers else f

    def ratio(self) -> float:
        """Modelled tokens/s relative to all-resident."""
        return self.layer_forward_s / self.layer_s()

    def keeps_up(self) -> bool:
        return self.layer_s() <= self.layer_forward_s * (1 + 1e-9)

    def memory_fraction(self) -> float:
        return min(self.slots, self.num_layers) / self.num_layers
