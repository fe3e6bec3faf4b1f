"""Training tokens/s of the quickstart-size model on 2 gloo ranks: stock megatron-core configuration
vs ours with each feature toggled, all in one run, with ratios vs stock.

    python bench/train_throughput.py [--iters 3] [--repeats 3] [--configs stock,fused,...]

Every configuration is a full training step of the real stack (parse_args -> get_model (DDP) ->
megatron-core's optimizer -> Trainer.train_step: megatron-core's forward_backward schedule, the
balance hooks, the optimizer step) on the quickstart model (examples/train_gpt_moe_cpu.sh: 4 layers,
hidden 128, 8 experts top-2, seq 128, micro-batch 4, global batch 16, EP=2, fp32), random tokens.
All models are built up front in the same two processes and stepped round-robin (the order rotates
every repeat), so load from other jobs on a shared machine hits every configuration alike. The
process-wide choices (args, the kernels' CPU buffer pool) are switched before each configuration's
step; each model's MoE layers carry their own exchange. --ranks-per-node 1: the 2 ranks are 2 emulated
nodes, so the hierarchical and pipe all-to-alls do their two-level exchange. Per configuration:
median over repeats of tokens/s (each repeat = ``--iters`` timed steps), its ratio to stock, and the
share of step time spent inside the dispatcher's permute + unpermute (timed around the calls),
which bounds what a faster permute can gain: at most 1 / (1 - share).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

BASE = ("--num-layers 4 --hidden-size 128 --ffn-hidden-size 512 --num-attention-heads 4 "
        "--seq-length 128 --max-position-embeddings 128 --disable-bias-linear "
        "--hidden-dropout 0.0 --attention-dropout 0.0 --num-experts 8 --moe-ffn-hidden-size 256 "
        "--moe-router-topk 2 --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-2 "
        "--moe-token-dispatcher-type alltoall --micro-batch-size 4 --global-batch-size 16 "
        "--train-iters 1000 --lr 2e-3 --min-lr 2e-4 --lr-decay-style cosine --lr-warmup-iters 10 "
        "--weight-decay 0.1 --clip-grad 1.0 --seed 1234 --expert-model-parallel-size 2 "
        "--distributed-backend gloo --tokenizer-type NullTokenizer --vocab-size 4000 --mock-data "
        "--ranks-per-node 1 --log-interval 1000000 "
        # the training steps alone, as before Megatron's result validation (pretrain()'s default)
        "--rerun-mode disabled")

# name: (extra flags, CPU output-buffer pool on)
CONFIGS = {
    "stock": ("", True),
    "fused permute (pool)": ("--moe-permute-fusion", True),
    "fused permute (no pool)": ("--moe-permute-fusion", False),
    "grouped experts": ("--moe-torch-grouped-gemm", True),
    "a2a hierarchical": ("--moe-a2a-algorithm hierarchical", True),
    "a2a pipe": ("--moe-a2a-algorithm pipe", True),
    "compression fp16": ("--moe-a2a-compression fp16", True),
    "compression bf16": ("--moe-a2a-compression bf16", True),
    "compression int8": ("--moe-a2a-compression int8", True),
    "policy proprophet": ("--moe-balance-policy proprophet", True),
    "policy fastermoe": ("--moe-balance-policy fastermoe", True),
    "policy flexmoe": ("--moe-balance-policy flexmoe", True),
}


class _DispatchTimer:
    """Seconds spent inside the token dispatcher's permute/unpermute (each layer's, timed)."""

    def __init__(self):
        self.seconds = 0.0

    def wrap(self, fn):
        def timed(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.seconds += time.perf_counter() - t0
        timed.__wrapped_by_bench__ = fn
        return timed


def _batches(args, rank):
    import torch

    g = torch.Generator().manual_seed(1000 + rank)
    b, s = args.micro_batch_size, args.seq_length
    pos = torch.arange(s).unsqueeze(0).expand(b, s)
    while True:
        tokens = torch.randint(0, 4000, (b, s), generator=g)
        yield {"tokens": tokens, "labels": torch.roll(tokens, -1, 1),
               "loss_mask": torch.ones(b, s), "position_ids": pos}


def _moe_layers(model):
    from megatron_moe.moe.layer import MoELayer

    return [m for chunk in model for m in chunk.modules() if isinstance(m, MoELayer)]


def _activate(run, timer):
    """Make ``run``'s process-wide choices current (args, buffer pool) and time its layers'
    permute / unpermute (each layer's exchange binds them while its stages run)."""
    from kernels import ops as kops
    from megatron_moe.runtime import global_vars

    global_vars.set_args(run["args"])
    for layer, base in run["permutes"]:
        layer.exchange_scope.names.update({n: timer.wrap(fn) for n, fn in base.items()})
    kops.set_cpu_pool(run["pool"])


def _layer_permutes(model):
    """[(layer, {name: the permute / unpermute its stages run})]: the exchange's, or megatron-core's."""
    from megatron.core.transformer.moe import token_dispatcher as td

    return [(layer, {n: layer.exchange_scope.names.get(n, getattr(td, n))
                     for n in ("permute", "unpermute")}) for layer in _moe_layers(model)]


def bench_rank(rank, world, names, iters, repeats, warmup, profile=()):
    import torch
    import torch.distributed as dist
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    import pretrain_gpt_moe
    from megatron_moe.runtime import global_vars
    from megatron_moe.arguments import parse_args
    from megatron_moe.runtime.initialize import initialize_distributed
    from megatron_moe.models.builder import get_model
    from megatron_moe.training.loop import Trainer, TrainingHooks, _build_tokenizer, _optimizer_config

    torch.set_num_threads(1)            # one core per rank: 2 ranks on the 2 cores
    runs = {}
    # the hierarchical groups are made at initialisation when some algorithm needs them
    first = next((n for n in names if "hierarchical" in CONFIGS[n][0] or "pipe" in CONFIGS[n][0]),
                 names[0])
    for name in [first] + [n for n in names if n != first]:
        flags, pool = CONFIGS[name]
        args = parse_args((BASE + " " + flags).split(), world_size=world, check_data_paths=False)
        global_vars.set_args(args)
        initialize_distributed(args)
        _build_tokenizer(args)
        torch.manual_seed(1234)
        model = get_model(pretrain_gpt_moe.model_provider, args)
        opt = get_megatron_optimizer(_optimizer_config(args, OptimizerConfig), model)
        gbs = args.global_batch_size
        sched = OptimizerParamScheduler(
            opt, init_lr=0.0, max_lr=args.lr, min_lr=args.min_lr,
            lr_warmup_steps=args.lr_warmup_iters * gbs, lr_decay_steps=args.train_iters * gbs,
            lr_decay_style=args.lr_decay_style, start_wd=args.weight_decay,
            end_wd=args.weight_decay, wd_incr_steps=args.train_iters * gbs,
            wd_incr_style="constant")
        hooks = TrainingHooks(args, model, opt)
        trainer = Trainer(args, model, opt, sched, pretrain_gpt_moe.forward_step, hooks)
        runs[name] = dict(args=args, pool=pool, trainer=trainer, hooks=hooks, data=_batches(args, rank),
                          permutes=_layer_permutes(model), rates=[], dispatch_share=[], losses=[])
    tokens_per_step = args.global_batch_size * args.seq_length
    order = list(names)
    for rep in range(warmup + repeats):
        for name in order:
            run = runs[name]
            timer = _DispatchTimer()
            _activate(run, timer)
            it = 1 if rep < warmup else iters
            dist.barrier()
            t0 = time.perf_counter()
            for i in range(it):
                losses, _, _ = run["trainer"].train_step(run["data"])
                run["hooks"].after_step(rep * iters + i)
            dist.barrier()
            dt = time.perf_counter() - t0
            if rep >= warmup:
                run["rates"].append(it * tokens_per_step / dt)
                run["dispatch_share"].append(timer.seconds / dt)
                run["losses"].append(float(next(iter(losses.values()))) if losses else float("nan"))
        order = order[1:] + order[:1]
    out = {n: {k: r[k] for k in ("rates", "dispatch_share", "losses")} for n, r in runs.items()}
    for name in profile:                  # where the time goes: top ops of one step, self CPU time
        run = runs[name]
        _activate(run, _DispatchTimer())
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as torch_profile

        with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
            run["trainer"].train_step(run["data"])
        rows = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
        total = sum(e.self_cpu_time_total for e in rows) or 1
        out[name]["profile"] = [(e.key, e.self_cpu_time_total / total) for e in rows[:12]]
    return out


def main(argv=None):
    p = argparse.ArgumentParser(prog="bench/train_throughput.py", description=__doc__.split("\n")[0])
    p.add_argument("--configs", default=",".join(CONFIGS),
                   help="comma-separated subset of: " + ", ".join(CONFIGS))
    p.add_argument("--iters", type=int, default=3, help="timed training steps per repeat")
    p.add_argument("--repeats", type=int, default=3, help=">= 3; the median is reported")
    p.add_argument("--warmup", type=int, default=2, help="untimed single steps per config first")
    p.add_argument("--timeout", type=int, default=3000)
    p.add_argument("--profile", default="stock,fused permute (no pool)",
                   help="configs whose one extra step is profiled (top ops by self CPU time); "
                        "'' for none")
    a = p.parse_args(argv)
    names = [n.strip() for n in a.configs.split(",") if n.strip()]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        p.error(f"--configs: unknown {unknown}; choose from {list(CONFIGS)}")
    if "stock" not in names:
        names.insert(0, "stock")
    if a.repeats < 3:
        p.error("--repeats must be >= 3 (the median of at least 3 is reported)")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from megatron_moe.runtime.local_ranks import run_distributed

    t0 = time.perf_counter()
    prof = [n.strip() for n in a.profile.split(",") if n.strip() in names]
    per_rank = run_distributed(bench_rank, 2, names, a.iters, a.repeats, a.warmup, prof,
                               timeout_s=a.timeout, collective_timeout_s=600)
    res = per_rank[0]
    print(f"training tokens/s, quickstart model, 2 gloo ranks (EP=2, 2 emulated nodes), 1 thread "
          f"per rank; median of {a.repeats} repeats x {a.iters} steps; {time.perf_counter() - t0:.0f}s "
          f"wall")
    base = statistics.median(res["stock"]["rates"])
    print(f"{'configuration':<26} {'tokens/s':>9} {'vs stock':>9} {'spread':>14} "
          f"{'permute+unpermute share':>24} {'last loss':>9}")
    for n in names:
        r = res[n]
        med = statistics.median(r["rates"])
        share = max(statistics.median(x["dispatch_share"]) for x in (pr[n] for pr in per_rank))
        print(f"{n:<26} {med:9.0f} {med / base:8.2f}x {min(r['rates']):6.0f}-{max(r['rates']):<7.0f} "
              f"{100 * share:23.1f}% {r['losses'][-1]:9.3f}")
    print("(share: time inside the dispatcher's permute + unpermute / step time, the busier rank; "
          "a faster permute gains at most 1 / (1 - share) in tokens/s)")
    for n in prof:
        print(f"\nwhere one '{n}' step's time goes (rank 0, top ops by self CPU time):")
        for key, frac in res[n]["profile"]:
            print(f"  {100 * frac:5.1f}%  {key}")
    return res


if __name__ == "__main__":
    main()
