"""Spawned-rank bodies for tests/test_balance*.py (the balanced MoE layer vs stock megatron-core EP)."""

from __future__ import annotations

import argparse
import copy

import numpy as np
import torch
import torch.distributed as dist

E = 4
VOCAB = 64
SEQ = 8
MBS = 2


def _args(**kw):
    from megatron_moe.balance import add_arguments

    a = add_arguments(argparse.ArgumentParser()).parse_args([])
    for k, v in kw.items():
        setattr(a, k, v)
    return a


def _build(topk, balanced, dtype, seed=1234, num_layers=2, skew=0.0, exchange=None):
    """``exchange``: the exchange flags as args attributes (``moe_a2a_algorithm``, ...), injected
    into the MoE layers as in training (moe/dispatcher.customize_spec)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig

    from megatron_moe.balance import install

    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    ep = dist.get_world_size()
    cfg = TransformerConfig(num_layers=num_layers, hidden_size=16, num_attention_heads=2, ffn_hidden_size=32,
                            num_moe_experts=E, moe_router_topk=topk, moe_token_dispatcher_type="alltoall",
                            moe_aux_loss_coeff=0.0, expert_model_parallel_size=ep, moe_router_pre_softmax=topk == 1,
                            use_cpu_initialization=True, params_dtype=dtype, add_bias_linear=False,
                            hidden_dropout=0.0, attention_dropout=0.0, moe_grouped_gemm=False)
    spec = get_gpt_layer_local_spec(num_experts=E)
    args = _args(num_experts=E, **(exchange or {}))
    if exchange:
        from megatron_moe.moe import dispatcher

        spec = dispatcher.customize_spec(args, spec)
    if balanced:
        spec = install(args, spec, force=True)
    model = GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=VOCAB, max_sequence_length=SEQ)
    model = model.to(dtype)
    return model


def _batch(it, rank):
    g = torch.Generator().manual_seed(100 * it + rank)
    tokens = torch.randint(0, VOCAB, (MBS, SEQ), generator=g)
    labels = torch.randint(0, VOCAB, (MBS, SEQ), generator=g)
    pos = torch.arange(SEQ).unsqueeze(0).expand(MBS, SEQ)
    mask = torch.tril(torch.ones(SEQ, SEQ, dtype=torch.bool)).logical_not().view(1, 1, SEQ, SEQ)
    return tokens, pos, mask, labels


def _iteration(model, opt, it, rank, mgr=None, microbatches=1):
    opt.zero_grad(set_to_none=False)
    total = 0.0
    for mb in range(microbatches):
        tokens, pos, mask, labels = _batch(10 * it + mb, rank)
        loss = model(tokens, pos, mask, labels=labels).mean() / microbatches
        loss.backward()
        total += float(loss.detach())
    if mgr is not None:
        mgr.before_finalize_grads()
    # plain EP semantics: dense grads all-reduced (averaged) over the data-parallel world,
    # expert grads are local to their owner (expert-DP size 1)
    for name, p in model.named_parameters():
        if p.grad is not None and not getattr(p, "allreduce", True) is False:
            dist.all_reduce(p.grad)
            p.grad /= dist.get_world_size()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    opt.step()
    if mgr is not None:
        mgr.after_step(it)
    return total, grads


def _random_placement(seed, n_ranks):
    from megatron_moe.balance.policies.base import Placement

    rng = np.random.default_rng(seed)
    p = Placement.plain(E, n_ranks)
    for e in range(E):
        extra = [d for d in range(n_ranks) if rng.random() < 0.6]
        p.replica_sets[e] = sorted(set(p.replica_sets[e]) | set(extra))
    return p


def equivalence_rank(rank, world, cases):
    """Each case: dict(topk, plans=[spec per iteration], overlap, n). Returns per-case max diffs."""
    from megatron.core import parallel_state as ps

    from megatron_moe.balance import BalanceManager
    from megatron_moe.balance.placement import LayerBalance
    from megatron_moe.balance.policies.base import Placement
    from megatron_moe.balance.scheduler import EventLog

    ps.initialize_model_parallel(expert_model_parallel_size=world)
    dtype = torch.float64
    results = []
    for case in cases:
        topk, iters = case["topk"], case["iters"]
        ref = _build(topk, False, dtype)
        ours = _build(topk, True, dtype)
        assert all(torch.equal(a, b) for a, b in zip(ref.state_dict().values(), ours.state_dict().values()
                                                      ) if torch.is_tensor(a))
        log = EventLog()
        args = _args(moe_balance_policy=case.get("policy", "proprophet"), moe_balance_alpha=0.0,
                     moe_balance_n=case.get("n", 0), moe_balance_overlap=case.get("overlap", False),
                     moe_routing_trace_dir=case.get("trace_dir"))
        mgr = BalanceManager(args, [ours], num_microbatches=1, log=log)
        if "plan_ahead" in case:                 # False: the sequential plan in after_step
            mgr.plan_ahead = case["plan_ahead"]
        if case.get("split"):                    # a calibrated T_FNEC that fits exactly one full Trans
            mgr.cost.t_fnec = 1.5 * mgr.cost.t_trans(1, 0, world)
        used = []
        opt_r = torch.optim.Adam(ref.parameters(), lr=1e-2)
        opt_o = torch.optim.Adam(ours.parameters(), lr=1e-2)
        worst = {"loss": 0.0, "grad": 0.0, "param": 0.0}
        replicated = 0
        expected = {"trans_sent": 0, "agg_recv": 0}
        mbs = case.get("microbatches", 1)
        mgr.scheduler.num_microbatches = mbs
        if case.get("link_gbps"):                # every transfer behind the emulated link (comm/link.py)
            from megatron_moe.comm import link

            link.configure(case["link_gbps"])
        for it in range(iters):
            spec = case["plans"][it] if it < len(case["plans"]) else "planned"
            for m in mgr.layers:
                st = m.balance
                if spec == "empty":
                    st.placement = Placement.plain(E, world)
                elif spec == "random":
                    st.placement = _random_placement(1000 * it + (st.layer_number or 0), world)
                elif spec == "all":
                    st.placement = Placement([list(range(world))] * E, world)
                # "planned": keep what mgr.after_step planned from the previous iteration (stale)
                replicated += len(st.placement.replicated())
            used.append([m.balance.placement.to_dict() for m in mgr.layers])
            for m in mgr.layers:
                st = m.balance
                for e, S in enumerate(st.placement.replica_sets):
                    if st.owner(e) == rank:      # note 5.3 item 18: (|S_e| - 1) * size(params)
                        expected["trans_sent"] += (len(S) - 1) * st.numel * 8
                        expected["agg_recv"] += (len(S) - 1) * st.numel * 8
            lr, gr = _iteration(ref, opt_r, it, rank, microbatches=mbs)
            lo, go = _iteration(ours, opt_o, it, rank, mgr, microbatches=mbs)
            worst["loss"] = max(worst["loss"], abs(lr - lo))
            assert gr.keys() == go.keys(), (sorted(gr), sorted(go))
            worst["grad"] = max(worst["grad"], max(float((gr[k] - go[k]).abs().max()) for k in gr))
            pr, po = dict(ref.named_parameters()), dict(ours.named_parameters())
            worst["param"] = max(worst["param"], max(float((pr[k] - po[k]).abs().max()) for k in pr))
        # replicas never leak into parameters, optimizer or checkpoint
        n_params = sum(1 for _ in ours.parameters())
        assert n_params == sum(1 for _ in ref.parameters())
        assert sum(len(g["params"]) for g in opt_o.param_groups) == n_params
        assert set(ours.state_dict().keys()) == set(ref.state_dict().keys())
        # checkpoint round trip: a fresh manager plans exactly as the uninterrupted one
        sd = copy.deepcopy(mgr.state_dict())
        mgr2 = BalanceManager(args, [ours], num_microbatches=1)
        mgr2.cost.t_fnec = mgr.cost.t_fnec       # the same calibration (a profile file in training)
        mgr2.load_state_dict(sd)
        for m in mgr.layers:
            a, b = mgr.stats.predict(m.balance.layer_number), mgr2.stats.predict(m.balance.layer_number)
            assert np.array_equal(a, b)
            if mgr.policy is not None and mgr.args.moe_balance_policy != "none":
                assert mgr.policy.plan(a).replica_sets == mgr2.policy.plan(b).replica_sets
        assert mgr2.state_dict() == sd
        got = {"trans_sent": sum(m.balance.bytes_trans_sent for m in mgr.layers),
               "agg_recv": sum(m.balance.bytes_agg_recv for m in mgr.layers)}
        link_stats = {}
        if case.get("link_gbps"):
            from megatron_moe.comm import link

            link_stats = dict(link.stats(), sent=got["trans_sent"] + sum(m.balance.bytes_agg_sent for m in mgr.layers))
            link.configure(None)
        results.append(dict(worst, replicated=replicated, bytes=got, expected_bytes=expected, link=link_stats,
                            events=[(e["op"], e["layer"], e["iteration"]) for e in log.events],
                            events_full=[{k: v for k, v in e.items() if k != "seq"} for e in log.events],
                            placements=used, metrics=mgr.metrics()))
    results.append({"plans": plan_determinism_rank(rank, world, 7)})   # saves a spawn
    if world == 2:
        ps.destroy_model_parallel()
        results.append({"ddp": ddp_rank(rank, world)})
    return results


def plan_determinism_rank(rank, world, seed):
    """Every rank plans the same (all-gathered) counts, built with rank-dependent tie noise in the
    order of operations: the plans must be identical (note 5.2 item 11)."""
    from megatron_moe.balance.cost_model import CostModel
    from megatron_moe.balance.policies.proprophet import search

    rng = np.random.default_rng(seed)
    C = rng.integers(0, 5, size=(world, 8)).astype(np.float64) * 100   # many equal-valued ties
    local = torch.from_numpy(C[rank].copy())
    parts = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(parts, local)
    C = torch.stack(parts).numpy()
    cost = CostModel(input_bytes=4096, expert_bytes=1 << 16, throughput=4e6, a2a_bandwidth=12.5e9)
    plans = [search(C, cost, alpha, n, eq8=eq8).plan for alpha in (0.0, 0.5) for n in (0, 1)
             for eq8 in (False, True)]
    return [(int(e), [int(x) for x in nb]) for p in plans for e, nb in p]


def ddp_rank(rank, world, topk=2):
    """megatron-core DDP path: Agg lands in ``main_grad`` before finish_grad_sync; main grads equal the
    stock layer's for a random placement (the real training path's grad buffers)."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from megatron_moe.balance import BalanceManager

    ps.initialize_model_parallel(expert_model_parallel_size=world)
    out = {}
    grads = []
    for balanced in (False, True):
        model = _build(topk, balanced, torch.float64)
        ddp = DistributedDataParallel(config=model.config, module=model,
                                      ddp_config=DistributedDataParallelConfig(overlap_grad_reduce=False,
                                                                               grad_reduce_in_fp32=False))
        mgr = None
        if balanced:
            mgr = BalanceManager(_args(moe_balance_policy="proprophet"), [ddp], num_microbatches=1)
            for m in mgr.layers:
                m.balance.placement = _random_placement(m.balance.layer_number, world)
        ddp.zero_grad_buffer()
        tokens, pos, mask, labels = _batch(0, rank)
        loss = ddp(tokens, pos, mask, labels=labels).mean()
        loss.backward()
        if mgr is not None:
            mgr.before_finalize_grads()
            out["replicated"] = sum(len(m.balance.placement.replicated()) for m in mgr.layers)
        ddp.finish_grad_sync()
        grads.append({n: p.main_grad.clone() for n, p in model.named_parameters()})
    out["max_diff"] = max(float((grads[0][k] - grads[1][k]).abs().max()) for k in grads[0])
    out["nonzero"] = max(float(g.abs().max()) for g in grads[0].values())
    return out
