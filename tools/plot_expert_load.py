#!/usr/bin/env python
"""Plot expert-load imbalance from a training log (the ``[moe] layer`` lines) to a PNG.

    python tools/plot_expert_load.py train.log --output expert_load.png

Top: max/mean tokens per expert for every MoE layer over iterations (1.0 = balanced).
Below: one heatmap per layer of each expert's share of the layer's tokens over iterations
(only when the log lists tokens per expert, i.e. at most 16 experts).
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
from collections import defaultdict

_ITER = re.compile(r" iteration +(\d+)/ *\d+ \|")
_MOE = re.compile(r"\[moe\] layer +(\d+) \| expert load max/mean: ([\d.]+) \| EP-rank load "
                  r"max/mean: ([\d.]+) \|(?: tokens per expert: (\[[\d, ]*\]) \|)?")


def parse_log(lines):
    """{layer: [(iteration, expert_ratio, rank_ratio, tokens or None), ...]}"""
    per_layer = defaultdict(list)
    iteration = None
    for line in lines:
        m = _ITER.search(line)
        if m:
            iteration = int(m.group(1))
            continue
        m = _MOE.search(line)
        if m and iteration is not None:
            tokens = ast.literal_eval(m.group(4)) if m.group(4) else None
            per_layer[int(m.group(1))].append(
                (iteration, float(m.group(2)), float(m.group(3)), tokens))
    return dict(per_layer)


def plot(per_layer, output):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    layers = sorted(per_layer)
    with_tokens = [l for l in layers if all(r[3] is not None for r in per_layer[l])]
    fig, axes = plt.subplots(1 + len(with_tokens), 1, figsize=(9, 3 + 2.2 * len(with_tokens)),
                             squeeze=False)
    ax = axes[0][0]
    for layer in layers:
        its = [r[0] for r in per_layer[layer]]
        ax.plot(its, [r[1] for r in per_layer[layer]], marker=".", label=f"layer {layer}")
    ax.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
    ax.set_xlabel("iteration")
    ax.set_ylabel("max / mean tokens per expert")
    ax.set_title("Expert load imbalance per MoE layer")
    ax.legend(fontsize=7, ncol=4)
    for row, layer in enumerate(with_tokens, start=1):
        records = per_layer[layer]
        counts = np.array([r[3] for r in records], dtype=float)
        share = counts / np.maximum(counts.sum(axis=1, keepdims=True), 1.0)
        ax = axes[row][0]
        im = ax.imshow(share.T, aspect="auto", origin="lower", cmap="viridis",
                       extent=(records[0][0], records[-1][0], -0.5, counts.shape[1] - 0.5))
        ax.set_ylabel(f"layer {layer}\nexpert")
        fig.colorbar(im, ax=ax, label="token share")
    axes[-1][0].set_xlabel("iteration")
    fig.tight_layout()
    fig.savefig(output, dpi=110)
    plt.close(fig)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("log", help="training log (stdout of pretrain_gpt_moe.py)")
    parser.add_argument("--output", default="expert_load.png")
    args = parser.parse_args(argv)
    try:
        with open(args.log, errors="replace") as f:
            per_layer = parse_log(f)
    except OSError as exc:
        parser.error(f"cannot read {args.log}: {exc.strerror}")
    if not per_layer:
        parser.error(f"{args.log}: no '[moe] layer' lines (was --no-log-expert-load set, or is "
                     f"this not a MoE training log?)")
    plot(per_layer, args.output)
    worst = max((r[1], layer, r[0]) for layer, rs in per_layer.items() for r in rs)
    print(f"wrote {args.output}: {len(per_layer)} MoE layers; worst max/mean {worst[0]:.3f} "
          f"(layer {worst[1]}, iteration {worst[2]})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
