"""Token dispatch/combine throughput: ours (kernels.permute/unpermute) vs megatron-core's
moe_utils.permute/unpermute (fused=False) on the same inputs, in the same run.

    python bench/dispatch.py                 # CPU, scaled-down token counts
    python bench/dispatch.py --tokens 4096 --dtype float32 --reps 9

Per shape it prints, for permute, unpermute+combine and the permute->unpermute round trip
forward+backward (as in training): median time, GB/s moved (minimum
bytes: permute reads T*h elements and writes N*h, unpermute reads N*h and writes T*h), tokens/s,
ours/mcore speed ratio, and the fraction of the machine's copy bandwidth (a large tensor copy_
measured in this run).  "ours(no pool)" is our CPU path with the output-buffer pool disabled; the
summary gives both ratios.  The calls are the ones megatron-core's dispatchers make: permute with
probs (the permuted probs go to the experts, which apply them), unpermute WITHOUT probs (its
alltoall/allgather/flex dispatchers never pass them), routing_map given.  On CUDA it also times megatron-core's fused
(Transformer Engine) permute when TE is installed.  Outputs are checked for equality first.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import kernels  # noqa: E402
from kernels import ops as kops  # noqa: E402

SHAPES = {
    # name: (hidden, experts, topk, default CPU tokens)
    "mixtral": (4096, 8, 2, 2048),
    "deepseek": (7168, 64, 8, 512),
}


def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


def timeit(fns, reps, dev):
    """(best, median) seconds of each callable.  The callables are interleaved rep by rep so
    that load from other processes on a shared machine hits all of them alike; ratios use the
    best time, the usual estimate of unloaded speed, the median is printed alongside."""
    times = {k: [] for k in fns}
    for f in fns.values():  # warm-up (also fills our buffer pool)
        f()
        f()
    _sync(dev)
    for _ in range(reps):
        for k, f in fns.items():
            _sync(dev)
            t0 = time.perf_counter()
            out = f()
            _sync(dev)
            times[k].append(time.perf_counter() - t0)
            del out
    return {k: (min(v), statistics.median(v)) for k, v in times.items()}


def copy_bandwidth(dev, nbytes, reps):
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=dev).uniform_()
    dst = torch.empty_like(src)
    t = timeit({"copy": lambda: dst.copy_(src)}, reps, dev)["copy"][0]
    return 2 * nbytes / t  # read + write


def make_inputs(T, h, E, k, dtype, pdtype, dev, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    tokens = torch.randn(T, h, generator=g).to(dtype).to(dev)
    logits = torch.randn(T, E, generator=g)
    p, idx = torch.topk(torch.softmax(logits, -1), k, dim=-1)
    routing_map = torch.zeros(T, E, dtype=torch.bool).scatter_(1, idx, True).to(dev)
    probs = torch.zeros(T, E).scatter_(1, idx, p).to(pdtype).to(dev)
    return tokens, routing_map, probs, idx.to(dev), p.to(pdtype).to(dev)


def bench_shape(name, T, h, E, k, dtype, pdtype, dev, reps, bw, te_ok):
    from megatron.core.transformer.moe import moe_utils as mu

    tokens, rmap, probs, idx, topk_p = make_inputs(T, h, E, k, dtype, pdtype, dev)
    N = T * k
    es = tokens.element_size()

    # correctness first: identical outputs on the same inputs
    a = mu.permute(tokens, rmap, probs=probs, num_out_tokens=N)
    b = kernels.permute(tokens, rmap, probs=probs, num_out_tokens=N)
    same_p = all(torch.equal(x, y) for x, y in zip(a, b))
    expert_out = torch.randn(N, h, generator=torch.Generator().manual_seed(1)).to(dtype).to(dev)
    sidx = a[2]
    u = mu.unpermute(expert_out, sidx, tokens.shape, routing_map=rmap)
    v = kernels.unpermute(expert_out, sidx, tokens.shape, routing_map=rmap)
    same_u = torch.equal(u, v)
    del a, b, u, v

    perm = {
        "mcore": lambda: mu.permute(tokens, rmap, probs=probs, num_out_tokens=N),
        "ours": lambda: kernels.permute(tokens, rmap, probs=probs, num_out_tokens=N),
        "ours(top-k api)": lambda: kernels.permute_tokens(
            tokens, kernels.routing_layout(idx, E), topk_p),
    }
    # no probs: megatron-core's dispatchers apply them in the experts, never in unpermute
    unperm = {
        "mcore": lambda: mu.unpermute(expert_out, sidx, tokens.shape, routing_map=rmap),
        "ours": lambda: kernels.unpermute(expert_out, sidx, tokens.shape, routing_map=rmap),
    }
    layout = kernels.routing_layout(idx, E)
    unperm["ours(top-k api)"] = lambda: kernels.unpermute_tokens(expert_out, layout)
    if dev.type == "cpu":
        def nopool(f):
            def g():
                kops.set_cpu_pool(False)
                try:
                    return f()
                finally:
                    kops.set_cpu_pool(True)
            return g
        perm["ours(no pool)"] = nopool(perm["ours"])
        unperm["ours(no pool)"] = nopool(unperm["ours"])
    if te_ok:
        perm["mcore fused(TE)"] = lambda: mu.permute(tokens, rmap, probs=probs, num_out_tokens=N,
                                                     fused=True)
        unperm["mcore fused(TE)"] = lambda: mu.unpermute(expert_out, sidx, tokens.shape,
                                                         routing_map=rmap, fused=True)

    grad_out = torch.randn(T, h, generator=torch.Generator().manual_seed(2)).to(dtype).to(dev)

    def roundtrip(perm_fn, unperm_fn):
        def f():
            a = tokens.detach().requires_grad_()
            b = probs.detach().requires_grad_()
            xp, pp, si = perm_fn(a, rmap, probs=b, num_out_tokens=N)
            y = xp * pp.unsqueeze(-1).to(xp.dtype)     # the experts apply the permuted probs
            unperm_fn(y, si, a.shape, routing_map=rmap).backward(grad_out)
            return a.grad, b.grad
        return f

    rt = {"mcore": roundtrip(mu.permute, mu.unpermute),
          "ours": roundtrip(kernels.permute, kernels.unpermute)}
    if dev.type == "cpu":
        rt["ours(no pool)"] = nopool(rt["ours"])
    ga, gb = rt["mcore"](), rt["ours"]()
    same_g = torch.equal(ga[0], gb[0]) and torch.allclose(ga[1], gb[1], rtol=1e-4, atol=1e-4)
    del ga, gb

    print(f"\n== {name}: tokens={T} hidden={h} experts={E} top-{k} dtype={dtype} "
          f"probs={pdtype}  [equal to mcore: permute={same_p} unpermute={same_u} grads={same_g}]")
    ratios = {}
    # minimum DRAM traffic: each distinct row read once, each output row written once
    # (permute: read T rows, write N; combine: read N, write T; round trip: both, twice)
    for op, fns, nbytes in (("permute", perm, (T + N) * h * es),
                            ("unpermute+combine", unperm, (N + T) * h * es),
                            ("permute->unpermute fwd+bwd", rt, 4 * (N + T) * h * es)):
        t = timeit(fns, reps, dev)
        base = t["mcore"][0]
        print(f"  {op}:  (best of {reps}; median in brackets)")
        for k_, (s, med) in t.items():
            gbs = nbytes / s / 1e9
            print(f"    {k_:18s} {s * 1e3:8.2f} ms [{med * 1e3:8.2f}]  {gbs:7.2f} GB/s  "
                  f"{T / s / 1e6:7.3f} Mtok/s  x{base / s:5.2f} vs mcore  "
                  f"{100 * nbytes / s / bw:5.1f}% of copy bw")
        sys.stdout.flush()
        ratios[op] = base / t["ours"][0]
        if "ours(no pool)" in t:
            ratios[op + " (no pool)"] = base / t["ours(no pool)"][0]
    return ratios


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--shapes", default="mixtral,deepseek")
    ap.add_argument("--tokens", type=int, default=None, help="override token count for all shapes")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--probs-dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch intra-op threads (CPU); 1 avoids OpenMP barrier stalls when the "
                         "cores are shared with other jobs")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    dev = torch.device(args.device)
    dtype, pdtype = getattr(torch, args.dtype), getattr(torch, args.probs_dtype)
    try:
        from megatron.core.transformer.moe import moe_utils as mu
        te_ok = dev.type == "cuda" and mu.HAVE_TE and mu.fused_permute is not None
    except Exception:
        te_ok = False
    bw = copy_bandwidth(dev, 512 << 20 if dev.type == "cuda" else 256 << 20, args.reps)
    backend = kernels.get_backend(torch.empty(0, device=dev))
    print(f"device={dev} threads={torch.get_num_threads()} backend={backend} "
          f"copy bandwidth (read+write) = {bw / 1e9:.2f} GB/s  TE fused permute: {te_ok}")
    summary = {}
    for name in args.shapes.split(","):
        h, E, k, T = SHAPES[name]
        if dev.type == "cuda" and args.tokens is None:
            T *= 8
        summary[name] = bench_shape(name, args.tokens or T, h, E, k, dtype, pdtype, dev,
                                    args.reps, bw, te_ok)
    print("\nsummary (ours speed / mcore speed):")
    for name, r in summary.items():
        print("  " + name + ": " + "  ".join(f"{op} x{v:.2f}" for op, v in r.items()))


if __name__ == "__main__":
    main()
