"""The dispatcher hooks: our fused permute kernels inside megatron-core's alltoall dispatcher."""

from tests.test_training import train


def test_permute_fusion_gives_bit_identical_training():
    layout = ("--expert-model-parallel-size 2 --train-iters 3 --moe-expert-capacity-factor 1.5 "
              "--moe-pad-expert-input-to-capacity")
    dropless = "--expert-model-parallel-size 2 --train-iters 3"
    for flags in (dropless, layout):
        plain = train(2, flags)[0]
        fused = train(2, flags + " --moe-permute-fusion")[0]
        assert fused["lm_loss"] == plain["lm_loss"]
        assert fused["grad_norm"] == plain["grad_norm"]


def _masked_select_permute(tokens, routing_map, probs):
    """megatron-core 0.16's unfused permute, written out: the reference order."""
    import torch

    mask = routing_map.bool().T.contiguous()
    index = torch.arange(routing_map.shape[0]).unsqueeze(0).expand_as(mask).masked_select(mask)
    return tokens.index_select(0, index), probs.T.contiguous().masked_select(mask), index


def test_argsort_permute_equals_masked_select_forward_and_backward():
    import torch

    from megatron_moe.compat.dispatch import permute_by_argsort

    torch.manual_seed(0)
    num_tokens, experts, topk = 37, 8, 3
    logits = torch.randn(num_tokens, experts)
    top = logits.topk(topk, dim=1).indices
    routing_map = torch.zeros(num_tokens, experts, dtype=torch.bool).scatter_(1, top, True)
    outs = []
    for fn in (_masked_select_permute,
               lambda t, m, p: permute_by_argsort(t, m, p, num_tokens * topk)):
        tokens = torch.randn(num_tokens, 16, generator=torch.Generator().manual_seed(1),
                             requires_grad=True)
        probs = logits.softmax(-1).detach().requires_grad_()
        out, out_probs, index = fn(tokens, routing_map, probs)
        (out * out_probs.unsqueeze(1) * torch.arange(out.shape[0]).unsqueeze(1)).sum().backward()
        outs.append((out, out_probs, index, tokens.grad, probs.grad))
    for a, b in zip(*outs):
        assert torch.equal(a, b)


def test_argsort_permute_is_bound_only_where_megatron_core_reads_the_map():
    import torch
    from megatron.core.transformer.moe import moe_utils

    from megatron_moe.compat import dispatch
    from megatron_moe.compat.versions import mcore_at_least
    from megatron_moe.moe.dispatcher import ExchangeConfig, dispatcher_bindings

    bound = dispatcher_bindings(ExchangeConfig()).get("permute")
    fused = dispatcher_bindings(ExchangeConfig(permute_fusion=True))["permute"]
    if mcore_at_least("0.17"):   # megatron-core permutes by argsort itself: nothing to replace
        assert bound is None
        return
    assert fused is not bound and bound.__qualname__.startswith("argsort_permute")
    # capacity (a device count) and padding stay megatron-core's
    calls = []
    orig = moe_utils.permute
    moe_utils.permute = lambda *a, **k: calls.append(k) or orig(*a, **k)
    try:
        permute = dispatch.argsort_permute()
        routing_map = torch.eye(4, dtype=torch.bool).repeat(2, 1)
        tokens = torch.randn(8, 2)
        permute(tokens, routing_map, num_out_tokens=torch.tensor(8))
        permute(tokens, routing_map, num_out_tokens=8)
    finally:
        moe_utils.permute = orig
    assert len(calls) == 1 and torch.is_tensor(calls[0]["num_out_tokens"])
