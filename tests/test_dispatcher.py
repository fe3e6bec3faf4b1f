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

    num_tokens, experts, topk = 37, 8, 3
    routing_map, scores = _topk_map(num_tokens, experts, topk)
    outs = []
    for fn in (_masked_select_permute,
               lambda t, m, p: permute_by_argsort(t, m, p, num_tokens * topk)):
        tokens = torch.randn(num_tokens, 16, generator=torch.Generator().manual_seed(1),
                             requires_grad=True)
        probs = scores.detach().requires_grad_()
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


def _topk_map(num_tokens, experts, topk, seed=0):
    import torch

    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_tokens, experts, generator=g)
    top = logits.topk(topk, dim=1).indices
    return (torch.zeros(num_tokens, experts, dtype=torch.bool).scatter_(1, top, True),
            logits.softmax(-1))


def _unsorted_backward(ctx, grad):
    """A wrong backward: the rows summed in permuted order, not each token's own."""
    (sorted_indices,) = ctx.saved_tensors
    return grad.view(-1, ctx.topk, *grad.shape[1:]).sum(1), None, None


def test_rows_gathered_permute_equals_megatron_cores_forward_and_backward(monkeypatch):
    """The dropless permute whose backward gathers each token's rows and sums them (no atomic
    index_add_): the same rows, probs and order as megatron-core's permute, and the same token
    gradients (float64: the sums' rounding cannot hide a wrong row); a backward that sums the
    wrong rows fails the comparison."""
    import torch

    from megatron_moe.compat.dispatch import mcore_permute
    from megatron_moe.moe import dispatcher

    num_tokens, experts, topk = 37, 8, 3
    routing_map, probs = _topk_map(num_tokens, experts, topk)
    ours = dispatcher.rows_gathered_permute(mcore_permute, topk)

    def run(fn):
        tokens = torch.randn(num_tokens, 16, dtype=torch.float64,
                             generator=torch.Generator().manual_seed(1), requires_grad=True)
        p = probs.double().requires_grad_()
        out, out_probs, index = fn(tokens, routing_map, probs=p, num_out_tokens=num_tokens * topk)
        weight = torch.randn(out.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
        ((out * weight).sum(-1) * out_probs).sum().backward()
        return out, out_probs, index, tokens.grad, p.grad

    before = dispatcher._GatherRows.backwards
    reference, gathered = run(mcore_permute), run(ours)
    assert dispatcher._GatherRows.backwards == before + 1
    for a, b in zip(reference[:3] + reference[4:], gathered[:3] + gathered[4:]):
        assert torch.equal(a, b)
    torch.testing.assert_close(gathered[3], reference[3], rtol=1e-13, atol=1e-13)
    # any other call (capacity: a device count) is the wrapped permute's own
    out = ours(torch.randn(num_tokens, 4), routing_map, num_out_tokens=torch.tensor(num_tokens * topk))
    assert out[0].shape == (num_tokens * topk, 4) and dispatcher._GatherRows.backwards == before + 1
    monkeypatch.setattr(dispatcher._GatherRows, "backward", staticmethod(_unsorted_backward))
    assert not torch.allclose(run(ours)[3], reference[3])


def _wrong_sum_forward(ctx, permuted, sorted_indices, topk):
    """A wrong forward: the rows summed in permuted order, not each token's own."""
    ctx.save_for_backward(sorted_indices)
    return permuted.view(-1, topk, *permuted.shape[1:]).sum(1)


def test_rows_summed_unpermute_equals_megatron_cores_forward_and_backward(monkeypatch):
    """The dropless unpermute that gathers each token's rows and sums them (no atomic scatter):
    megatron-core's tokens and row gradients (float64); calls with probabilities, or rows that are
    not top-k per token, are megatron-core's own; a forward that sums the wrong rows fails."""
    import torch

    from megatron_moe.compat.dispatch import mcore_permute, mcore_unpermute
    from megatron_moe.moe import dispatcher

    num_tokens, experts, topk = 37, 8, 3
    routing_map, probs = _topk_map(num_tokens, experts, topk)
    tokens = torch.randn(num_tokens, 16, dtype=torch.float64)
    permuted, _, index = mcore_permute(tokens, routing_map, num_out_tokens=num_tokens * topk)
    ours = dispatcher.rows_summed_unpermute(mcore_unpermute, topk)

    def run(fn):
        rows = (permuted * torch.linspace(0.5, 2, permuted.shape[0], dtype=torch.float64)[:, None]
                ).requires_grad_()
        out = fn(rows, index, tokens.shape, routing_map=routing_map)
        (out * torch.randn(out.shape, dtype=torch.float64,
                           generator=torch.Generator().manual_seed(3))).sum().backward()
        return out, rows.grad

    before = dispatcher._SumRows.forwards
    (ref_out, ref_grad), (out, grad) = run(mcore_unpermute), run(ours)
    assert dispatcher._SumRows.forwards == before + 1
    torch.testing.assert_close(out, ref_out, rtol=1e-13, atol=1e-13)
    assert torch.equal(grad, ref_grad)
    with_probs = ours(permuted, index, tokens.shape, probs=probs.double(), routing_map=routing_map)
    torch.testing.assert_close(with_probs, mcore_unpermute(
        permuted, index, tokens.shape, probs=probs.double(), routing_map=routing_map))
    ours(permuted[:-1], index[:-1], tokens.shape, routing_map=routing_map)   # not top-k per token
    assert dispatcher._SumRows.forwards == before + 1
    monkeypatch.setattr(dispatcher._SumRows, "forward", staticmethod(_wrong_sum_forward))
    assert not torch.allclose(run(ours)[0], ref_out)


def _train_rank(rank, world_size, argv, mode):
    """``pretrain()`` with the layers' permute and unpermute as ``mode`` says: "gathered" (as
    built), "mcore" (the layers bind neither: megatron-core's own), "wrong" (the permute's backward
    sums the wrong rows), "wrong_unpermute" (the unpermute does). Returns (history, gathered
    permute backwards and summed unpermute forwards on this rank)."""
    from megatron_moe.moe import dispatcher
    from megatron_moe.moe.layer import MoELayer
    from tests._train_cases import run_pretrain

    if mode == "mcore":
        MoELayer._dropless_topk = lambda self: 0
    if mode == "wrong":
        dispatcher._GatherRows.backward = staticmethod(_unsorted_backward)
    if mode == "wrong_unpermute":
        dispatcher._SumRows.forward = staticmethod(_wrong_sum_forward)
    history = run_pretrain(rank, world_size, argv)
    return history, (dispatcher._GatherRows.backwards, dispatcher._SumRows.forwards)


def test_dropless_layers_train_with_the_gathered_permute_backward():
    """A dropless all-to-all run (EP=2) trains with the gathered permute backward and the summed
    unpermute (both counted) to megatron-core's losses and grad norms (fp32: the sums differ only
    in rounding); either one summing the wrong rows changes them; a capacity factor keeps
    megatron-core's permute and unpermute (not counted)."""
    import pytest

    from megatron_moe.runtime.local_ranks import run_distributed
    from tests.test_training import TINY

    def train(extra, mode):
        return run_distributed(_train_rank, 2, TINY + extra.split(), mode, timeout_s=300)[0]

    flags = "--expert-model-parallel-size 2 --train-iters 3"
    (gathered, counts), (mcore, none) = train(flags, "gathered"), train(flags, "mcore")
    # iterations x micro-batches per rank x layers; the unpermute also runs in the final
    # evaluation's forwards (validation and test: one iteration of 2 micro-batches each)
    assert counts == (3 * 2 * 2, 3 * 2 * 2 + 2 * 2 * 2) and none == (0, 0)
    assert gathered["lm_loss"] == pytest.approx(mcore["lm_loss"], rel=1e-6)
    assert gathered["grad_norm"] == pytest.approx(mcore["grad_norm"], rel=1e-5)
    wrong, _ = train(flags, "wrong")
    assert wrong["grad_norm"] != pytest.approx(mcore["grad_norm"], rel=1e-3)
    wrong, _ = train(flags, "wrong_unpermute")
    assert wrong["lm_loss"] != pytest.approx(mcore["lm_loss"], rel=1e-3)
    capped, counts = train(flags + " --moe-expert-capacity-factor 1.5", "gathered")
    assert counts == (0, 0) and capped["lm_loss"][0] == pytest.approx(mcore["lm_loss"][0], rel=1e-2)
