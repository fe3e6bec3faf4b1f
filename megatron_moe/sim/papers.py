"""The seed papers' testbeds, models and published numbers as data, and the simulator set up to
reproduce them (``bench/paper_tables.py``).

Data files (``megatron_moe/sim/testbeds/``), every number with its source:

* ``<paper>_<cluster>.json``: one testbed each (GPU peak FLOP/s and memory bandwidth, intra-node link,
  optional NVLink pair link, inter-node NICs, latencies);
* ``models.json``: the papers' model configurations and per-paper run settings (tokens, precision,
  top-k, benchmark scope, the imbalance each paper reports and how the trace matches it);
* ``published.json``: every published cell we model (speed-up of a system over a baseline) and
  the ones we do not, with the reason.

Two free constants turn peaks into achieved rates: ``flops`` (achieved fraction of the GPU's peak
FLOP/s, for expert and non-expert GEMMs) and ``net`` (achieved fraction of every link's bandwidth, for
all-to-all, broadcast/reduce and all-reduce).  They are fitted on Pro-Prophet's Table IV only; every
other table is predicted with the same two numbers, except on a testbed whose paper publishes the
achieved rates its validated performance model runs with (an ``achieved`` section: FasterMoE's
johnny and trevor), which uses those published rates instead (:func:`achieved_rates`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from .cluster import Cluster
from .engine import FIELDS
from .runner import simulate
from .traces import synthetic_trace

__all__ = ["TESTBED_DIR", "Efficiency", "load_testbed", "list_testbeds", "load_models", "load_published",
           "paper_cluster", "paper_trace", "zipf_for_share", "SYSTEMS", "simulate_system", "PaperSim",
           "smart_schedule_degree", "achieved_rates", "steady_state_warmup", "shadow_decision_cost"]

TESTBED_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "testbeds")

# system name in the papers -> (simulator policy, policy kwargs, smart-schedule pipelining)
SYSTEMS: Dict[str, Tuple[str, Dict, bool]] = {
    # Pro-Prophet Sec. VI-A: "It exclusively implements EP"; FasterMoE is slower than it in Table V
    # (k=1 DM, 0.96x), impossible against a padded all-to-all: dropless EP, no pipelining
    "DeepSpeed-MoE": ("none", {}, False),
    "DeepSpeed-MoE padded": ("deepspeed", {}, False),            # drop_tokens=False: pad to max count
    "DeepSpeed": ("deepspeed", {"capacity_factor": 1.0}, False),  # FlexMoE's: capacity 1.0, drops
    "FastMoE": ("none", {}, False),
    "FasterMoE": ("fastermoe", {}, True),
    "FasterMoE shadowing": ("fastermoe", {}, False),
    "FasterMoE smart schedule": ("none", {}, True),
    "Pro-Prophet": ("proprophet+overlap", {}, True),            # built on FasterMoE's pipelined A2A
    "FlexMoE": ("flexmoe", {}, False),
}


@dataclasses.dataclass(frozen=True)
class Efficiency:
    flops: float = 0.5      # achieved fraction of peak FLOP/s
    net: float = 0.5        # achieved fraction of link bandwidth

    def __post_init__(self):
        for f in ("flops", "net"):
            v = getattr(self, f)
            if not 0.0 < v <= 1.0:
                raise ValueError(f"efficiency {f}={v} must be in (0, 1]")


def _read(path: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: no such file") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}:{e.lineno}: invalid JSON ({e.msg})") from None


def list_testbeds() -> List[str]:
    return sorted(f[:-5] for f in os.listdir(TESTBED_DIR)
                  if f.endswith(".json") and f not in ("models.json", "published.json"))


_NEED = {"gpu": ("peak_fp32_flops", "memory_bandwidth"), "intra": ("bandwidth", "latency_s"),
         "inter": ("bandwidth_per_nic", "nics_per_node", "latency_s")}


def load_testbed(name: str) -> dict:
    """A testbed by file stem (``proprophet_hpnv``) or path; every section must name its source."""
    path = name if name.endswith(".json") else os.path.join(TESTBED_DIR, name + ".json")
    d = _read(path)
    for sec, keys in _NEED.items():
        if sec not in d or not isinstance(d[sec], dict):
            raise ValueError(f"{path}: missing section {sec!r}")
        for k in keys + ("source",):
            if k not in d[sec]:
                raise ValueError(f"{path}: {sec}.{k} missing")
    if "intra_pair" in d and "source" not in d["intra_pair"]:
        raise ValueError(f"{path}: intra_pair.source missing")
    if int(d.get("gpus_per_node", 0)) < 1:
        raise ValueError(f"{path}: gpus_per_node must be >= 1")
    return d


def load_models() -> dict:
    return _read(os.path.join(TESTBED_DIR, "models.json"))


def load_published() -> dict:
    return _read(os.path.join(TESTBED_DIR, "published.json"))


def zipf_for_share(num_experts: int, share: float, top: Optional[int] = None,
                   bottom: Optional[int] = None) -> float:
    """Zipf exponent s whose ``top`` heaviest (or ``bottom`` lightest) experts hold ``share`` of the
    inputs (bisection; the share is monotone in s)."""
    r = np.arange(1, num_experts + 1, dtype=np.float64)

    def f(s):
        p = r ** -s
        p /= p.sum()
        return p[:top].sum() if top else p[-bottom:].sum()

    lo, hi = 0.0, 8.0
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        if (f(mid) < share) == bool(top):
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


def _popularity(imb: dict, num_experts: int):
    """(zipf_s, popularity) of a paper's imbalance description (models.json)."""
    if imb["kind"] == "zipf":
        m = re.fullmatch(r"(top|bottom)(\d+)_share", imb["match"])
        if not m:
            raise ValueError(f"models.json: imbalance match {imb['match']!r} is not top<N>_share / bottom<N>_share")
        # match_experts: the share is stated for that many experts (the exponent carries over to more)
        n = int(imb.get("match_experts", num_experts))
        return zipf_for_share(n, imb["value"], **{m.group(1): int(m.group(2))}), None
    if imb["kind"] == "hot":
        h, share = int(imb["hot_experts"]), float(imb["hot_share_each"])
        rest = (1.0 - h * share) / (num_experts - h)
        return 0.0, np.array([share] * h + [rest] * (num_experts - h))
    raise ValueError(f"models.json: unknown imbalance kind {imb['kind']!r}")


