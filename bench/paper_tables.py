#!/usr/bin/env python
"""The seed papers' published speed-ups beside the simulator's, with the relative error.

Every published cell we can model (``megatron_moe/sim/testbeds/published.json``: Pro-Prophet Tables IV
and V and the Fig. 10 ranges, FasterMoE's headline speed-ups, FlexMoE's speed-up over FasterMoE) is
simulated on its paper's testbed (``testbeds/<paper>_<cluster>.json``) with its paper's model
(``testbeds/models.json``).  Two free constants, the achieved fraction of peak FLOP/s and of link
bandwidth, are fitted on Pro-Prophet's Table IV ONLY (grid search, then a local refinement, on the
mean squared log error); every other table is then predicted with the same two numbers, and the fit
and prediction errors are reported apart.

    python bench/paper_tables.py [--json rows.json] [--iterations 4]
    python bench/paper_tables.py --flops 0.1 --net 0.6      # no fit: given constants

``--json`` writes one row per published cell: paper, table, row, system, published, simulated, fitted
(true for the Table IV cells the constants were fitted on), plus baseline and error.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from megatron_moe.sim.papers import Efficiency, PaperSim, load_published  # noqa: E402

FIT_TABLE = ("proprophet", "Table IV")


def _is_fit(c) -> bool:
    return (c["paper"], c["table"]) == FIT_TABLE


def _is_speedup(r) -> bool:
    return r.get("metric", "speedup") == "speedup"


def _fmt(r, v) -> str:
    """A cell's value in its unit: speed-up (x), absolute iteration time (ms), share of the iteration (%)."""
    m = r.get("metric", "speedup")
    return f"{v:.2f}x" if m == "speedup" else f"{v:.0f} ms" if m == "iteration_ms" else f"{100 * v:.1f}%"


def _loss(sim: PaperSim, cells) -> float:
    return float(np.mean([math.log(sim.cell(c) / c["published"]) ** 2 for c in cells]))


def fit(cells, iterations: int, flops_grid, net_grid, log=print):
    """Grid search over (flops, net) on ``cells``, then a 3x3 refinement around the best point."""
    best = None
    t0 = time.perf_counter()
    for fe, ne in itertools.product(flops_grid, net_grid):
        loss = _loss(PaperSim(Efficiency(fe, ne), iterations), cells)
        if best is None or loss < best[0]:
            best = (loss, fe, ne)
    for step in (1.4, 1.15):
        _, fe0, ne0 = best
        for a, b in itertools.product((1 / step, 1.0, step), repeat=2):
            fe, ne = min(1.0, fe0 * a), min(1.0, ne0 * b)
            loss = _loss(PaperSim(Efficiency(fe, ne), iterations), cells)
            if loss < best[0]:
                best = (loss, fe, ne)
    log(f"[fit on {FIT_TABLE[0]} {FIT_TABLE[1]}: flops {best[1]:.3f} of peak, net {best[2]:.3f} of link "
        f"bandwidth, rms log error {math.sqrt(best[0]):.3f}; {time.perf_counter() - t0:.1f}s]")
    return Efficiency(best[1], best[2])


def order_kept(rows) -> tuple:
    """Rows (same paper/table/row) whose systems keep the published order, counting the baseline
    (speed-up 1.0) as a system: every pair of the row's systems compares the same way."""
    groups = {}
    for r in filter(_is_speedup, rows):       # absolute / share cells have no order of systems
        groups.setdefault((r["paper"], r["table"], r["row"], r["baseline"]), []).append(r)
    kept = total = 0
    for g in groups.values():
        pts = [(1.0, 1.0)] + [(r["published"], r["simulated"]) for r in g]
        if len(pts) < 2:
            continue
        total += 1
        kept += all(np.sign(p1 - p2) == np.sign(s1 - s2) or p1 == p2
                    for (p1, s1), (p2, s2) in itertools.combinations(pts, 2))
    return kept, total


def format_rows(rows) -> str:
    out = []
    for paper in dict.fromkeys(r["paper"] for r in rows):
        out.append(f"\n### {paper}\n")
        out.append("| table | row | system | over | published | simulated | error | fitted |")
        out.append("|---|---|---|---|---|---|---|---|")
        for r in rows:
            if r["paper"] == paper:
                out.append(f"| {r['table']} | {r['row']} | {r['system']} | {r['baseline'] or '-'} | "
                           f"{_fmt(r, r['published'])} | {_fmt(r, r['simulated'])} | {100 * r['error']:+.0f}% | "
                           f"{'yes' if r['fitted'] else 'no'} |")
    return "\n".join(out)


