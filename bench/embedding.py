"""Word-embedding step time and memory: hidden (MoESys) vs vocab (megatron-core) vs replicated.

    python bench/embedding.py                         # 2 ranks on gloo, V=131072, H=256
    python bench/embedding.py --vocab 262144 --hidden 512 --tokens 4096 --reps 7

One step = forward lookup + backward + the gradient communication a training step needs + an SGD
update of the table, on every rank, for the same global batch (``--tokens`` per rank):

- replicated: torch embedding [V, H] on every rank, own tokens; the dense [V, H] gradient is
  all-reduced and averaged, as DDP does.
- vocab: megatron-core VocabParallelEmbedding, rows split over a tensor-parallel group of all
  ranks. Vocab sharding needs identical ids on the group, so every rank looks up the whole global
  batch (world x tokens) and the forward all-reduces the [world*tokens, H] output; no gradient
  all-reduce.
- hidden: HiddenPartitionedEmbedding, columns split over all ranks, own tokens; id all-to-all,
  row all-to-all, gradient all-to-all; no gradient all-reduce.

The modes are interleaved rep by rep (load from other processes on a shared machine hits them
alike). Printed: median step time, embedding param+grad bytes per rank, and both as ratios to
replicated measured in the same run. Outputs are checked against the replicated lookup first.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _bench_rank(rank, world_size, vocab, hidden, tokens, reps, lr=0.1):
    from megatron.core import parallel_state
    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.tensor_parallel import VocabParallelEmbedding

    from megatron_moe.models.embedding import HiddenPartitionedEmbedding

    torch.set_num_threads(1)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world_size)
    full = torch.randn(vocab, hidden, generator=torch.Generator().manual_seed(0)) * 0.02

    rep_w = full.clone().requires_grad_(True)
    cfg = ModelParallelConfig(tensor_model_parallel_size=world_size, use_cpu_initialization=True)
    voc = VocabParallelEmbedding(vocab, hidden, init_method=torch.nn.init.zeros_, config=cfg)
    with torch.no_grad():
        voc.weight.copy_(full[voc.vocab_start_index:voc.vocab_end_index])
    hid = HiddenPartitionedEmbedding(vocab, hidden, group=dist.group.WORLD, full_weight=full)
    del full

    g = torch.Generator().manual_seed(1000 + rank)
    ids = torch.randint(0, vocab, (tokens,), generator=g)
    grad_out = torch.randn(tokens, hidden, generator=g)
    # vocab sharding needs the same ids on the whole group: the global batch
    all_ids = torch.empty(world_size * tokens, dtype=ids.dtype)
    dist.all_gather_into_tensor(all_ids, ids)
    all_grad = torch.empty(world_size * tokens, hidden)
    dist.all_gather_into_tensor(all_grad, grad_out)

    def sgd(w):
        with torch.no_grad():
            w.add_(w.grad, alpha=-lr)
        w.grad = None

    def step_replicated():
        y = F.embedding(ids, rep_w)
        y.backward(grad_out)
        dist.all_reduce(rep_w.grad)  # DDP: sum, then average over DP
        rep_w.grad.div_(world_size)
        sgd(rep_w)
        return y

    def step_vocab():
        y = voc(all_ids)
        # each rank's loss covers its own tokens; the TP group shares one global batch
        y.backward(all_grad / world_size)
        sgd(voc.weight)
        return y

    def step_hidden():
        y = hid(ids)
        y.backward(grad_out / world_size)  # the DP-average scaling DDP applies to the shard
        sgd(hid.weight)
        return y

    # correctness first: identical lookups (before any update)
    with torch.no_grad():
        ok_hidden = torch.equal(hid(ids), F.embedding(ids, rep_w))
        ok_vocab = torch.equal(voc(all_ids)[rank * tokens:(rank + 1) * tokens],
                               F.embedding(ids, rep_w))
    steps = {"replicated": step_replicated, "vocab": step_vocab, "hidden": step_hidden}
    times = {k: [] for k in steps}
    for f in steps.values():
        f()
    for _ in range(reps):
        for k, f in steps.items():
            dist.barrier()
            t0 = time.perf_counter()
            f()
            dist.barrier()
            times[k].append(time.perf_counter() - t0)

    # after identical SGD steps the three tables must still agree
    full_hid = hid.full_weight()
    voc_full = torch.empty(vocab, hidden)
    dist.all_gather_into_tensor(voc_full, voc.weight.detach().contiguous())
    agree = (torch.allclose(full_hid, rep_w.detach(), atol=1e-5)
             and torch.allclose(voc_full, rep_w.detach(), atol=1e-5))

    def mem(w):
        return 2 * w.numel() * w.element_size()  # param + grad (fp32, as measured here)

    return {"time": {k: statistics.median(v) for k, v in times.items()},
            "bytes": {"replicated": mem(rep_w), "vocab": mem(voc.weight),
                      "hidden": mem(hid.weight)},
            "ok": bool(ok_hidden and ok_vocab and agree)}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--vocab", type=int, default=131072)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--tokens", type=int, default=2048, help="tokens per rank per step")
    p.add_argument("--reps", type=int, default=5)
    a = p.parse_args(argv)
    if a.hidden % a.world_size or a.vocab % a.world_size:
        p.error("--hidden and --vocab must be divisible by --world-size")

    from megatron_moe.runtime.local_ranks import run_distributed

    res = run_distributed(_bench_rank, a.world_size, a.vocab, a.hidden, a.tokens, a.reps,
                          timeout_s=900, collective_timeout_s=600)
    if not all(r["ok"] for r in res):
        sys.exit("embedding bench: lookups or updated tables disagree with the replicated one")
    # the slowest rank decides the step
    t = {k: max(r["time"][k] for r in res) for k in res[0]["time"]}
    b = res[0]["bytes"]
    print(f"embedding V={a.vocab} H={a.hidden} tokens/rank={a.tokens} ranks={a.world_size} "
          f"(gloo, CPU; median of {a.reps}); outputs and updated tables checked equal")
    print(f"{'mode':<11} {'step ms':>9} {'MiB/rank':>9} {'time/repl':>10} {'mem/repl':>9}")
    for k in ("replicated", "vocab", "hidden"):
        print(f"{k:<11} {t[k] * 1e3:9.1f} {b[k] / 2**20:9.1f} {t[k] / t['replicated']:10.2f} "
              f"{b[k] / b['replicated']:9.2f}")
    print(f"hidden vs vocab: time {t['hidden'] / t['vocab']:.2f}x, "
          f"memory {b['hidden'] / b['vocab']:.2f}x")


if __name__ == "__main__":
    main()