def _settings(model: str) -> Tuple[dict, dict]:
    m = load_models()
    if model not in m["models"]:
        raise ValueError(f"models.json: unknown model {model!r}")
    cfg = m["models"][model]
    return cfg, m["papers"][cfg["paper"]]


def _tokens_per_gpu(run: dict, gpus: int, cfg: Optional[dict] = None) -> int:
    """Tokens per GPU and iteration: the model's own (``tokens_per_gpu`` in its models.json entry,
    when its benchmark ran a different batch per model), else its paper's run setting."""
    if cfg and "tokens_per_gpu" in cfg:
        return int(cfg["tokens_per_gpu"])
    if "tokens_per_gpu" in run:
        return int(run["tokens_per_gpu"])
    return int(run["tokens_per_iteration"][str(gpus)]) // gpus


def achieved_rates(tb: dict, eff: Efficiency, dtype_bytes: int) -> Tuple[float, float, float, Optional[float]]:
    """(GEMM FLOP/s, intra-node link bytes/s, one NIC's bytes/s, NVLink-pair bytes/s or None) a
    testbed achieves.

    A testbed whose paper publishes the rates its validated performance model runs with (section
    ``achieved``: FasterMoE's predictor, R^2 0.987 / 0.967 against measured latency) uses those; the
    others get the peak / link rates times the fitted ``eff``.  FasterMoE's own MoE-layer latencies
    (Fig. 11: 40-120 ms per MoE-BERT-Deep layer; Table 3: 2117 ms per whole MoE-GPT iteration) rule
    the fitted fraction out there: at 0.05 of peak one MoE-GPT iteration's MoE layers alone take
    over 10 s."""
    peak = float(tb["gpu"]["peak_fp16_flops"] if dtype_bytes == 2 else tb["gpu"]["peak_fp32_flops"])
    a = tb.get("achieved")
    if a is None:
        pair = tb.get("intra_pair", {}).get("bandwidth")
        return (peak * eff.flops, float(tb["intra"]["bandwidth"]) * eff.net,
                float(tb["inter"]["bandwidth_per_nic"]) * eff.net, float(pair) * eff.net if pair else None)
    pair = a.get("intra_pair_bandwidth")
    return (float(a["gemm_flops"]), float(a["intra_bandwidth"]), float(a["inter_bandwidth_per_nic"]),
            float(pair) if pair else None)


