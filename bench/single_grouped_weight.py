"""Host work of the expert parameters: ``--moe-grouped-gemm`` with one parameter per expert linear
(SequentialMLP's layout) vs ``--moe-single-grouped-weight`` (one per linear per layer), in one run,
with ratios.

    python bench/single_grouped_weight.py [--experts 16,128] [--repeats 2]

The GPU kit's fine-grained perf shape (megatron_moe/gpucheck/perf.py: 4 MoE layers, top-8, batch 4,
q/k norm; one micro-batch per optimizer step) at toy width (hidden 64, expert FFN 16, sequence 64) on the CPU, 1 rank, bf16, measured by
the perf section's own meter around the real pretrain() loop, with torch's fused Adam as on CUDA.
Per iteration: aten ops dispatched (profiler), Python calls (cProfile), host time under cProfile
(grouped_mm's CPU arithmetic left out: on the CPU it loops over the groups, on CUDA it is one
kernel) and the wall time. On a CPU build every op also runs on the host, so the wall time includes
the model's arithmetic; the ops and calls are what a GPU run keeps (docs/gpu.md: on the H200 the
fine-grained model's device was idle most of the iteration). Variants alternate, ``--repeats``
times.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
VARIANTS = ("per-expert", "single")


def row(variant: str, experts: int) -> dict:
    """One variant's figures (run in its own process: megatron-core's state is per process)."""
    from megatron_moe.compat import optimizer as optimizer_compat
    from megatron_moe.gpucheck import perf

    optimizer_compat.fusable = lambda param: True          # torch's fused Adam, as on CUDA
    shape = dict(perf.SHAPES["finegrained"]["gpu"], hidden=64, heads=8, groups=2, head_dim=16,
                 ffn=16, vocab=512, seq=64, experts=experts,
                 # one micro-batch per step: the host work per parameter is what is measured
                 microbatches=1)
    perf.SHAPES["finegrained"]["cpu"] = shape
    perf.ITERS["cpu"] = dict(warmup=2, timed=5, profiled=1)
    if variant == "per-expert":
        perf.SPEED_CANDIDATES = tuple(g for g in perf.SPEED_CANDIDATES
                                      if g[0][0] != "--moe-single-grouped-weight")
    r = perf.run_row("ours", "finegrained", "cpu")
    grouped_mm_s = sum(s for name, s in r["host_top"] if name.endswith(" grouped_mm"))
    return dict(options=r["options"], params=r["params"], wall_s=r["iter_s"],
                aten_ops=r["aten_ops_per_iter"], calls=r["host_calls_per_iter"],
                host_s=r["host_s_per_iter"] - grouped_mm_s)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--experts", default="16,128")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--row", choices=VARIANTS, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.row:
        print("ROW " + json.dumps(row(args.row, int(args.experts))), flush=True)
        return
    print(f"{'experts':>7} {'variant':>10} {'aten ops/it':>11} {'Python calls/it':>15} "
          f"{'host ms/it':>10} {'wall ms/it':>10}")
    for experts in map(int, args.experts.split(",")):
        got = {v: [] for v in VARIANTS}
        for repeat in range(args.repeats):
            for variant in VARIANTS if repeat % 2 == 0 else VARIANTS[::-1]:
                out = subprocess.run([sys.executable, __file__, "--row", variant, "--experts",
                                      str(experts)], capture_output=True, text=True, timeout=900,
                                     cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT))
                lines = [l for l in out.stdout.splitlines() if l.startswith("ROW ")]
                if out.returncode or not lines:
                    raise SystemExit(f"{variant} at {experts} experts failed:\n{out.stderr[-3000:]}")
                got[variant].append(json.loads(lines[-1][4:]))
        med = {v: {k: statistics.median(r[k] for r in rows) for k in
                   ("aten_ops", "calls", "host_s", "wall_s")} for v, rows in got.items()}
        for v in VARIANTS:
            m = med[v]
            print(f"{experts:7d} {v:>10} {m['aten_ops']:11.0f} {m['calls']:15.0f} "
                  f"{m['host_s'] * 1e3:10.1f} {m['wall_s'] * 1e3:10.1f}")
        a, b = med["per-expert"], med["single"]
        print(f"{experts:7d} {'ratio':>10} {a['aten_ops'] / b['aten_ops']:11.2f} "
              f"{a['calls'] / b['calls']:15.2f} {a['host_s'] / b['host_s']:10.2f} "
              f"{a['wall_s'] / b['wall_s']:10.2f}", flush=True)


if __name__ == "__main__":
    main()