def summary(rows) -> str:
    lines = []
    for label, sel in (("fit (Table IV)", [r for r in rows if r["fitted"]]),
                       ("predicted (all other tables)", [r for r in rows if not r["fitted"] and _is_speedup(r)]),
                       ("absolute / share cells (not speed-ups)", [r for r in rows if not _is_speedup(r)])):
        if not sel:
            continue
        e = np.abs([r["error"] for r in sel])
        kept, total = order_kept(sel)
        lines.append(f"{label}: {len(sel)} cells, median |error| {100 * np.median(e):.0f}%, "
                     f"max {100 * e.max():.0f}%, cells within 35%: {int((e <= 0.35).sum())}/{len(e)}"
                     + (f", rows keeping the published order of systems: {kept}/{total}" if total else ""))
    for paper in dict.fromkeys(r["paper"] for r in rows):
        e = np.abs([r["error"] for r in rows if r["paper"] == paper and not r["fitted"] and _is_speedup(r)])
        if len(e):
            lines.append(f"  predicted {paper}: median |error| {100 * np.median(e):.0f}%, max {100 * e.max():.0f}%")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(prog="bench/paper_tables.py", description=__doc__.split("\n")[0])
    p.add_argument("--iterations", type=int, default=4, help="simulated iterations per run (first is warm-up)")
    p.add_argument("--flops", type=float, default=None, help="skip the fit: achieved fraction of peak FLOP/s")
    p.add_argument("--net", type=float, default=None, help="skip the fit: achieved fraction of link bandwidth")
    p.add_argument("--json", default=None, help="write one row per published cell here")
    p.add_argument("--tables", nargs="+", default=None,
                   help="report only these tables (e.g. 'Table V'); the fit still uses all of Table IV")
    p.add_argument("--flops-grid", type=float, nargs="+", default=list(np.geomspace(0.02, 0.8, 9)),
                   help="fit grid: achieved fractions of peak FLOP/s")
    p.add_argument("--net-grid", type=float, nargs="+", default=[0.1, 0.2, 0.35, 0.5, 0.7, 1.0],
                   help="fit grid: achieved fractions of link bandwidth")
    args = p.parse_args(argv)
    if (args.flops is None) != (args.net is None):
        p.error("--flops and --net go together (both skip the fit)")
    if args.iterations < 2:
        p.error("--iterations must be >= 2 (the first one is a warm-up)")
    t0 = time.perf_counter()
    pub = load_published()
    cells = pub["cells"]
    if args.flops is None:
        eff = fit([c for c in cells if _is_fit(c)], args.iterations,
                  flops_grid=args.flops_grid, net_grid=args.net_grid,
                  log=lambda s: print(s, file=sys.stderr))
    else:
        eff = Efficiency(args.flops, args.net)
    sim = PaperSim(eff, args.iterations)
    if args.tables:
        unknown = set(args.tables) - {c["table"] for c in cells}
        if unknown:
            p.error(f"--tables: unknown {sorted(unknown)}; published.json has {sorted({c['table'] for c in cells})}")
        cells = [c for c in cells if c["table"] in args.tables]
    rows = []
    for c in cells:
        v = sim.cell(c)
        rows.append({"paper": c["paper"], "table": c["table"], "row": c["row"], "system": c["system"],
                     "baseline": c["baseline"], "metric": c.get("metric", "speedup"), "published": float(c["published"]), "simulated": round(v, 4),
                     "error": round(v / c["published"] - 1.0, 4), "fitted": _is_fit(c)})
    print(f"Constants: flops = {eff.flops:.3f} of peak, net = {eff.net:.3f} of link bandwidth "
          f"({'fitted on Pro-Prophet Table IV' if args.flops is None else 'given'}); "
          f"{args.iterations} iterations per run")
    print(format_rows(rows))
    print("\nNot modelled:")
    for c in pub["not_modelled"]:
        print(f"- {c['paper']} {c['table']} {c['system']} over {c['baseline']} ({c['published']}x): {c['reason']}")
    print()
    print(summary(rows))
    print(f"(total {time.perf_counter() - t0:.1f}s)", file=sys.stderr)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
