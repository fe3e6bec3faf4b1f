#!/usr/bin/env python
"""All-to-all algorithms x compressions vs plain torch.distributed.all_to_all_single, same run.

    python bench/alltoall.py                         # 4 ranks as 2 nodes x 2, 64 KiB..64 MiB
    python bench/alltoall.py --quick                 # 2 sizes, few iterations (smoke run)
    python bench/alltoall.py --world-size 8 --ranks-per-node 4 --sizes 1M,16M --json out.json

Per message size S (fp32 payload bytes each rank sends, itself included; rows of --hidden
floats, equal splits) and per cell algorithm (flat | hierarchical | pipe) x compression
(none | fp16 | bf16 | int8) it prints the median time of one exchange (compress + exchange +
decompress, the busiest rank per iteration, after --warmup), the time relative to the peer
(``all_to_all_single`` on the uncompressed tensor, which is what ``flat``/``none`` calls), and
the bytes this rank puts on intra- and inter-node links: measured by the algorithms themselves
(``comm.count_wire_bytes``) and from the note's formulas (schemoe.md 2.4/2.5/5.3, via
``comm.formula_wire_stats`` on S scaled by the compressor's wire bytes per row). ``bytes==``
says the two agree exactly (bytes and message counts), which must hold for equal splits;
``out ok`` says the output equals the peer's exchange of the (locally round-tripped) input.

A second section runs ``comm.chunked_moe_exchange`` (dispatch -> small expert MLP -> combine)
with overlap degree r = 1, 2, 4 and prints forward and forward+backward time relative to r=1.
``--link-gbps G`` runs that section behind an emulated link of G GB/s per rank
(``--moe-ep-link-gbps``, comm/link.py: a wait that uses no CPU), so on a CPU host the chunks' transfers
can really hide behind the expert compute, as they would on a network; the first section's peer is
a bare ``all_to_all_single`` and stays off the link.

Cells are timed round-robin, iteration by iteration, so load from other jobs on a shared machine
hits them alike. Backend: gloo on CPU (ranks are processes of this host, "nodes" are emulated by
--ranks-per-node), nccl for CUDA tensors when CUDA is available (--backend auto).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from megatron_moe.runtime.local_ranks import free_port, run_distributed  # noqa: E402

ALGORITHMS = ("flat", "hierarchical", "pipe")
COMPRESSIONS = ("none", "fp16", "bf16", "int8")
DEFAULT_SIZES = [(64 << 10) * 4 ** k for k in range(6)]        # 64 KiB, 256 KiB, ... 64 MiB
QUICK_SIZES = [64 << 10, 1 << 20]
PEER = "a2a_single"
_KEYS = ("intra_bytes", "inter_bytes", "intra_msgs", "inter_msgs")


def parse_size(text: str) -> int:
    """'65536', '64K', '64KiB', '1M', '2G' -> bytes (binary units)."""
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(t[-1:], 1)
    num = t[:-1] if mult > 1 else t
    try:
        val = int(float(num) * mult)
    except ValueError:
        raise SystemExit(f"--sizes: cannot read {text!r} (use bytes or 64K / 4M / 1G)") from None
    if val <= 0:
        raise SystemExit(f"--sizes: {text!r} must be > 0")
    return val


def human(n: float) -> str:
    for unit, div in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= div:
            return f"{n / div:g} {unit}"
    return f"{n:g} B"


# ---------------------------------------------------------------------------------------------
# per-rank part (runs in processes spawned by megatron_moe.runtime.local_ranks.run_distributed)


def _setup_backend(rank, world, o):
    """gloo as spawned; for nccl re-initialise with cpu:gloo,cuda:nccl so that the small CPU
    tensors (hierarchical's per-peer counts, our barrier) keep going over gloo."""
    import torch.distributed as dist

    if o["backend"] != "nccl":
        return torch.device("cpu")
    dist.destroy_process_group()
    torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group("cpu:gloo,cuda:nccl", init_method=f"tcp://127.0.0.1:{o['nccl_port']}",
                            rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=o["collective_timeout_s"]))
    return torch.device("cuda", torch.cuda.current_device())


