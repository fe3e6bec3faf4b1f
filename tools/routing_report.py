#!/usr/bin/env python
"""Routing report from a ``--moe-routing-trace-dir``: a PNG heatmap of per-layer load over iterations,
before (plain EP) and after the placement that was used, plus a short text summary.

    python tools/routing_report.py TRACE_DIR --out report.png [--summary summary.txt]

Trace format (written by ``BalanceManager.after_step``): JSON lines ``{"iteration", "layer",
"counts": [[D x E]], "placement": [[expert, [excluded ranks]], ...]}`` in ``counts_rank*.jsonl``,
plus ``"vexperts": [[E x D]]`` (slots per expert and rank) under FlexMoE: the "after" loads then follow
its flexible token router rather than the locality rule.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from megatron_moe.balance.policies.base import Placement, balance_degree, loads  # noqa: E402


def read_trace(trace_dir):
    files = sorted(glob.glob(os.path.join(trace_dir, "*.jsonl")))
    if not files:
        raise SystemExit(f"{trace_dir}: no *.jsonl routing trace files (written by --moe-routing-trace-dir)")
    per_layer = defaultdict(dict)
    for path in files[:1]:       # one EP group's view is enough: the counts are all-gathered over EP
        with open(path) as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                    C = np.asarray(row["counts"], dtype=np.float64)
                    per_layer[int(row["layer"])][int(row["iteration"])] = (
                        C, row.get("placement", []), row.get("vexperts"))
                except (ValueError, KeyError, TypeError) as exc:
                    raise SystemExit(f"{path}:{lineno}: bad trace row: {exc}")
    return per_layer


def summarise(per_layer):
    lines, data = [], {}
    for layer in sorted(per_layer):
        its = sorted(per_layer[layer])
        Hb, Ha, loc_err, repl = [], [], [], []
        prev = None
        for it in its:
            C, plan, vexperts = per_layer[layer][it]
            D, E = C.shape
            used = Placement.from_plan(plan, E, D)
            if vexperts is not None:     # FlexMoE: its token router splits over the vExpert slots
                used.vexperts = vexperts
                used.validate()
            Hb.append(loads(C, Placement.plain(E, D))[0])
            Ha.append(loads(C, used)[0])
            repl.append(len(plan))
            if prev is not None:
                load, pload = C.sum(0), prev.sum(0)
                loc_err.append(float(np.mean(np.abs(load - pload) / np.maximum(pload, 1))))
            prev = C
        Hb, Ha = np.array(Hb), np.array(Ha)
        data[layer] = (its, Hb, Ha)
        mm = lambda H: float(np.mean(H.max(1) / np.maximum(H.mean(1), 1e-12)))
        sb = float(np.mean([balance_degree(h) for h in Hb]))
        sa = float(np.mean([balance_degree(h) for h in Ha]))
        lines.append(f"layer {layer:3d}: iterations {its[0]}-{its[-1]} ({len(its)}), rank max/mean "
                     f"{mm(Hb):.3f} -> {mm(Ha):.3f}, std {sb:.1f} -> {sa:.1f}"
                     f" (RB {sb / sa if sa > 0 else float('inf'):.2f}), replicated experts/iter "
                     f"{np.mean(repl):.2f}, locality error (last value) "
                     f"{np.mean(loc_err) * 100 if loc_err else float('nan'):.1f}%")
    return lines, data


def plot(data, out):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layers = sorted(data)
    fig, axes = plt.subplots(len(layers), 2, figsize=(10, 2.2 * len(layers) + 0.6), squeeze=False)
    vmax = max(max(Hb.max(), Ha.max()) for _, Hb, Ha in data.values())
    for row, layer in enumerate(layers):
        its, Hb, Ha = data[layer]
        for col, (H, title) in enumerate(((Hb, "plain EP"), (Ha, "planned placement"))):
            ax = axes[row][col]
            im = ax.imshow(H.T, aspect="auto", interpolation="nearest", vmin=0, vmax=vmax,
                           extent=(its[0] - 0.5, its[-1] + 0.5, H.shape[1] - 0.5, -0.5))
            ax.set_title(f"layer {layer}: inputs computed per rank, {title}", fontsize=8)
            ax.set_ylabel("EP rank", fontsize=8)
            if row == len(layers) - 1:
                ax.set_xlabel("iteration", fontsize=8)
    fig.colorbar(im, ax=axes, shrink=0.8, label="inputs")
    fig.savefig(out, dpi=90)
    plt.close(fig)


def main(argv=None):
    p = argparse.ArgumentParser(prog="routing_report.py", description=__doc__.splitlines()[0])
    p.add_argument("trace_dir")
    p.add_argument("--out", default="routing_report.png")
    p.add_argument("--summary", default=None, help="also write the text summary here")
    a = p.parse_args(argv)
    lines, data = summarise(read_trace(a.trace_dir))
    plot(data, a.out)
    text = "\n".join(lines)
    print(text)
    if a.summary:
        with open(a.summary, "w") as f:
            f.write(text + "\n")
    return lines


if __name__ == "__main__":
    main()
