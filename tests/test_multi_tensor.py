"""megatron_moe/compat/multi_tensor.py: megatron-core's no-apex gradient norm and scaling on
torch's foreach kernels: the same values, no host read, installed only over megatron-core's own
fallbacks."""

import pytest
import torch

from megatron_moe.compat import multi_tensor


def host_reads(fn):
    """Device values read on the host while ``fn`` runs (on a GPU each is a
    cudaStreamSynchronize), as the profiler sees them: ``torch.tensor(<list of tensors>)`` reads
    each element below the Python dispatcher, where a dispatch mode cannot see it."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        out = fn()
    return out, sum(e.name == "aten::_local_scalar_dense" for e in prof.events())


def _tensors(seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = [(7,), (3, 5), (16, 4), (1,), (33, 2)]
    return [torch.randn(s, generator=g) for s in shapes]


def _mcore_norm(tensor_lists):
    """megatron-core's local_multi_tensor_l2_norm's arithmetic (its result tensor is made on
    "cuda"): each tensor's norm, the norm of those."""
    l2 = [[torch.norm(t) for t in tl] for tl in tensor_lists]
    return torch.norm(torch.tensor(l2))


def test_norm_equals_megatron_cores_and_reads_nothing_on_the_host():
    lists = [_tensors(0), _tensors(1)]
    (norm, per_tensor), reads = host_reads(
        lambda: multi_tensor.foreach_l2_norm(2048 * 32, None, lists, False))
    assert reads == 0
    assert per_tensor is None and norm.shape == (1,) and norm.dtype == torch.float32
    torch.testing.assert_close(norm[0], _mcore_norm(lists), rtol=1e-6, atol=0)
    # mutation: megatron-core's arithmetic reads every tensor's norm on the host
    _, reads = host_reads(lambda: _mcore_norm(lists))
    assert reads >= sum(len(tl) for tl in lists)


def test_norm_of_bf16_tensors_is_taken_in_fp32_and_empty_lists_give_zero():
    ts = [t.to(torch.bfloat16) for t in _tensors(2)]
    norm, _ = multi_tensor.foreach_l2_norm(0, None, [ts], False)
    expect = torch.linalg.vector_norm(torch.cat([t.float().reshape(-1) for t in ts]))
    torch.testing.assert_close(norm[0], expect, rtol=1e-6, atol=0)
    zero, _ = multi_tensor.foreach_l2_norm(0, None, [[]], False)
    assert zero.tolist() == [0.0]


@pytest.mark.parametrize("scale", [1.0, 0.37])
def test_scale_copy_is_bit_exact_to_the_loop(scale):
    srcs = _tensors(3)
    dsts = [torch.empty_like(s, dtype=torch.bfloat16) for s in srcs]
    multi_tensor.foreach_scale(0, None, [srcs, dsts], scale)
    for s, d in zip(srcs, dsts):
        assert torch.equal(d, (s * scale).to(torch.bfloat16))
    # in place (gradient clipping passes the same list twice)
    grads = _tensors(4)
    expect = [g * scale for g in grads]
    multi_tensor.foreach_scale(0, None, [grads, grads], scale)
    assert all(torch.equal(g, e) for g, e in zip(grads, expect))


def test_install_rebinds_only_megatron_cores_fallbacks(monkeypatch):
    from megatron.core import utils as mcore_utils
    from megatron.core.optimizer import clip_grads
    from megatron.core.optimizer import optimizer as mcore_optimizer

    monkeypatch.setattr(clip_grads, "l2_norm_impl", mcore_utils.local_multi_tensor_l2_norm)
    monkeypatch.setattr(clip_grads, "multi_tensor_scale_impl", mcore_utils.local_multi_tensor_scale)
    monkeypatch.setattr(mcore_optimizer, "multi_tensor_scale_impl",
                        mcore_utils.local_multi_tensor_scale)
    monkeypatch.setattr(mcore_optimizer, "_multi_tensor_copy_this_to_that",
                        mcore_optimizer._multi_tensor_copy_this_to_that)
    assert len(multi_tensor.install()) == 4
    assert mcore_optimizer._multi_tensor_copy_this_to_that is multi_tensor.foreach_copy_this_to_that
    assert clip_grads.l2_norm_impl is multi_tensor.foreach_l2_norm
    assert clip_grads.multi_tensor_scale_impl is multi_tensor.foreach_scale
    assert mcore_optimizer.multi_tensor_scale_impl is multi_tensor.foreach_scale
    assert multi_tensor.install() == []   # idempotent
    # a fused kernel (apex / TE) stays
    fused = object()
    monkeypatch.setattr(clip_grads, "l2_norm_impl", fused)
    multi_tensor.install()
    assert clip_grads.l2_norm_impl is fused


def test_main_to_model_copy_is_bit_exact_and_one_foreach_call(monkeypatch):
    main = _tensors(5)
    model = [torch.empty_like(t, dtype=torch.bfloat16) for t in main]
    calls = []
    orig = torch._foreach_copy_
    monkeypatch.setattr(torch, "_foreach_copy_", lambda *a, **k: calls.append(1) or orig(*a, **k))
    buf = torch.ones(1, dtype=torch.int)
    multi_tensor.foreach_copy_this_to_that(main, model, buf)
    assert calls == [1] and buf.item() == 0
    assert all(torch.equal(d, s.to(torch.bfloat16)) for s, d in zip(main, model))
