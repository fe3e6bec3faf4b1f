"""Spawned-rank body for tests/test_moe_stages.py: megatron-core's MoELayer and ours (the same
weights) on EP=2, run whole (megatron-core's forward) and stage by stage (as megatron-core >= 0.18's
overlapped schedules call them), with a counter on each thing that must have run."""

from __future__ import annotations


def _layer_parts(ep):
    """Model parallel state for EP = ``ep`` (TP 1) and one MoE layer's config and submodules (4
    experts top-2, SwiGLU, fp32, megatron-core's local expert loop)."""
    import torch
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.transformer import TransformerConfig

    from megatron_moe.compat import spec_submodules

    ps.initialize_model_parallel(tensor_model_parallel_size=1, expert_model_parallel_size=ep)
    cfg = TransformerConfig(
        num_layers=1, hidden_size=16, ffn_hidden_size=16, moe_ffn_hidden_size=16,
        num_attention_heads=2, num_moe_experts=4, moe_router_topk=2,
        moe_token_dispatcher_type="alltoall", moe_aux_loss_coeff=0.0, moe_router_dtype="fp32",
        use_cpu_initialization=True, bf16=False, params_dtype=torch.float32,
        gated_linear_unit=True, add_bias_linear=False)
    return cfg, spec_submodules(get_moe_module_spec(use_te=False, num_experts=4,
                                                    moe_grouped_gemm=False))


def run_stages(rank, world, middle, mutate=None):
    """{'whole': max |ours - megatron-core|, 'staged': the same for the stage-by-stage run,
    'grad': max grad difference (input and parameters), 'calls': {what: count},
    'outside': whether megatron-core's own names are bound outside the stages}."""
    import collections

    import torch
    from megatron.core.transformer.moe import moe_utils, token_dispatcher
    from megatron.core.transformer.moe.moe_layer import MoELayer as CoreMoELayer

    from megatron_moe import comm
    from megatron_moe.balance import layer as balance_layer
    from megatron_moe.compat.dispatch import DispatcherScope
    from megatron_moe.moe import dispatcher
    from megatron_moe.moe.dispatcher import ExchangeConfig
    from megatron_moe.moe.layer import CoreStages, MoELayer

    calls = collections.Counter()

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return wrapper

    dispatcher.sort_chunks_by_idxs = counted("our_chunk_sort", dispatcher.sort_chunks_by_idxs)
    comm.chunked_moe_exchange = counted("chunked_exchange", comm.chunked_moe_exchange)
    balance_layer._plan = counted("replica_plan", balance_layer._plan)
    if mutate == "scope_binds_nothing":
        DispatcherScope.__enter__ = lambda self: self
        DispatcherScope.__exit__ = lambda self, *exc: False

    cfg, sub = _layer_parts(world)
    exchange = ExchangeConfig(overlap_degree=2) if middle == "chunked" else ExchangeConfig()
    placement = balance_layer.ReplicaPlacement() if middle == "placement" else None
    torch.manual_seed(0)
    core = CoreMoELayer(cfg, submodules=sub)
    ours = MoELayer(cfg, submodules=sub, exchange=exchange, placement=placement)
    ours.load_state_dict(core.state_dict())
    if mutate == "middle_ignored":   # megatron-core's stages instead of the middle
        ours.middle = CoreStages()
    torch.manual_seed(1 + rank)
    x = torch.randn(32, 2, 16)

    def run(layer, staged):
        xi = x.clone().requires_grad_()
        if staged:   # megatron-core's forward, one stage at a time
            shared = layer.shared_experts_compute(xi)
            probs, routing_map = layer.route(xi)
            h, probs = layer.preprocess(xi, probs, routing_map)
            h, probs = layer.dispatch(h, probs)
            out, _ = layer.routed_experts_compute(h, probs)
            out = layer.combine(out)
            out = layer.postprocess(out, shared)
        else:
            out, _ = layer(xi)
        out.float().pow(2).sum().backward()
        grads = [xi.grad] + [p.grad.clone() for p in layer.parameters()]
        layer.zero_grad(set_to_none=True)
        return out.detach(), grads

    ref, ref_grads = run(core, staged=False)
    core_calls = dict(calls)
    calls.clear()
    whole, whole_grads = run(ours, staged=False)
    staged, staged_grads = run(ours, staged=True)
    grad = max((a - b).abs().max().item() for g in (whole_grads, staged_grads)
               for a, b in zip(g, ref_grads))
    outside = token_dispatcher.sort_chunks_by_idxs is moe_utils.sort_chunks_by_idxs
    return {"whole": (whole - ref).abs().max().item(), "staged": (staged - ref).abs().max().item(),
            "grad": grad, "calls": dict(calls), "core_calls": core_calls, "outside": outside}


def run_counts(rank, world, grouped, mutate=None):
    """One rank (EP = TP = 1): our layer's forward and backward with the dispatcher's copy/sync
    points recorded. {'points': points the dispatcher reached, 'dtoh': its copy point, 'sync': its
    sync point, 'on_device': the layer's flag, 'diff': max |ours - megatron-core's layer|}."""
    import dataclasses

    import torch
    from megatron.core.transformer.moe.moe_layer import MoELayer as CoreMoELayer

    from megatron_moe.compat import replace_spec
    from megatron_moe.moe import grouped_experts, layer as moe_layer
    from megatron_moe.moe.layer import MoELayer

    if mutate == "counts_to_host":   # the layer leaves megatron-core's copy and sync points alone
        moe_layer.keep_counts_on_device = lambda td: False
    cfg, sub = _layer_parts(1)
    core_sub = sub
    if grouped:
        sub = dataclasses.replace(sub, experts=replace_spec(
            sub.experts, module=grouped_experts.GroupedSequentialMLP))
    torch.manual_seed(0)
    core = CoreMoELayer(cfg, submodules=core_sub)
    ours = MoELayer(cfg, submodules=sub)
    ours.load_state_dict(core.state_dict())
    td = ours.token_dispatcher
    points = []
    reach = td._maybe_dtoh_and_synchronize

    def recorded(point, tokens_per_expert=None):
        points.append(point)
        return reach(point, tokens_per_expert)

    td._maybe_dtoh_and_synchronize = recorded
    x = torch.randn(32, 2, 16)
    out = ours(x.clone().requires_grad_())[0]
    out.float().pow(2).sum().backward()
    ref = core(x.clone())[0]
    return {"points": points, "dtoh": td.cuda_dtoh_point, "sync": td.cuda_sync_point,
            "on_device": ours.counts_on_device, "diff": (out - ref).abs().max().item()}
