"""Tables and PNG plots of simulator results."""

from __future__ import annotations

import os
from typing import Dict, List

import numpy as np

__all__ = ["format_table", "plot_results", "SPEEDUP_FIELDS"]

SPEEDUP_FIELDS = ("iter_s", "a2a_s", "expert_s", "trans_agg_s", "plan_s", "adjust_s",
                  "exposed_comm_s", "hidden_comm_s")


def format_table(results: Dict) -> str:
    """``results[(scale, algorithm, policy)]`` -> rows with ms breakdown and speedup over plain EP."""
    hdr = (f"{'gpus':>5} {'a2a-alg':>12} {'policy':>19} {'iter ms':>9} {'a2a':>8} {'expert':>8} "
           f"{'trans/agg':>9} {'plan':>7} {'adjust':>7} {'exposed':>8} {'hidden':>8} {'max/mean':>8} "
           f"{'speedup':>8}")
    lines = [hdr, "-" * len(hdr)]
    for (scale, algo, pol), r in results.items():
        bal = r["max_load"] / r["mean_load"] if r["mean_load"] else 1.0
        lines.append(f"{scale:>5} {algo:>12} {pol:>19} {r['iter_s']*1e3:9.2f} {r['a2a_s']*1e3:8.2f} "
                     f"{r['expert_s']*1e3:8.2f} {r['trans_agg_s']*1e3:9.2f} {r['plan_s']*1e3:7.2f} "
                     f"{r['adjust_s']*1e3:7.2f} {r['exposed_comm_s']*1e3:8.2f} "
                     f"{r['hidden_comm_s']*1e3:8.2f} {bal:8.2f} {r['speedup']:7.2f}x")
    return "\n".join(lines)


def plot_results(results: Dict, out_dir: str, prefix: str = "sim") -> List[str]:
    """Write ``<prefix>_speedup.png`` (speedup per policy and scale), ``<prefix>_breakdown.png``
    (stacked time breakdown) and ``<prefix>_iterations.png`` (per-iteration time, largest scale)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(out_dir, exist_ok=True)
    paths = []
    scales = sorted({k[0] for k in results})
    algos = sorted({k[1] for k in results})
    pols = [p for p in dict.fromkeys(k[2] for k in results)]
    # speedup
    fig, axes = plt.subplots(1, len(algos), figsize=(5 * len(algos), 3.6), squeeze=False)
    for ax, algo in zip(axes[0], algos):
        w = 0.8 / max(1, len(pols))
        for i, pol in enumerate(pols):
            ys = [results.get((s, algo, pol), {}).get("speedup", np.nan) for s in scales]
            ax.bar(np.arange(len(scales)) + i * w, ys, w, label=pol)
        ax.set_xticks(np.arange(len(scales)) + 0.4 - w / 2)
        ax.set_xticklabels([str(s) for s in scales])
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xlabel("GPUs"); ax.set_ylabel("speedup over plain EP"); ax.set_title(f"all-to-all: {algo}")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    p = os.path.join(out_dir, f"{prefix}_speedup.png"); fig.savefig(p, dpi=110); plt.close(fig); paths.append(p)
    # breakdown (first algorithm)
    parts = ("a2a_s", "expert_s", "trans_agg_s", "plan_s", "adjust_s")
    fig, ax = plt.subplots(figsize=(max(6, 1.0 * len(scales) * len(pols)), 4))
    keys = [(s, algos[0], p) for s in scales for p in pols if (s, algos[0], p) in results]
    x = np.arange(len(keys))
    bottom = np.zeros(len(keys))
    for part in parts:
        ys = np.array([results[k][part] * 1e3 for k in keys])
        ax.bar(x, ys, bottom=bottom, label=part.replace("_s", ""))
        bottom += ys
    ax.plot(x, [results[k]["iter_s"] * 1e3 for k in keys], "k_", ms=20, label="iteration")
    ax.set_xticks(x); ax.set_xticklabels([f"{k[0]}\n{k[2]}" for k in keys], fontsize=6)
    ax.set_ylabel("ms per iteration (busy time per part)"); ax.set_title(f"breakdown, {algos[0]} all-to-all")
    ax.legend(fontsize=7); fig.tight_layout()
    p = os.path.join(out_dir, f"{prefix}_breakdown.png"); fig.savefig(p, dpi=110); plt.close(fig); paths.append(p)
    # per-iteration
    fig, ax = plt.subplots(figsize=(7, 3.6))
    s = scales[-1]
    for pol in pols:
        r = results.get((s, algos[0], pol))
        if r is not None and "per_iter" in r:
            ax.plot(np.asarray(r["per_iter"]) * 1e3, label=pol)
    ax.set_xlabel("iteration"); ax.set_ylabel("ms"); ax.set_title(f"{s} GPUs, {algos[0]}")
    ax.legend(fontsize=7); fig.tight_layout()
    p = os.path.join(out_dir, f"{prefix}_iterations.png"); fig.savefig(p, dpi=110); plt.close(fig); paths.append(p)
    return paths
