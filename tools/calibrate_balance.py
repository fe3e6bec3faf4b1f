#!/usr/bin/env python
"""Measure the Pro-Prophet cost-model constants on this machine and write the JSON profile that
``--moe-balance-profile`` reads (the one cost model, ``megatron_moe/balance/cost_model.py``, writes
it with ``save_profile`` and reads it with ``CostModel.from_profile`` in training, tools and simulator).

    python tools/calibrate_balance.py --hidden-size 256 --ffn-hidden-size 1024 --out profile.json

* ``throughput``: expert forward inputs/s (a 2-GEMM GELU MLP of the given shape, one rank's threads);
* ``a2a_bandwidth``: a bandwidth-by-message-size table from timed point-to-point messages between two
  gloo ranks (the backend the layer's all-to-all, Trans and Agg use here), made non-decreasing in the
  message size (``monotone_table``);
* ``trans_bandwidth``: the table's value at one expert's size;
* ``a2a_latency``: the fixed time of one all-to-all round of the balanced layer (tokens and probs,
  two collectives issued together, one row per peer), the median of timed rounds between two gloo
  ranks, each issued as the layer issues it: after the rank's own expert compute, not after a
  barrier, so it includes the wait for the peer. On this shared CPU host that synchronisation is
  ~2.4 ms a round against ~0.25 ms after a barrier; it is what the runtime saves by skipping an
  exchange that crosses no rank, and the bandwidth table's best point-to-point times do not show it;
* ``t_fnec``/``t_bnec``: forward/backward of one dense attention block of the given shape
  (seq x batch tokens), measured; BNEC from a real backward, not 2x.

``--moe-ep-link-gbps G`` writes the profile of training run with the same flag: every transfer then
takes its gloo time plus bytes / G (comm/link.py), so each measured bandwidth b becomes
1 / (1 / b + 1 / G) (``with_link``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _best(fn, reps):
    fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def measure_compute(hidden, ffn, tokens, seq, dtype_name="float32", reps=3):
    import torch

    dtype = getattr(torch, dtype_name)
    w1 = torch.randn(ffn, hidden, dtype=dtype) * 0.02
    w2 = torch.randn(hidden, ffn, dtype=dtype) * 0.02
    x = torch.randn(tokens, hidden, dtype=dtype)
    t_exp = _best(lambda: torch.nn.functional.gelu(x @ w1.t()) @ w2.t(), reps)
    attn = torch.nn.MultiheadAttention(hidden, max(1, hidden // 64), dtype=dtype)
    xs = torch.randn(seq, max(1, tokens // seq), hidden, dtype=dtype, requires_grad=True)

    def fwd():
        return attn(xs, xs, xs, need_weights=False)[0]

    t_f = _best(fwd, reps)

    def fb():
        fwd().sum().backward()

    t_fb = _best(fb, reps)
    return {"throughput": tokens / t_exp, "t_fnec": t_f, "t_bnec": max(t_fb - t_f, 0.0)}


def _bandwidth_rank(rank, world, sizes, reps):
    import torch
    import torch.distributed as dist

    table = []
    for nbytes in sizes:
        buf = torch.zeros(max(1, nbytes // 4), dtype=torch.float32)
        best = float("inf")
        for _ in range(reps + 1):
            dist.barrier()
            t0 = time.perf_counter()
            if rank == 0:
                dist.send(buf, 1)
                dist.recv(buf, 1)
            elif rank == 1:
                dist.recv(buf, 0)
                dist.send(buf, 0)
            best = min(best, (time.perf_counter() - t0) / 2)
        table.append([nbytes, buf.numel() * 4 / best])
    return table


def _latency_rank(rank, world, reps, hidden, ffn, tokens):
    import statistics

    import torch
    import torch.distributed as dist

    x, p = torch.zeros(world, hidden), torch.zeros(world)
    ones = [1] * world
    inp, w1, w2 = torch.randn(tokens, hidden), torch.randn(ffn, hidden) * 0.02, torch.randn(hidden, ffn) * 0.02
    times = []
    for _ in range(reps + 1):
        torch.nn.functional.gelu(inp @ w1.t()) @ w2.t()       # the expert compute before a dispatch
        t0 = time.perf_counter()
        hx = dist.all_to_all_single(torch.empty_like(x), x, ones, ones, async_op=True)
        hp = dist.all_to_all_single(torch.empty_like(p), p, ones, ones, async_op=True)
        hx.wait(); hp.wait()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:]) / (world - 1)      # per peer


def monotone_table(table):
    """``[[bytes, bytes/s], ...]`` by increasing size, each bandwidth raised to the best of the smaller
    sizes: a larger message is never slower per byte on one link, so a lower best-of-N value is
    another process's interference on this shared host (one such row priced a 1 MB Trans at a
    quarter of the 256 KB and 4 MB rates, 4x the real Trans/Agg time, and made auto pick the
    wrong placement in bench/imbalance_training.py)."""
    out, best = [], 0.0
    for nbytes, bw in table:
        best = max(best, bw)
        out.append([nbytes, best])
    return out


def calibrate(hidden, ffn, tokens, seq, sizes=None, reps=3):
    from megatron_moe.runtime.local_ranks import run_distributed

    sizes = sizes or [1 << 14, 1 << 16, 1 << 18, 1 << 20, 1 << 22]
    prof = measure_compute(hidden, ffn, tokens, seq, reps=reps)
    table = monotone_table(run_distributed(_bandwidth_rank, 2, sizes, reps, timeout_s=300)[0])
    prof["a2a_latency"] = max(run_distributed(_latency_rank, 2, 10 * reps + 1, hidden, ffn, tokens, timeout_s=300))
    expert_bytes = 2 * hidden * ffn * 4
    rows = [[m, bw] for m, bw in table[:-1]] + [[None, table[-1][1]]]
    trans = next((bw for m, bw in rows if m is None or expert_bytes <= m), rows[-1][1])
    prof.update({"a2a_bandwidth": rows, "trans_bandwidth": trans, "input_bytes": hidden * 4,
                 "expert_bytes": expert_bytes,
                 "meta": {"hidden": hidden, "ffn": ffn, "tokens": tokens, "seq": seq, "backend": "gloo",
                          "host_cpus": os.cpu_count()}})
    return prof


def with_link(prof: dict, gbps: float) -> dict:
    """The profile of the same ranks behind an emulated link of ``gbps`` GB/s (comm/link.py adds
    bytes / bandwidth to every transfer, so the per-byte times add)."""
    link_bps = gbps * 1e9
    fold = lambda b: 1.0 / (1.0 / b + 1.0 / link_bps)  # noqa: E731
    out = dict(prof, a2a_bandwidth=[[m, fold(b)] for m, b in prof["a2a_bandwidth"]],
               trans_bandwidth=fold(prof["trans_bandwidth"]))
    out["meta"] = dict(prof.get("meta", {}), ep_link_gbps=gbps)
    return out


def main(argv=None):
    p = argparse.ArgumentParser(prog="calibrate_balance.py", description=__doc__.splitlines()[0])
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--ffn-hidden-size", type=int, default=1024)
    p.add_argument("--tokens", type=int, default=1024, help="tokens per expert GEMM timing")
    p.add_argument("--seq-length", type=int, default=128)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--moe-ep-link-gbps", type=float, default=None,
                   help="the training run's emulated link (GB/s): fold it into the bandwidths")
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    if a.moe_ep_link_gbps is not None and not a.moe_ep_link_gbps > 0:
        p.error(f"--moe-ep-link-gbps must be > 0 (got {a.moe_ep_link_gbps})")
    from megatron_moe.balance.cost_model import save_profile

    prof = calibrate(a.hidden_size, a.ffn_hidden_size, a.tokens, a.seq_length, reps=a.reps)
    if a.moe_ep_link_gbps is not None:
        prof = with_link(prof, a.moe_ep_link_gbps)
    prof = save_profile(a.out, prof)
    print(json.dumps(prof))
    return prof


if __name__ == "__main__":
    main()
