"""Spawned-rank body for bench/policies.py part (a): real 2-rank (gloo) training throughput of a
small GPT-MoE under skewed routing, per balancing policy, all measured in one run."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

import megatron_moe.balance.policies.fastermoe  # noqa: F401  (registers "fastermoe")
import megatron_moe.balance.policies.flexmoe  # noqa: F401  (registers "flexmoe")


def _build(hidden, ffn, experts, seq, topk, skew, seed=1234):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig

    from megatron_moe.balance import install
    from tests._balance_cases import _args

    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    cfg = TransformerConfig(num_layers=2, hidden_size=hidden, num_attention_heads=4, ffn_hidden_size=ffn,
                            num_moe_experts=experts, moe_router_topk=topk, moe_token_dispatcher_type="alltoall",
                            moe_aux_loss_coeff=0.0, expert_model_parallel_size=dist.get_world_size(),
                            use_cpu_initialization=True, add_bias_linear=False, hidden_dropout=0.0,
                            attention_dropout=0.0, moe_grouped_gemm=False)
    spec = install(_args(), get_gpt_layer_local_spec(num_experts=experts), force=True)
    model = GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=256, max_sequence_length=seq)
    if skew:
        # skewed router: zero logits tie every token, and top-k takes the lowest expert ids, so all
        # inputs go to experts 0..k-1 (rank 0's); frozen so the skew stays put over iterations
        for n, p in model.named_parameters():
            if "router" in n and n.endswith("weight"):
                with torch.no_grad():
                    p.zero_()
                p.requires_grad_(False)
    return model


def throughput_rank(rank, world, policies, iters=6, warmup=2, hidden=128, ffn=512, experts=4, seq=128,
                    mbs=4, topk=2, skew=True, trace_dir=None, profile=None, link_gbps=None):
    """All policies' models are built up front and stepped round-robin (rotating order every
    iteration), so machine-load drift on the shared CPU hits every policy alike. A policy name
    ending in ``+overlap`` runs with ``--moe-balance-overlap``; ``link_gbps``: every MoE transfer
    behind the emulated link (comm/link.py)."""
    from megatron.core import parallel_state as ps

    from megatron_moe.balance import BalanceManager
    from megatron_moe.comm import link
    from tests._balance_cases import _args

    link.configure(link_gbps)

    # one intra-op thread per rank: each rank is one "device" (a core); otherwise an idle rank's core
    # speeds up the busy rank and balancing cannot show on a 2-core machine
    torch.set_num_threads(1)
    ps.initialize_model_parallel(expert_model_parallel_size=world)
    runs = {}
    for pol in policies:
        model = _build(hidden, ffn, experts, seq, topk, skew)
        tdir = trace_dir if (trace_dir and pol == "none") else None     # the real routing, for the simulator
        mgr = BalanceManager(_args(moe_balance_policy=pol.removesuffix("+overlap"), moe_routing_trace_dir=tdir,
                                   moe_balance_overlap=pol.endswith("+overlap"), moe_balance_profile=profile),
                             [model], num_microbatches=1)
        opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-4)
        runs[pol] = dict(model=model, mgr=mgr, opt=opt, times=[], replicated=0)
    g = torch.Generator().manual_seed(rank)
    pos = torch.arange(seq).unsqueeze(0).expand(mbs, seq)
    mask = torch.tril(torch.ones(seq, seq, dtype=torch.bool)).logical_not().view(1, 1, seq, seq)
    for it in range(warmup + iters):
        tokens = torch.randint(0, 256, (mbs, seq), generator=g)
        labels = torch.randint(0, 256, (mbs, seq), generator=g)
        order = policies[it % len(policies):] + policies[:it % len(policies)]
        for pol in order:
            r = runs[pol]
            model, mgr, opt = r["model"], r["mgr"], r["opt"]
            dist.barrier()
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=False)
            loss = model(tokens, pos, mask, labels=labels).mean()
            loss.backward()
            mgr.before_finalize_grads()
            for p in model.parameters():
                if p.grad is not None and getattr(p, "allreduce", True) is not False:
                    dist.all_reduce(p.grad)
                    p.grad /= world
            opt.step()
            mgr.after_step(it)
            dist.barrier()
            if it >= warmup:
                r["times"].append(time.perf_counter() - t0)
                r["replicated"] += sum(len(m.balance.placement.replicated()) for m in mgr.layers)
    out = {}
    for pol, r in runs.items():
        ts = r["times"]
        out[pol] = dict(tokens_per_s=world * mbs * seq * len(ts) / sum(ts), iter_s=sorted(ts)[len(ts) // 2],
                        replicated=r["replicated"] / max(1, len(ts)))
    return out


def calibrate_rank(rank, world, hidden=128, ffn=512, inputs=1024, reps=7):
    """Micro-benchmarks on the 2 gloo ranks, run concurrently as in training: the MoE layer's
    forward+backward seconds per input, all-to-all and broadcast bandwidth (bytes/s) and the
    all-to-all's per-message latency (seconds, from a one-row exchange)."""

    def med(fn):
        ts = []
        for _ in range(reps):
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        return sorted(ts)[len(ts) // 2]

    torch.set_num_threads(1)               # as in throughput_rank
    torch.manual_seed(rank)
    # forward + backward of the model's own MoE layer (router, token shuffling, experts,
    # combine: everything whose cost grows with the inputs a rank computes), with EP = 1 so that
    # each rank computes all of its inputs itself; per input = the slope between two batch sizes
    from megatron.core import parallel_state as ps
    ps.initialize_model_parallel(expert_model_parallel_size=1)
    moe = _build(hidden, ffn, 2 * world, 128, 2, skew=False).decoder.layers[0].mlp

    def moe_fwd_bwd(tokens):
        h = torch.randn(tokens, 1, hidden, requires_grad=True)
        return lambda: moe(h)[0].sum().backward()

    t_small, t_large = med(moe_fwd_bwd(inputs // 2)), med(moe_fwd_bwd(inputs))
    t_fwd_bwd = (t_large - t_small) / inputs        # top-2: inputs // 2 more tokens = inputs more inputs
    ps.destroy_model_parallel()
    buf = torch.randn(4 * inputs, hidden)
    out = torch.empty_like(buf)
    t_a2a = med(lambda: dist.all_to_all_single(out, buf))
    tiny, tiny_out = torch.randn(world, 1), torch.empty(world, 1)
    t_lat = med(lambda: dist.all_to_all_single(tiny_out, tiny))
    params = torch.randn(2 * hidden * ffn)
    t_bc = med(lambda: dist.broadcast(params, 0))
    a2a_bytes = buf.numel() * 4 * (world - 1) / world          # what leaves each rank
    return dict(fwd_bwd_s_per_input=t_fwd_bwd,
                a2a_bw=a2a_bytes / max(t_a2a - t_lat, 0.25 * t_a2a),   # guard: noisy difference
                a2a_lat=t_lat / max(1, world - 1),
                bcast_bw=params.numel() * 4 / t_bc)
