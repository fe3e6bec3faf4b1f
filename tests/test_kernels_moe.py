"""A megatron-core MoE layer (all-to-all dispatcher, EP=2 on gloo) gives bit-identical outputs
and gradients with megatron-core's permute/unpermute and with kernels.permute/unpermute swapped
into its dispatcher - dropless and drop-and-pad."""

import pytest
import torch

from megatron_moe.runtime.local_ranks import run_distributed


def moe_layer_fused_vs_unfused(rank, world_size, drop_and_pad):
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.moe import token_dispatcher
    from megatron.core.transformer.moe.moe_layer import MoELayer

    import kernels
    from megatron_moe.compat import spec_submodules
    from megatron_moe.compat.dispatch import adapt_permute, adapt_unpermute  # per megatron-core

    ps.initialize_model_parallel(tensor_model_parallel_size=1,
                                 expert_model_parallel_size=world_size)
    extra = dict(moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True) \
        if drop_and_pad else {}
    cfg = TransformerConfig(
        num_layers=1, hidden_size=16, ffn_hidden_size=24, num_attention_heads=2,
        num_moe_experts=4, moe_router_topk=2, moe_token_dispatcher_type="alltoall",
        moe_aux_loss_coeff=0.0, moe_router_dtype="fp32", use_cpu_initialization=True,
        expert_model_parallel_size=world_size, bf16=False, params_dtype=torch.float32, **extra)
    torch.manual_seed(0)
    spec = get_moe_module_spec(use_te=False, num_experts=4, moe_grouped_gemm=False)
    layer = MoELayer(cfg, submodules=spec_submodules(spec))
    torch.manual_seed(100 + rank)
    x = torch.randn(7, 3, 16)

    def run():
        layer.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_()
        out, _ = layer(xi)
        out.pow(2).sum().backward()
        return out.detach(), xi.grad, [p.grad.clone() for p in layer.parameters()]

    base = run()
    orig = token_dispatcher.permute, token_dispatcher.unpermute
    calls = []

    def counted(fn):
        def wrapper(*a, **k):
            calls.append(fn.__name__)
            return fn(*a, **k)
        return wrapper

    token_dispatcher.permute = counted(adapt_permute(kernels.permute))
    token_dispatcher.unpermute = counted(adapt_unpermute(kernels.unpermute))
    try:
        ours = run()
    finally:
        token_dispatcher.permute, token_dispatcher.unpermute = orig
    same_out = torch.equal(base[0], ours[0])
    same_dx = torch.equal(base[1], ours[1])
    same_dw = all(torch.equal(a, b) for a, b in zip(base[2], ours[2]))
    used = "permute" in calls and "unpermute" in calls
    return same_out, same_dx, same_dw, float(base[0].abs().sum()), used


@pytest.mark.parametrize("drop_and_pad", [False, True])
def test_moe_layer_bit_identical_with_our_permute(drop_and_pad):
    res = run_distributed(moe_layer_fused_vs_unfused, 2, drop_and_pad, timeout_s=180)
    for same_out, same_dx, same_dw, norm, used in res:
        assert norm > 0 and used
        assert same_out and same_dx and same_dw, res
