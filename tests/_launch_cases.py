"""Spawned-rank body for tests/test_launch_counts.py: the aten ops of one megatron-core MoE layer's
forward + backward (alltoall dispatcher, EP=1), experts as GroupedSequentialMLP or SequentialMLP, the
dispatcher's chunk sort ours (as in training) or megatron-core's (``mutate="mcore_chunk_sort"``)."""

from __future__ import annotations


def count_layer_ops(rank, world, num_experts, grouped, mutate=None):
    """{'total': ops, 'chunk_sort': ops of megatron-core's sort_chunks_by_idxs (its forward and the
    backward of the nodes it made), 'ops': {name: count}}."""
    import collections
    import dataclasses

    import torch
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.moe import moe_utils
    from torch.utils._python_dispatch import TorchDispatchMode

    from megatron_moe.compat import replace_spec, spec_submodules
    from megatron_moe.moe import grouped_experts
    from megatron_moe.moe.layer import MoELayer
    from tests._sync_counter import _caller

    if mutate == "stack":   # the experts' weights stacked by torch.stack: a select per expert back
        grouped_experts._GroupedLinear.apply = staticmethod(
            lambda x, offs, *w: torch.nn.functional.grouped_mm(x, torch.stack(w).transpose(1, 2),
                                                               offs=offs))
    ps.initialize_model_parallel(tensor_model_parallel_size=1, expert_model_parallel_size=1)
    cfg = TransformerConfig(
        num_layers=1, hidden_size=16, ffn_hidden_size=16, moe_ffn_hidden_size=16,
        num_attention_heads=2, num_moe_experts=num_experts, moe_router_topk=2,
        moe_token_dispatcher_type="alltoall", moe_aux_loss_coeff=0.01, moe_router_dtype="fp32",
        use_cpu_initialization=True, bf16=False, params_dtype=torch.float32,
        gated_linear_unit=True, add_bias_linear=False)
    sub = spec_submodules(get_moe_module_spec(use_te=False, num_experts=num_experts,
                                              moe_grouped_gemm=False))
    if grouped:
        sub = dataclasses.replace(sub, experts=replace_spec(
            sub.experts, module=grouped_experts.GroupedSequentialMLP))
    torch.manual_seed(0)
    layer = MoELayer(cfg, submodules=sub)
    x = torch.randn(128, 2, 16)

    # the chunk sort megatron-core's dispatcher calls inside our layer: ours (its exchange's,
    # moe/dispatcher.py, as in training), or megatron-core's own (the mutation)
    names = layer.exchange_scope.names
    if mutate == "mcore_chunk_sort":
        names["sort_chunks_by_idxs"] = moe_utils.sort_chunks_by_idxs
    sort_nodes = set()
    orig_sort = names["sort_chunks_by_idxs"]

    def sort_chunks(*args, **kwargs):
        out = orig_sort(*args, **kwargs)
        given = {id(args[0]), id(kwargs.get("probs"))}
        for t in out:
            if id(t) in given:   # returned as it came (an identity order): no node of the sort's
                continue
            node = getattr(t, "grad_fn", None)
            if node is not None:   # its own node, and megatron-core's split of the input
                sort_nodes.add(node)
                sort_nodes.update(n for n, _ in node.next_functions
                                  if n is not None and n.name().startswith("Split"))
        return out

    names["sort_chunks_by_idxs"] = sort_chunks

    def step():
        xi = x.clone().requires_grad_()
        out, _ = layer(xi)
        # autograd.grad: the layer's backward; the leaves' gradient accumulation (one per parameter
        # tensor, whatever the layer) is the optimizer's side
        torch.autograd.grad(out.float().pow(2).sum(), [xi] + list(layer.parameters()))

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops, self.total, self.chunk_sort = collections.Counter(), 0, 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.total += 1
            self.ops[func.overloadpacket.__name__] += 1
            node = torch._C._current_autograd_node()
            if (node in sort_nodes) if node is not None else \
                    _caller()[1].endswith(" sort_chunks_by_idxs"):
                self.chunk_sort += 1
            return func(*args, **(kwargs or {}))

    step()   # warm-up: lazily built state
    calls = grouped_experts.GroupedSequentialMLP.grouped_calls
    with Count() as c:
        step()
    return {"total": c.total, "chunk_sort": c.chunk_sort, "ops": dict(c.ops),
            "grouped_calls": grouped_experts.GroupedSequentialMLP.grouped_calls - calls}
