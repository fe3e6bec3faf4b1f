#!/usr/bin/env python
"""Pro-Prophet at top-2: the checks behind docs/sim.md's "k=2" paragraph (issue 21 item 3).

Not published cells of ``bench/paper_tables.py`` (nothing is fitted here; the constants are given,
by default the Table IV fit of docs/sim.md):

1. *Fig. 14* (MoE-GPT-M, the default HPWNV cluster; Sec. VI-C): each component's gain over the
   previous step, k = 1 / 2: planner over Pro-Prophet with every optimisation off (dropless EP, as
   FastMoE runs it) 1.26 / 1.12x, + scheduler 1.14 / 1.01x, + Eq. 8 coupling ("Full") 1.03 / 1.02x.
   The figure does not state the GPU count; 16 and 32 (Fig. 10's HPWNV sizes) are printed.
2. *DeepSpeed-MoE's top-2 before v0.14.0*: until deepspeedai/DeepSpeed PR #5156 (2024-03-07)
   ``top2gating`` had no ``drop_tokens`` argument: capacity ceil(2 x cf x S / E), overflow dropped.
   Pro-Prophet's and FasterMoE's speed-ups over that mode (cf 1.0) beside the padded dropless one
   the tables use (v0.14+: capacity = the largest count of mask1 + mask2 over ranks).
3. *k=2 over k=1*: per Table IV / V row and system, the k=2 speed-up over the k=1 one, published and
   simulated.

``--second-choice uniform`` is a sensitivity (not the simulator's law): a token's second expert
uniform over the other E - 1 (expert j among a token's two with p_j + (1 - p_j) / (E - 1)) instead of
the Plackett-Luce draw of ``traces.topk_inclusion``.

    python bench/paper_k2_checks.py [--flops 0.044 --net 1.0] [--iterations 4] [--second-choice uniform]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from megatron_moe.sim import papers, traces  # noqa: E402
from megatron_moe.sim.papers import Efficiency, PaperSim  # noqa: E402

# Fig. 14's steps as simulator systems (no pipelining, as Pro-Prophet's artifact runs; models.json)
STEPS = {"Pro-Prophet off": ("none", {}, False),
         "Pro-Prophet planner": ("proprophet", {}, False),                      # Eq. 6, no overlap
         "Pro-Prophet planner+scheduler": ("proprophet+overlap", {"eq8": False}, False),
         "Pro-Prophet full": ("proprophet+overlap", {}, False)}                # Eq. 8 (the tables' system)
FIG14 = {1: (1.26, 1.14, 1.03), 2: (1.12, 1.01, 1.02)}     # Sec. VI-C: planner, scheduler, Full


def _uniform_second(p, k):
    p = np.asarray(p, dtype=np.float64)
    if k == 1:
        return p.copy()
    return p + (1.0 - p) / (p.shape[-1] - 1)


def fig14(sim: PaperSim, gpus=(16, 32)):
    rows = []
    names = list(STEPS)
    for g in gpus:
        for k in (1, 2):
            t = [sim.iter_s("proprophet_hpwnv", "MoE-GPT-M", g, k, s) for s in names]
            rows.append((g, k, [t[i] / t[i + 1] for i in range(3)], FIG14[k]))
    return rows


def deepspeed_pre014(sim: PaperSim, cases):
    out = []
    for tb, m, g, k in cases:
        ds_pad = sim.iter_s(tb, m, g, k, "DeepSpeed-MoE")
        ds_drop = sim.iter_s(tb, m, g, k, "DeepSpeed")               # capacity_factor 1.0 x k x S / E
        out.append((tb, m, g, k, {s: (ds_pad / sim.iter_s(tb, m, g, k, s), ds_drop / sim.iter_s(tb, m, g, k, s))
                                  for s in ("FasterMoE", "Pro-Prophet")}))
    return out


def k2_over_k1(sim: PaperSim, tables=("Table IV", "Table V")):
    cells = [c for c in papers.load_published()["cells"] if c["paper"] == "proprophet" and c["table"] in tables]
    by = {(c["table"], c["row"].split(" ", 1)[1], c["system"], c["top_k"]): c for c in cells}
    out = []
    for (t, model, s, k), c2 in by.items():
        if k != 2:
            continue
        c1 = by[(t, model, s, 1)]
        out.append((t, model, s, c2["published"] / c1["published"], sim.cell(c2) / sim.cell(c1)))
    return out


def main(argv=None):
    p = argparse.ArgumentParser(prog="bench/paper_k2_checks.py", description=__doc__.split("\n")[0])
    p.add_argument("--flops", type=float, default=0.044, help="achieved fraction of peak FLOP/s (docs/sim.md fit)")
    p.add_argument("--net", type=float, default=1.0, help="achieved fraction of link bandwidth (docs/sim.md fit)")
    p.add_argument("--iterations", type=int, default=4)
    p.add_argument("--second-choice", choices=("plackett-luce", "uniform"), default="plackett-luce",
                   help="sensitivity: the law of a token's second expert at k=2")
    p.add_argument("--parts", nargs="+", choices=("fig14", "deepspeed", "ratios"),
                   default=["fig14", "deepspeed", "ratios"])
    args = p.parse_args(argv)
    t0 = time.process_time()
    if args.second_choice == "uniform":
        traces.topk_inclusion = _uniform_second      # this process only; traces are drawn after this
    for name, v in STEPS.items():
        papers.SYSTEMS.setdefault(name, v)
    sim = PaperSim(Efficiency(args.flops, args.net), args.iterations)
    if args.second_choice == "uniform":
        sim._traces = {}                             # not the module-wide cache of Plackett-Luce traces
    print(f"constants flops {args.flops} / net {args.net}, {args.iterations} iterations, "
          f"second choice: {args.second_choice}")
    res = {}
    if "fig14" in args.parts:
        res["fig14"] = fig14(sim)
        print("\nFig. 14, MoE-GPT-M on HPWNV: gain of each step over the previous (simulated / published)")
        print("| GPUs | k | planner | + scheduler | + Eq. 8 (Full) |\n|---|---|---|---|---|")
        for g, k, s, pub in res["fig14"]:
            print(f"| {g} | {k} | " + " | ".join(f"{a:.2f} / {b:.2f}x" for a, b in zip(s, pub)) + " |")
    if "deepspeed" in args.parts:
        cases = [("proprophet_hpnv", "MoE-GPT-S", 16, 2), ("proprophet_hpnv", "MoE-GPT-M", 16, 2),
                 ("proprophet_lpwnv", "MoE-GPT-M", 8, 2), ("proprophet_lpwnv", "MoE-GPT-DM", 8, 2),
                 ("proprophet_hpwnv", "MoE-GPT-DS", 32, 2)]
        res["deepspeed"] = deepspeed_pre014(sim, cases)
        print("\nSpeed-ups over DeepSpeed-MoE at k=2: padded dropless (v0.14+, the tables' baseline) / "
              "capacity 2 x S / E with drops (before v0.14, cf 1.0)")
        print("| testbed | model | GPUs | FasterMoE | Pro-Prophet |\n|---|---|---|---|---|")
        for tb, m, g, k, v in res["deepspeed"]:
            print(f"| {tb} | {m} | {g} | " + " | ".join(f"{a:.2f} / {b:.2f}x" for a, b in v.values()) + " |")
    if "ratios" in args.parts:
        res["ratios"] = k2_over_k1(sim)
        print("\nk=2 speed-up over the k=1 one, same row and system (published / simulated)")
        print("| table | model | system | published | simulated |\n|---|---|---|---|---|")
        for t, m, s, a, b in res["ratios"]:
            print(f"| {t} | {m} | {s} | {a:.2f} | {b:.2f} |")
    print(f"\n({time.process_time() - t0:.1f} CPU s, load {os.getloadavg()[0]:.2f})", file=sys.stderr)
    return res


if __name__ == "__main__":
    main()
