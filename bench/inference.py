"""Ring-memory inference vs all-resident, same run: tokens/s, device bytes, hidden copy fraction.

    python bench/inference.py                          # CPU: a random 8-layer GPT-MoE, 1 process
    python bench/inference.py --layers 8 --hidden 256 --batch 8 --decode 32 --repeats 3

For K = 0 (resident), 1, 2 and N/2 slots and a set of emulated link bandwidths it generates the
same greedy batch and prints tokens/s, the ratio to resident (measured in the same run: each
ring run paired with a resident run just before it, median ratio over --repeats pairs), the peak
device bytes of the transformer layers' weights (resident: all N layers; ring: the K-slot arena)
and its ratio, the hidden copy fraction
(1 - exposed wait / copy time), and the moesys.md 2.10 timing model's prediction
(the cost model's RingMemoryCost: per layer max(t_compute, t_copy, (t_compute + t_copy) / K) with
t_copy = layer bytes / bandwidth; the link "keeps up" when that equals t_compute).
Bandwidths default to multiples of the one where t_copy == t_compute (measured t_compute), so the
sweep straddles the point where the link keeps up on any machine. Outputs are checked to be
token-identical to resident first.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("TQDM_DISABLE", "1")  # the static engine's per-batch progress bar


def build(args):
    """A random GPT-MoE on one gloo rank, and a TextGenerator over it."""
    import torch
    import torch.distributed as dist

    from megatron_moe.compat import install_megatron_core_stubs, quiet_known_warnings

    quiet_known_warnings()
    install_megatron_core_stubs()
    from megatron_moe.runtime import global_vars
    from megatron_moe.arguments import parse_args
    from megatron_moe.inference.engine import TextGenerator
    from megatron_moe.runtime.initialize import initialize_distributed
    from megatron_moe.models.builder import gpt_model_provider
    from megatron_moe.runtime.local_ranks import free_port
    from megatron_moe.training.loop import _build_tokenizer

    seq = args.prompt + args.decode
    argv = (f"--num-layers {args.layers} --hidden-size {args.hidden} --num-attention-heads 8 "
            f"--seq-length {seq} --max-position-embeddings {seq} --micro-batch-size 1 "
            f"--num-experts {args.experts} --moe-router-topk 2 --moe-ffn-hidden-size {args.ffn} "
            f"--moe-token-dispatcher-type alltoall --disable-bias-linear --train-iters 1 --lr 0 "
            f"--mock-data --tokenizer-type NullTokenizer --vocab-size {args.vocab} "
            f"--hidden-dropout 0 --attention-dropout 0 --distributed-backend gloo").split()
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    if not dist.is_initialized():
        dist.init_process_group("gloo", rank=0, world_size=1,
                                init_method=f"tcp://127.0.0.1:{os.environ['MASTER_PORT']}",
                                timeout=datetime.timedelta(minutes=10))
    margs = parse_args(argv, world_size=1)
    margs.inference_max_requests = args.batch
    margs.inference_max_seq_length = seq
    global_vars.set_args(margs)
    initialize_distributed(margs)
    tokenizer = _build_tokenizer(margs)
    torch.manual_seed(0)
    model = gpt_model_provider(margs).eval()
    gen = TextGenerator(model, tokenizer, margs)
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(1, args.vocab - 1, (args.batch, args.prompt), generator=g).tolist()
    return model, gen, prompts


def run_once(gen, prompts, decode):
    t0 = time.perf_counter()
    out = gen.generate(None, tokens_to_generate=decode, prompt_tokens=prompts)
    dt = time.perf_counter() - t0
    return out, dt, sum(len(r.tokens) for r in out)


def _mem(row, n):
    return f"{row['k']}/{n}={row['mem_ratio']:.2f}"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--ffn", type=int, default=512, help="expert FFN hidden size")
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--batch", type=int, default=8, help="prompts decoded together")
    p.add_argument("--prompt", type=int, default=32, help="prompt tokens")
    p.add_argument("--decode", type=int, default=16, help="tokens generated per prompt")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--slots", type=int, nargs="*", default=None,
                   help="K values (default: 1 2 N/2)")
    p.add_argument("--link-gbps", type=float, nargs="*", default=None,
                   help="emulated link bandwidths (default: 0.5x, 2x, 8x the break-even one)")
    args = p.parse_args(argv)

    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    from megatron_moe.balance.cost_model import RingMemoryCost
    from megatron_moe.inference.ring_memory import RingMemory, transformer_layers

    model, gen, prompts = build(args)
    n = args.layers
    slots = args.slots or sorted({1, 2, max(1, n // 2)})
    layer_bytes = [sum(p.numel() * p.element_size() for p in l.parameters())
                   for l in transformer_layers(model)]
    resident_layer_bytes = sum(layer_bytes)

    reference, _, _ = run_once(gen, prompts, args.decode)  # warm-up and the reference output
    ref_tokens = [r.tokens for r in reference]
    resident_times = []
    for _ in range(args.repeats):
        _, dt, ntok = run_once(gen, prompts, args.decode)
        resident_times.append(dt)
    resident_s = min(resident_times)
    forwards = args.decode  # one prefill + (decode - 1) decode steps
    t_compute = resident_s / (forwards * n)  # per layer per forward, all-resident
    break_even = max(layer_bytes) / t_compute / 1e9
    bandwidths = args.link_gbps or [round(break_even * f, 4) for f in (0.5, 2.0, 8.0)]
    tokens = sum(len(t) for t in ref_tokens)
    print(f"model: {n} layers, hidden {args.hidden}, {args.experts} experts (ffn {args.ffn}); "
          f"layer weights {max(layer_bytes) / 2**20:.2f} MiB each, {resident_layer_bytes / 2**20:.2f} "
          f"MiB in all; batch {args.batch} x ({args.prompt} prompt + {args.decode} generated)")
    print(f"resident: {tokens / resident_s:.1f} tokens/s (best of {args.repeats}, median "
          f"{tokens / statistics.median(resident_times):.1f}); t_compute per layer "
          f"{t_compute * 1e3:.3f} ms; break-even link {break_even:.3f} GB/s")
    header = (f"{'K':>3} {'link GB/s':>10} {'tokens/s':>9} {'x resident':>10} {'model x':>8} "
              f"{'keeps up':>8} {'device MiB':>10} {'x resident':>10} {'hidden':>7}")
    print(header)
    print(f"{0:>3} {'-':>10} {tokens / resident_s:9.1f} {1.0:10.2f} {1.0:8.2f} {'-':>8} "
          f"{resident_layer_bytes / 2**20:10.2f} {1.0:10.2f} {'-':>7}")
    rows = []
    for gbps in bandwidths:
        for k in slots:
            cost = RingMemoryCost(layer_bytes=max(layer_bytes), link_bandwidth=gbps * 1e9,
                                  layer_forward_s=t_compute, slots=k, num_layers=n)
            predicted, keeps_up = cost.ratio(), cost.keeps_up()
            ratios, times, stats = [], [], None
            for _ in range(args.repeats):
                # each ring run is paired with a resident run right before it: load from other
                # processes hits both alike; the ratio is the median over pairs
                _, dt_res, _ = run_once(gen, prompts, args.decode)
                resident_times.append(dt_res)
                ring = RingMemory(model, slots=k, link_gbps=gbps)
                out, dt, _ = run_once(gen, prompts, args.decode)
                stats = ring.stats()
                ring.close()
                if [r.tokens for r in out] != ref_tokens:
                    raise SystemExit(f"K={k} at {gbps} GB/s: tokens differ from resident")
                times.append(dt)
                ratios.append(dt_res / dt)
            ratio = statistics.median(ratios)
            mem = stats["peak_device_bytes"]
            rows.append(dict(k=k, gbps=gbps, ratio=ratio, predicted=predicted, keeps_up=keeps_up,
                             mem_ratio=mem / resident_layer_bytes, hidden=stats["hidden_fraction"]))
            print(f"{k:>3} {gbps:10.3f} {tokens / min(times):9.1f} {ratio:10.2f} {predicted:8.2f} "
                  f"{'yes' if keeps_up else 'no':>8} {mem / 2**20:10.2f} "
                  f"{mem / resident_layer_bytes:10.2f} {stats['hidden_fraction']:7.0%}")
    kept = [r for r in rows if r["keeps_up"]]
    if kept:
        print(f"where the model says the link keeps up: tokens/s x resident min "
              f"{min(r['ratio'] for r in kept):.2f}, median "
              f"{statistics.median(r['ratio'] for r in kept):.2f}; device layer memory "
              f"x resident = K/N ({', '.join(_mem(r, n) for r in kept[:len(slots)])})")
    return rows


if __name__ == "__main__":
    main()
