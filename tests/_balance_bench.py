"""Spawned-rank body of bench/imbalance_training.py (2 ranks, EP=2, gloo)."""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist

CONFIGS = ("stock", "none", "fastermoe", "proprophet", "proprophet+overlap", "flexmoe", "auto", "auto+overlap",
           "forced")
# configs that run our balanced layer, and the --moe-balance-policy each sets (flexmoe runs transient
# replicas here: persistent ones need the megatron-core optimizer, this loop steps torch Adam)
BALANCED = {"none": "none", "fastermoe": "fastermoe", "proprophet": "proprophet", "proprophet+overlap": "proprophet",
            "flexmoe": "flexmoe", "auto": "auto", "auto+overlap": "auto"}


def _skew(model, skew):
    """Documented skew option: router logits += -skew * expert_id (expert 0 hottest)."""
    from megatron.core.transformer.moe.router import TopKRouter

    for m in model.modules():
        if isinstance(m, TopKRouter):
            bias = -skew * torch.arange(m.weight.shape[0], dtype=torch.float32)
            orig = m.gating
            m.gating = lambda inp, orig=orig, bias=bias: orig(inp) + bias.to(inp.dtype)


def _build(name, o):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig

    from megatron_moe.balance import BalanceManager, add_arguments, install

    torch.manual_seed(1)
    model_parallel_cuda_manual_seed(1)
    cfg = TransformerConfig(num_layers=o["layers"], hidden_size=o["hidden"], num_attention_heads=4,
                            ffn_hidden_size=o["ffn"], num_moe_experts=o["experts"], moe_router_topk=o["topk"],
                            moe_router_pre_softmax=o["topk"] == 1,
                            moe_token_dispatcher_type="alltoall", moe_aux_loss_coeff=0.0,
                            moe_router_force_load_balancing=name == "forced",
                            expert_model_parallel_size=dist.get_world_size(), use_cpu_initialization=True,
                            add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0)
    spec = get_gpt_layer_local_spec(num_experts=o["experts"])
    mgr = None
    args = add_arguments(argparse.ArgumentParser()).parse_args([])
    args.num_experts, args.moe_ep_link_gbps = o["experts"], o.get("link_gbps")
    if args.moe_ep_link_gbps is not None:   # megatron-core's dispatcher sends through comm/ too
        from megatron_moe.moe import dispatcher

        spec = dispatcher.customize_spec(args, spec)
    if name in BALANCED:
        args.moe_balance_policy = BALANCED[name]
        args.moe_balance_overlap = name.endswith("overlap")
        args.moe_balance_profile = o["profile"]
        args.moe_balance_alpha = o["alpha"]
        spec = install(args, spec, force=True)
    model = GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=256, max_sequence_length=o["seq"])
    if name in BALANCED:
        mgr = BalanceManager(args, [model], num_microbatches=1)
    if name != "forced" and o["skew"]:
        _skew(model, o["skew"])
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    return model, opt, mgr


def _average_dense_grads(model, world):
    """Dense grads averaged over the data-parallel ranks in one all-reduce of their flattened copy, as
    megatron-core DDP reduces its contiguous grad buffer per bucket (this model fits one bucket);
    expert grads (``allreduce=False``) stay local (expert-DP size 1)."""
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

    grads = [p.grad for p in model.parameters() if p.grad is not None and getattr(p, "allreduce", True)]
    flat = _flatten_dense_tensors(grads)
    dist.all_reduce(flat)
    flat /= world
    for g, f in zip(grads, _unflatten_dense_tensors(flat, grads)):
        g.copy_(f)


def _use_link(o):
    """Every config's MoE transfers behind the emulated link (comm/link.py): ours go through comm/,
    megatron-core's dispatcher sends through comm's all-to-all inside our layer (_build), as training
    does with the flag."""
    from megatron_moe.comm import link

    link.configure(o["link_gbps"])


def bench_rank(rank, world, o):
    from megatron.core import parallel_state as ps

    from megatron_moe.comm import link

    ps.initialize_model_parallel(expert_model_parallel_size=world)
    if o.get("link_gbps") is not None:
        _use_link(o)
    torch.manual_seed(100 + rank)
    seq, mbs = o["seq"], o["mbs"]
    tokens = torch.randint(0, 256, (mbs, seq))
    labels = torch.randint(0, 256, (mbs, seq))
    pos = torch.arange(seq).unsqueeze(0).expand(mbs, seq)
    mask = torch.tril(torch.ones(seq, seq, dtype=torch.bool)).logical_not().view(1, 1, seq, seq)
    runs = {name: _build(name, o) for name in o["configs"]}
    times = {name: [] for name in runs}
    cpu = {name: [] for name in runs}     # this rank's CPU seconds per iteration (all its threads)
    on_link = {name: {"busy_s": 0.0, "exposed_s": 0.0, "p2p_bytes": 0, "a2a_bytes": 0} for name in runs}   # emulated link, per iteration
    for it in range(o["warmup"] + o["iters"]):
        for name, (model, opt, mgr) in runs.items():   # round robin: drift hits every config alike
            dist.barrier()
            link.reset_stats()
            t0, c0 = time.perf_counter(), time.process_time()
            opt.zero_grad()
            loss = model(tokens, pos, mask, labels=labels).mean()
            loss.backward()
            if mgr is not None:
                mgr.before_finalize_grads()
            _average_dense_grads(model, world)
            opt.step()
            if mgr is not None:
                mgr.after_step(it)
            c1 = time.process_time()
            dist.barrier()
            if it >= o["warmup"]:
                times[name].append(time.perf_counter() - t0)
                cpu[name].append(c1 - c0)
                for k, v in link.stats().items():
                    if k in on_link[name]:
                        on_link[name][k] += v / o["iters"]
    metrics = {name: (mgr.metrics() if mgr is not None else {}) for name, (_, _, mgr) in runs.items()}
    return {"times": times, "cpu": cpu, "metrics": metrics, "link": on_link}