def paper_cluster(testbed: str, model: str, gpus: int, eff: Efficiency, top_k: int,
                  benchmark: Optional[str] = None) -> Cluster:
    """The ``Cluster`` (hence the ``CostModel`` the planners price with) of ``model`` on ``gpus``
    GPUs of ``testbed``: achieved rates = peak x ``eff``; non-expert time from the model's FLOPs.

    end_to_end benchmarks also get per block the attention (and dense FFN layers between MoE layers)
    as FNEC / BNEC = 2 FNEC, and per iteration the LM head, the data-parallel all-reduce of the dense
    gradients (ring, after backward, not overlapped as in FastMoE/Megatron-LM of the papers' time) and
    the Adam step (memory bound).  moe_layers_only benchmarks (FasterMoE's latency traces) get none.
    Rates: :func:`achieved_rates` (a testbed's published achieved rates, else peak x ``eff``).
    ``benchmark`` overrides the paper's scope for one cell (FasterMoE's Table 3 is a whole training
    iteration of Megatron-LM, its other cells the MoE-layer benchmark).
    """
    tb = load_testbed(testbed)
    cfg, run = _settings(model)
    h, f = int(cfg["hidden"]), int(cfg["ffn_hidden"])
    b = int(run["dtype_bytes"])
    flops, intra, nic_rate, pair = achieved_rates(tb, eff, b)
    rpn = int(tb["gpus_per_node"])
    nics = int(tb["inter"]["nics_per_node"])
    kw = dict(num_gpus=gpus, ranks_per_node=min(rpn, gpus),
              intra_bw=intra,
              inter_bw=min(nic_rate, intra),       # one rank drives one NIC
              node_inter_bw=nic_rate * nics,
              intra_lat=float(tb["intra"]["latency_s"]), inter_lat=float(tb["inter"]["latency_s"]),
              intra_pair_bw=pair,
              hidden_size=h, ffn_hidden_size=f, dtype_bytes=b, device_flops=flops,
              expert_state_bytes=float(2 * h * f * (b + 12)), source=f"{testbed} / {model}",
              msg_efficiency=tb.get("message_efficiency", {}).get("table"),
              bcast_efficiency=float(tb.get("collective_efficiency", {}).get("value", 1.0)))
    if (benchmark or run["benchmark"]) == "moe_layers_only":
        return Cluster(t_fnec_s=0.0, t_bnec_s=0.0, t_step_s=0.0, **kw)
    tokens = _tokens_per_gpu(run, gpus, cfg)
    s, v, every = int(run["seq_length"]), int(run["vocab_size"]), int(cfg.get("moe_every", 1))
    layers = int(cfg["layers"])
    # per MoE block: `every` attention layers + (every - 1) dense FFN layers, forward FLOPs
    fnec = tokens * (every * (8.0 * h * h + 4.0 * s * h) + (every - 1) * 4.0 * h * f) / flops
    head = 3.0 * tokens * 2.0 * v * h / flops
    n_moe = layers // every
    dense = layers * 4.0 * h * h + (layers - n_moe) * 2.0 * h * f + (v + s) * h
    experts_here = n_moe * max(1, int(cfg.get("experts", gpus)) // gpus) * 2.0 * h * f
    nodes = max(1, gpus // rpn)
    ring_bw = min(intra, nic_rate * nics) if nodes > 1 else intra
    allreduce = 2.0 * (gpus - 1) / gpus * dense * b / ring_bw if gpus > 1 else 0.0
    adam_bytes = 28.0 if b == 4 else 32.0          # read p, g, m, v (+ fp16 copy), write p, m, v
    opt = (dense + experts_here) * adam_bytes / float(tb["gpu"]["memory_bandwidth"])
    return Cluster(t_fnec_s=fnec, t_bnec_s=2.0 * fnec, t_step_s=head + allreduce + opt, **kw)


def paper_trace(model: str, gpus: int, top_k: int, iterations: int, seed: int = 0,
                source_sigma: float = 0.3) -> np.ndarray:
    """Routing trace with the imbalance the model's paper reports (models.json ``imbalance``); at k = 2
    every token goes to 2 distinct experts (``synthetic_trace(top_k=...)``), the reported popularity
    being that of a token's first choice."""
    cfg, run = _settings(model)
    e = int(cfg.get("experts", gpus))
    zs, pop = _popularity(run["imbalance"], e)
    layers = int(cfg["layers"]) // int(cfg.get("moe_every", 1))
    return synthetic_trace(gpus, e, iterations, layers, top_k * _tokens_per_gpu(run, gpus, cfg), zs,
                           drift_sigma=0.05, source_sigma=source_sigma, seed=seed, popularity=pop,
                           top_k=top_k)


def smart_schedule_degree(testbed: str, gpus: int, model: Optional[str] = None) -> int:
    """FasterMoE's group-wise exchange: n = gpus / group size, n steps.  The group is the paper's
    run setting where it states one (models.json ``smart_schedule_group``: FasterMoE's artifact runs
    FMOE_FUSE_GRAN=2), else one node of tightly connected workers (Sec. 4.2's heuristic)."""
    group = None
    if model is not None:
        group = _settings(model)[1].get("smart_schedule_group")
    if group is None:
        group = int(load_testbed(testbed)["gpus_per_node"])
    return max(2, gpus // int(group))


def steady_state_warmup(model: str) -> int:
    """Extra warm-up iterations before the measured ones (models.json ``steady_state_warmup``): a
    published number over a whole training run (FlexMoE's time to quality) sees the placement a
    persistent-replica policy converges to, not the few iterations it needs to get there from plain
    EP (FlexMoE adds and moves replicas a few per step: about 4 iterations at 64 GPUs)."""
    return int(_settings(model)[1].get("steady_state_warmup", 0))


_TRACES: Dict = {}


class PaperSim:
    """Simulates (testbed, model, gpus, k, system) with one efficiency; traces and results cached."""

    def __init__(self, eff: Efficiency, iterations: int = 8, seed: int = 0):
        self.eff, self.iterations, self.seed = eff, int(iterations), int(seed)
        self._traces: Dict = _TRACES       # traces do not depend on the efficiency: shared by a fit's runs
        self._res: Dict = {}

    def iter_s(self, testbed: str, model: str, gpus: int, top_k: int, system: str,
               benchmark: Optional[str] = None) -> float:
        return self.measure(testbed, model, gpus, top_k, system, "iter_s", benchmark)

    def measure(self, testbed: str, model: str, gpus: int, top_k: int, system: str, field: str,
                benchmark: Optional[str] = None) -> float:
        """Mean of one engine field (``engine.FIELDS``: iter_s, trans_agg_s, ...) over the measured
        iterations."""
        key = (testbed, model, gpus, top_k, system, benchmark)
        if key not in self._res:
            warm = steady_state_warmup(model)
            tk = (model, gpus, top_k, self.iterations + warm, self.seed)
            if tk not in self._traces:
                self._traces[tk] = paper_trace(model, gpus, top_k, self.iterations + warm, self.seed)
            self._res[key] = simulate_system(self._traces[tk], testbed, model, gpus, top_k, system, self.eff,
                                             benchmark, skip=1 + warm, fields=FIELDS)
        return self._res[key][field]

    def speedup(self, testbed: str, model: str, gpus: int, top_k: int, system: str, baseline: str,
                benchmark: Optional[str] = None) -> float:
        return (self.iter_s(testbed, model, gpus, top_k, baseline, benchmark)
                / self.iter_s(testbed, model, gpus, top_k, system, benchmark))

    def cell(self, c: dict) -> float:
        """Simulated value of one published cell (``stat`` reduces over its models x gpus).  ``metric``
        (default ``speedup`` of ``system`` over ``baseline``): ``iteration_ms``, the system's absolute
        iteration time, or ``trans_agg_share``, the share of its iteration its Trans/Agg (shadow
        broadcast + gradient reduce) traffic takes, as busy time on a rank's link."""
        metric = c.get("metric", "speedup")
        models = c["model"] if isinstance(c["model"], list) else [c["model"]]
        vals = []
        for m in models:
            g = c["gpus"]
            gs = [g[m]] if isinstance(g, dict) else (g if isinstance(g, list) else [g])
            for gg in gs:
                args = (c["testbed"], m, int(gg), int(c["top_k"]), c["system"])
                if metric == "speedup":
                    vals.append(self.speedup(*args, c["baseline"], c.get("benchmark")))
                elif metric == "iteration_ms":
                    vals.append(1e3 * self.iter_s(*args, c.get("benchmark")))
                elif metric == "trans_agg_share":
                    vals.append(self.measure(*args, "trans_agg_s", c.get("benchmark")) / self.iter_s(*args, c.get("benchmark")))
                else:
                    raise ValueError(f"published.json: unknown metric {metric!r}")
        stat = c.get("stat", "value")
        if stat in ("value", "max"):
            return float(max(vals))
        if stat == "min":
            return float(min(vals))
        if stat == "mean":
            return float(np.mean(vals))
        raise ValueError(f"published.json: unknown stat {stat!r}")


def shadow_decision_cost(model: str, ranks: int):
    """The cost FasterMoE's shadowing decision is priced with in a paper's own runs (models.json
    ``shadow_decision``), or None (the simulated cluster's, as training prices it).  FasterMoE's code
    (thu-pacman/FasterMoE b2d13dd, the artifact's submodule; fmoe/transformer.py ``_global_policy``)
    hard-codes johnny's constants and multiplies the 4 bytes per element into the FLOP count too:
    per input 3 x 4 alpha H^2 x 4 / 11.5e12 s of GEMM, 4 x 4 H / (50e9 / 8) s of all-to-all, 2 x
    2 alpha H^2 x 4 / (50e9 / 8) s per shadowed expert, i.e. ``PlannerCost.from_paper`` at 11.5e12 / 4
    FLOP/s and (50e9 / 8) / 4 elements/s, Eq. 8 without the residual all-to-all.  (Its loop keeps
    the best prefix from +inf and resets the owner's load to its own inputs; emulating that too gives
    the same cells.)"""
    sd = _settings(model)[1].get("shadow_decision")
    if sd is None:
        return None
    from megatron_moe.balance.cost_model import PlannerCost
    cfg = _settings(model)[0]
    h, f, k = int(cfg["hidden"]), int(cfg["ffn_hidden"]), float(sd["flop_bytes_factor"])
    return PlannerCost.from_paper(h, f / h, float(sd["gemm_flops"]) / k,
                                  float(sd["net_bandwidth"]) / float(sd["bytes_per_element"]), ranks)


def simulate_system(trace: np.ndarray, testbed: str, model: str, gpus: int, top_k: int, system: str,
                    eff: Efficiency, benchmark: Optional[str] = None, skip: int = 1, fields=None):
    """Mean iteration seconds of a paper's ``system`` (``SYSTEMS``), the first ``skip`` iterations
    (warm-up) excluded; with ``fields``, a dict of those engine fields' means instead."""
    if system not in SYSTEMS:
        raise ValueError(f"published.json: unknown system {system!r}; known: {sorted(SYSTEMS)}")
    pol, kw, smart = SYSTEMS[system]
    kw = dict(kw)
    # a paper may have run a system without FasterMoE's pipelining, or in another mode (models.json
    # papers.<paper>.systems: smart_schedule, policy + policy_kwargs)
    as_run = _settings(model)[1].get("systems", {}).get(system, {})
    smart = bool(as_run.get("smart_schedule", smart))
    if "policy" in as_run:
        pol, kw = as_run["policy"], dict(as_run.get("policy_kwargs", {}))
    if pol == "fastermoe":
        dc = shadow_decision_cost(model, int(_settings(model)[0].get("experts", gpus)))
        if dc is not None:
            kw.update(cost=dc, paper_literal=True)
    cl = paper_cluster(testbed, model, gpus, eff, top_k, benchmark)
    degree = smart_schedule_degree(testbed, gpus, model) if smart else 1
    r = simulate(trace, cl, pol, "flat", policy_kwargs=kw, degree=degree)
    def mean(v):
        return float(v[skip:].mean() if len(v) > skip else v[-1:].mean())
    if fields is None:
        return mean(r.values["iter_s"])
    return {f: mean(r.values[f]) for f in fields}