def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _rows_for(size, row_bytes, world):
    rows = size // row_bytes
    rows -= rows % world  # equal splits need a multiple of the group size
    if rows <= 0:
        raise ValueError(f"--sizes: {size} bytes is less than one row ({row_bytes} B, --hidden) "
                         f"per rank of {world}")
    return rows


def _time_round_robin(fns, iters, warmup, dev, barrier):
    """Per callable, ``iters`` wall times of this rank; all ranks start each call together."""
    for f in fns.values():
        for _ in range(warmup):
            f()
    times = {k: [] for k in fns}
    keys = list(fns)
    for it in range(iters):
        # rotate the starting cell so no cell always runs right after the same neighbour
        for k in keys[it % len(keys):] + keys[:it % len(keys)]:
            f = fns[k]
            barrier()
            _sync(dev)
            t0 = time.perf_counter()
            f()
            _sync(dev)
            times[k].append(time.perf_counter() - t0)
    return times


def bench_rank(rank, world, o):
    import torch.distributed as dist

    from megatron_moe import comm
    from megatron_moe.runtime import topology
    from megatron_moe.comm.compress import Compressor, get_compression

    dev = _setup_backend(rank, world, o)
    group = dist.group.WORLD
    rpn = o["ranks_per_node"]
    topology.configure(ranks_per_node=rpn)
    topology.init_hierarchy_groups(group, rpn)  # collective: every rank builds the same groups
    token = torch.zeros(1)

    def barrier():  # a CPU all-reduce: goes over gloo under both backends
        dist.all_reduce(token, group=group)

    dtype = getattr(torch, o["dtype"])
    cols = o["hidden"]
    g = torch.Generator().manual_seed(1234 + rank)
    res = {"sizes": [], "chunked": []}
    for size in o["sizes"]:
        rows = _rows_for(size, cols * torch.empty((), dtype=dtype).element_size(), world)
        x = (torch.randn(rows, cols, generator=g) * 3).to(dtype).to(dev)
        split = [rows // world] * world

        def peer(x=x):
            out = torch.empty_like(x)
            dist.all_to_all_single(out, x, group=group)
            return out

        ref = peer()
        fns, checks = {PEER: peer}, {}
        for algo in o["algorithms"]:
            for cname in o["compressions"]:
                def cell(x=x, algo=algo, cname=cname):
                    return comm.all_to_all(x, split, split, group, algorithm=algo,
                                           ranks_per_node=rpn, compression=cname)

                comp = get_compression(cname)
                used = comp.name != "none" and comp.applies_to(x)
                with comm.count_wire_bytes() as cnt:
                    y = cell()
                # the compressed exchange moves the locally round-tripped rows, nothing else
                want = ref if not used else peer(comp.decompress(comp.compress(x), dtype, cols))
                row_wire = (comp if used else Compressor()).wire_bytes_per_row(cols, dtype)
                formula = comm.formula_wire_stats(algo, rows * row_wire, world, rpn)
                checks[(algo, cname)] = {
                    "measured": dict(cnt), "formula": formula,
                    "bytes_match": all(cnt[k] == formula[k] for k in _KEYS),
                    "output_ok": bool(torch.equal(y, want)), "row_wire_bytes": row_wire}
                fns[f"{algo}/{cname}"] = cell
        del ref, y, want
        times = _time_round_robin(fns, o["iters"], o["warmup"], dev, barrier)
        res["sizes"].append({"size": size, "bytes": rows * cols * x.element_size(), "rows": rows,
                             "times": times, "checks": {f"{a}/{c}": v for (a, c), v in
                                                        checks.items()}})
        del x, fns
    if o["degrees"]:
        from megatron_moe.comm import link

        link.configure(o.get("link_gbps"))
        res["chunked"] = _chunked(rank, world, o, dev, group, rpn, barrier, g)
        res["chunked"]["link"] = link.stats()
        link.configure(None)
    return res


def _chunked(rank, world, o, dev, group, rpn, barrier, g):
    """chunked_moe_exchange with an expert MLP, r = each of --degrees, per chunk algorithm."""
    from megatron_moe import comm

    h, ffn = o["hidden"], o["ffn"]
    T = _rows_for(o["chunk_size"], h * 4, world)
    split = [T // world] * world
    tokens = torch.randn(T, h, generator=g).to(dev)
    w1 = (torch.randn(h, ffn, generator=g) / h ** 0.5).to(dev)
    w2 = (torch.randn(ffn, h, generator=g) / ffn ** 0.5).to(dev)
    up = torch.randn(T, h, generator=g).to(dev)

    def make(algo, r, backward):
        def run():
            x = tokens.detach().requires_grad_(backward)
            a = w1.detach().requires_grad_(backward)
            b = w2.detach().requires_grad_(backward)
            with torch.set_grad_enabled(backward):
                y = comm.chunked_moe_exchange(
                    x, split, split, lambda rows, _s: torch.relu(rows @ a) @ b, group, r,
                    algorithm=algo, ranks_per_node=rpn)
                if backward:
                    (y * up).sum().backward()
            return y.detach()
        return run

    fns, diffs = {}, {}
    for algo in o["chunk_algorithms"]:
        base = make(algo, 1, False)()
        for r in o["degrees"]:
            diffs[f"{algo}/r{r}"] = float((make(algo, r, False)() - base).abs().max())
            fns[f"{algo}/r{r}/fwd"] = make(algo, r, False)
            fns[f"{algo}/r{r}/fwd+bwd"] = make(algo, r, True)
    times = _time_round_robin(fns, o["iters"], o["warmup"], dev, barrier)
    return {"tokens": T, "hidden": h, "ffn": ffn, "times": times, "max_abs_diff_vs_r1": diffs}


# ---------------------------------------------------------------------------------------------
# parent: spawn, reduce over ranks, print


def _critical(per_rank_times):
    """Median over iterations of the slowest rank (an exchange ends when its last rank does)."""
    return statistics.median(max(ts) for ts in zip(*per_rank_times))


def _reduce(out, o):
    world = len(out)
    results = {"config": {k: o[k] for k in ("world_size", "ranks_per_node", "backend", "dtype",
                                            "hidden", "ffn", "iters", "warmup", "chunk_size",
                                            "link_gbps")},
               "cells": [], "peer": [], "chunked": []}
    results["config"]["device"] = o["device"]
    if out[0]["chunked"]:
        results["chunked_link"] = [r["chunked"].get("link", {}) for r in out]
    for si, entry in enumerate(out[0]["sizes"]):
        per = [r["sizes"][si] for r in out]
        peer = _critical([p["times"][PEER] for p in per])
        results["peer"].append({"size_bytes": entry["bytes"], "median_s": peer})
        for key in entry["checks"]:
            algo, cname = key.split("/")
            t = _critical([p["times"][key] for p in per])
            checks = [p["checks"][key] for p in per]
            results["cells"].append({
                "size_bytes": entry["bytes"], "algorithm": algo, "compression": cname,
                "median_s": t, "vs_peer": t / peer,
                "row_wire_bytes": checks[0]["row_wire_bytes"],
                # uniform splits: every rank sends the same, rank 0 stands for all in the table
                "measured": checks[0]["measured"], "formula": checks[0]["formula"],
                "measured_per_rank": [c["measured"] for c in checks],
                "bytes_match": all(c["bytes_match"] for c in checks),
                "output_ok": all(c["output_ok"] for c in checks)})
    if out[0]["chunked"]:
        ch = out[0]["chunked"]
        for key in ch["max_abs_diff_vs_r1"]:
            algo, rr = key.split("/")
            row = {"algorithm": algo, "degree": int(rr[1:]), "tokens_per_rank": ch["tokens"],
                   "max_abs_diff_vs_r1": max(r["chunked"]["max_abs_diff_vs_r1"][key] for r in out)}
            for phase in ("fwd", "fwd+bwd"):
                row[phase + "_s"] = _critical([r["chunked"]["times"][f"{key}/{phase}"]
                                               for r in out])
            results["chunked"].append(row)
        for row in results["chunked"]:
            r1 = next(x for x in results["chunked"]
                      if x["algorithm"] == row["algorithm"] and x["degree"] == 1)
            for phase in ("fwd", "fwd+bwd"):
                row[phase + "_vs_r1"] = row[phase + "_s"] / r1[phase + "_s"]
    results["world_size"] = world
    return results


def _print(results, o):
    c = results["config"]
    P, M = c["world_size"], c["ranks_per_node"]
    print(f"all-to-all: {P} ranks as {P // M} node(s) x {M}, backend {c['backend']} on "
          f"{c['device']}, {c['dtype']} rows of {c['hidden']}, median of {c['iters']} after "
          f"{c['warmup']} warm-up (slowest rank per iteration)")
    hdr = (f"{'size/rank':>10s} {'algorithm':>12s} {'comp':>5s} {'ms':>9s} {'x peer':>7s} "
           f"{'intra B':>10s} {'inter B':>10s} {'msgs i/o':>8s} {'formula intra':>13s} "
           f"{'formula inter':>13s} {'bytes==':>7s} {'out ok':>6s}")
    for peer in results["peer"]:
        size = peer["size_bytes"]
        print("\n" + hdr)
        print(f"{human(size):>10s} {PEER:>12s} {'-':>5s} {peer['median_s'] * 1e3:9.3f} "
              f"{1.0:7.2f}")
        for cell in (x for x in results["cells"] if x["size_bytes"] == size):
            m, f = cell["measured"], cell["formula"]
            print(f"{'':>10s} {cell['algorithm']:>12s} {cell['compression']:>5s} "
                  f"{cell['median_s'] * 1e3:9.3f} {cell['vs_peer']:7.2f} "
                  f"{m['intra_bytes']:10d} {m['inter_bytes']:10d} "
                  f"{m['intra_msgs']:>3d}/{m['inter_msgs']:<4d} {f['intra_bytes']:13.0f} "
                  f"{f['inter_bytes']:13.0f} {str(cell['bytes_match']):>7s} "
                  f"{str(cell['output_ok']):>6s}")
    if results["chunked"]:
        ch = results["chunked"]
        print(f"\nchunked dispatch -> expert MLP ({c['hidden']}x{c['ffn']}, relu) -> combine, "
              f"{ch[0]['tokens_per_rank']} tokens/rank, order schemoe (OptSche)"
              + (f", behind an emulated {c['link_gbps']:g} GB/s link per rank" if c.get("link_gbps") else ""))
        print(f"{'algorithm':>12s} {'r':>3s} {'fwd ms':>9s} {'x r=1':>6s} {'fwd+bwd ms':>11s} "
              f"{'x r=1':>6s} {'max|y-y_r1|':>12s}")
        for row in ch:
            print(f"{row['algorithm']:>12s} {row['degree']:3d} {row['fwd_s'] * 1e3:9.3f} "
                  f"{row['fwd_vs_r1']:6.2f} {row['fwd+bwd_s'] * 1e3:11.3f} "
                  f"{row['fwd+bwd_vs_r1']:6.2f} {row['max_abs_diff_vs_r1']:12.2e}")
    ok = all(x["bytes_match"] for x in results["cells"])
    print(f"\nbytes on the wire equal the formulas in every cell: {ok}")
    if c["backend"] == "gloo":
        print(f"NOTE: CPU/gloo run (host load average {os.getloadavg()[0]:.1f} on "
              f"{os.cpu_count()} CPUs). The ranks are processes of one machine exchanging over "
              "loopback TCP and the 'nodes' are emulated, so absolute times and the ratios "
              "between algorithms mean little for a GPU cluster (no fast intra-node link, no "
              "concurrent NVLink/IB channels for pipe, compression is CPU work); the byte and "
              "message columns hold anywhere.")


def main(argv=None):
    p = argparse.ArgumentParser(prog="alltoall.py", description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default=None,
                   help="comma-separated bytes per rank, e.g. 64K,1M,16M (default: 64 KiB to "
                        "64 MiB in powers of 4)")
    p.add_argument("--quick", action="store_true",
                   help=f"smoke run: sizes {','.join(human(s) for s in QUICK_SIZES)}, 3 "
                        "iterations, 1 warm-up, small chunked section")
    p.add_argument("--world-size", type=int, default=4)
    p.add_argument("--ranks-per-node", type=int, default=2,
                   help="ranks per emulated node (must divide --world-size)")
    p.add_argument("--backend", default="auto", choices=["auto", "gloo", "nccl"],
                   help="auto: nccl when CUDA is available, else gloo")
    p.add_argument("--algorithms", default=",".join(ALGORITHMS))
    p.add_argument("--compressions", default=",".join(COMPRESSIONS))
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--hidden", type=int, default=1024, help="floats per row (token width)")
    p.add_argument("--ffn", type=int, default=256, help="chunked section: expert MLP width")
    p.add_argument("--iters", type=int, default=None, help="timed iterations (default 7; 3 quick)")
    p.add_argument("--warmup", type=int, default=None, help="warm-up calls (default 2; 1 quick)")
    p.add_argument("--degrees", default="1,2,4",
                   help="chunked section: overlap degrees r (1 is the reference; '' skips it)")
    p.add_argument("--chunk-algorithms", default="flat,pipe")
    p.add_argument("--chunk-size", default=None,
                   help="chunked section: bytes of fp32 tokens per rank (default 4M; 256K quick)")
    p.add_argument("--link-gbps", type=float, default=None,
                   help="chunked section behind an emulated link of this bandwidth (GB/s) per rank")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds for the whole run")
    p.add_argument("--json", default=None, help="also write the results here")
    a = p.parse_args(argv)

    if a.world_size < 2:
        raise SystemExit(f"--world-size={a.world_size}: need at least 2 ranks")
    if a.ranks_per_node < 1 or a.world_size % a.ranks_per_node:
        raise SystemExit(f"--ranks-per-node={a.ranks_per_node} must divide --world-size="
                         f"{a.world_size}")
    from megatron_moe.comm import available_algorithms, available_compressions

    algos = [x for x in a.algorithms.split(",") if x]
    comps = [x for x in a.compressions.split(",") if x]
    chunk_algos = [x for x in a.chunk_algorithms.split(",") if x]
    for flag, names, known in (("--algorithms", algos + chunk_algos, available_algorithms()),
                               ("--compressions", comps, available_compressions())):
        bad = sorted(set(names) - set(known))
        if bad:
            raise SystemExit(f"{flag}: unknown {bad}; registered: {known}")
    if a.link_gbps is not None and not a.link_gbps > 0:
        raise SystemExit(f"--link-gbps={a.link_gbps} must be > 0")
    if a.link_gbps is not None and a.backend == "nccl":
        raise SystemExit("--link-gbps emulates a network on gloo (CPU) runs; drop it with --backend nccl")
    degrees = sorted({int(x) for x in a.degrees.split(",") if x})
    if degrees and (degrees[0] < 1 or 1 not in degrees):
        raise SystemExit(f"--degrees={a.degrees}: positive ints including 1 (the reference)")
    backend = a.backend
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl" and torch.cuda.device_count() < 1:
        raise SystemExit("--backend nccl needs CUDA")
    sizes = ([parse_size(s) for s in a.sizes.split(",") if s] if a.sizes
             else QUICK_SIZES if a.quick else DEFAULT_SIZES)
    o = dict(world_size=a.world_size, ranks_per_node=a.ranks_per_node, backend=backend,
             algorithms=algos, compressions=comps, dtype=a.dtype, hidden=a.hidden, ffn=a.ffn,
             sizes=sizes, iters=a.iters or (3 if a.quick else 7),
             warmup=a.warmup if a.warmup is not None else (1 if a.quick else 2),
             degrees=degrees, chunk_algorithms=chunk_algos, link_gbps=a.link_gbps,
             chunk_size=parse_size(a.chunk_size or ("256K" if a.quick else "4M")),
             collective_timeout_s=min(600.0, a.timeout),
             nccl_port=free_port() if backend == "nccl" else None,
             device=(torch.cuda.get_device_name(0) if backend == "nccl" else
                     f"CPU ({os.cpu_count()} cores)"))
    out = run_distributed(bench_rank, a.world_size, o, timeout_s=a.timeout,
                          collective_timeout_s=o["collective_timeout_s"])
    results = _reduce(out, o)
    _print(results, o)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)
    return results


if __name__ == "__main__":
    main()
