"""kernels/: fast CPU path and reference vs each other and vs megatron-core's permute/unpermute
(bit-identical), gradients, the hierarchical layout, the CPU buffer pool.
Triton kernels (under TRITON_INTERPRET=1) are in tests/test_kernels_triton.py."""

import pytest
import torch

import kernels
from kernels import ops as kops
from kernels import reference as ref

mu = pytest.importorskip("megatron.core.transformer.moe.moe_utils")
from megatron_moe.compat.dispatch import mcore_permute  # megatron-core's, 0.16 contract

@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)  # data independent of test order


LAYOUT_FIELDS = ("row_map", "prob_index", "tokens_per_expert", "routed_per_expert")


def make_routing(T, E, k, seed=0, avoid=()):
    """Distinct top-k experts per token (never choosing experts in ``avoid``), their probs,
    megatron-core's bool routing map and dense probs."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(T, E, generator=g)
    if avoid:
        logits[:, list(avoid)] = -float("inf")
    p, idx = torch.topk(torch.softmax(logits, -1), k, dim=-1)
    rmap = torch.zeros(T, E, dtype=torch.bool).scatter_(1, idx, True)
    dense = torch.zeros(T, E).scatter_(1, idx, p)
    return idx, p, rmap, dense


def bits(t):
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def assert_bit_equal(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(bits(a), bits(b)), (a - b).abs().max()


CASES = [
    # T, E, k, capacity, pad
    (37, 8, 2, None, False),
    (37, 8, 2, 5, False),  # capacity dropping
    (37, 8, 2, 6, True),  # drop and pad
    (11, 16, 2, None, False),  # more experts than pairs: empty experts
    (50, 16, 8, None, False),
    (50, 16, 8, 20, False),
    (13, 8, 8, 9, True),
    (9, 4, 1, None, False),
    (9, 4, 1, 2, True),
    (3, 8, 2, 5, True),  # capacity > tokens
    (1, 3, 3, None, False),
    (0, 4, 2, None, False),  # no tokens
]


@pytest.mark.parametrize("T,E,k,cap,pad", CASES)
@pytest.mark.parametrize("form", ["topk", "map"])
def test_layout_fast_equals_reference(T, E, k, cap, pad, form):
    idx, _, rmap, _ = make_routing(T, E, k, seed=T + E + k)
    if form == "topk":
        want = ref.routing_layout(idx, E, cap, pad)
        with kernels.use_backend("torch"):
            got = kernels.routing_layout(idx, E, cap, pad)
    else:
        want = ref.routing_layout_from_map(rmap, cap, pad)
        with kernels.use_backend("torch"):
            got = kernels.routing_layout_from_map(rmap, cap, pad)
    for f in LAYOUT_FIELDS:
        assert torch.equal(getattr(got, f), getattr(want, f)), f


@pytest.mark.parametrize("T,E,k,cap", [(37, 8, 2, None), (50, 16, 8, 7), (23, 6, 1, 3)])
def test_layout_properties(T, E, k, cap):
    """Independent of the reference: expert-major, stable in token order, earliest kept."""
    idx, _, _, _ = make_routing(T, E, k, seed=3)
    lay = kernels.routing_layout(idx, E, capacity=cap)
    routed = torch.bincount(idx.reshape(-1), minlength=E)
    assert torch.equal(lay.routed_per_expert, routed)
    kept = routed if cap is None else routed.clamp(max=cap)
    assert torch.equal(lay.tokens_per_expert, kept)
    expert = idx.reshape(-1)[lay.prob_index]
    assert torch.equal(expert, torch.repeat_interleave(torch.arange(E), kept))
    assert torch.equal(lay.row_map, torch.div(lay.prob_index, k, rounding_mode="floor"))
    for e in range(E):
        toks = lay.row_map[expert == e]
        all_toks = (idx == e).any(1).nonzero().flatten()
        assert torch.equal(toks, all_toks[: toks.numel()])  # sorted, earliest kept


def test_tokens_per_rank_and_rank_with_zero_tokens():
    E, epr = 8, 2  # 4 ranks; rank 2 owns experts 4, 5 which nobody picks
    idx, _, rmap, _ = make_routing(40, E, 2, seed=1, avoid=(4, 5))
    for be in ("torch", "reference"):
        with kernels.use_backend(be):
            lay = kernels.routing_layout(idx, E, experts_per_rank=epr)
            lay_m = kernels.routing_layout_from_map(rmap, experts_per_rank=epr)
        per_rank = torch.bincount(idx.reshape(-1) // epr, minlength=E // epr)
        assert torch.equal(lay.tokens_per_rank, per_rank)
        assert torch.equal(lay_m.tokens_per_rank, per_rank)
        assert int(lay.tokens_per_rank[2]) == 0
        assert torch.equal(lay.row_map, lay_m.row_map)


@pytest.mark.parametrize("dtype,pdtype", [
    (torch.float32, torch.float32), (torch.bfloat16, torch.float32),
    (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float32),
    (torch.float64, torch.float32),
])
@pytest.mark.parametrize("T,E,k,drop_and_pad", [
    (37, 8, 2, False), (50, 16, 8, False), (9, 4, 1, False),
    (37, 8, 2, True), (50, 16, 8, True), (11, 16, 2, False),
])
@pytest.mark.parametrize("chunk_bytes", [1 << 20, 64])  # 64: many chunks, sparse levels split
def test_mcore_dropin_bit_identical(dtype, pdtype, T, E, k, drop_and_pad, chunk_bytes,
                                    monkeypatch):
    monkeypatch.setattr(kops, "_CHUNK_BYTES", chunk_bytes)
    idx, _, rmap, dense = make_routing(T, E, k, seed=7)
    g = torch.Generator().manual_seed(8)
    x = torch.randn(T, 24, generator=g).to(dtype)
    probs = dense.to(pdtype)
    nout = (E * max(1, (T * k) // (2 * E))) if drop_and_pad else T * k  # capacity < demand
    want = mcore_permute(x, rmap, probs=probs, num_out_tokens=nout, drop_and_pad=drop_and_pad)
    for be in ("torch", "reference"):
        with kernels.use_backend(be):
            got = kernels.permute(x, rmap, probs=probs, num_out_tokens=nout,
                                  drop_and_pad=drop_and_pad)
        for a, b in zip(want, got):
            assert_bit_equal(a, b)
    y = torch.randn(want[0].shape, generator=g).to(dtype)
    for pr in (None, probs):
        for det in (False, True):  # megatron-core switches scatter_add_ -> index_add_
            prev = torch.are_deterministic_algorithms_enabled()
            torch.use_deterministic_algorithms(det)
            try:
                w = mu.unpermute(y, want[2], x.shape, probs=pr, routing_map=rmap,
                                 drop_and_pad=drop_and_pad)
            finally:
                torch.use_deterministic_algorithms(prev)
            for be in ("torch", "reference"):
                with kernels.use_backend(be):
                    o = kernels.unpermute(y, want[2], x.shape, probs=pr, routing_map=rmap,
                                          drop_and_pad=drop_and_pad)
                assert_bit_equal(w, o)


def test_mcore_dropin_drops_over_capacity_columns():
    """drop_and_pad with more routed tokens than capacity: earliest kept, like mcore."""
    T, E = 30, 4
    idx, _, rmap, dense = make_routing(T, E, 3, seed=2)
    x = torch.randn(T, 8)
    nout = E * 5  # capacity 5 << ~22 routed per expert
    want = mcore_permute(x, rmap, probs=dense, num_out_tokens=nout, drop_and_pad=True)
    got = kernels.permute(x, rmap, probs=dense, num_out_tokens=nout, drop_and_pad=True)
    for a, b in zip(want, got):
        assert_bit_equal(a, b)


@pytest.mark.parametrize("T,E,k,cap,pad", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_topk_api_fast_equals_reference(T, E, k, cap, pad, dtype):
    idx, p, _, _ = make_routing(T, E, k, seed=5)
    lay = ref.routing_layout(idx, E, cap, pad)
    g = torch.Generator().manual_seed(T * 100 + k)
    x = torch.randn(T, 10, generator=g).to(dtype)
    y = torch.randn(lay.num_rows, 10, generator=g).to(dtype)
    out = {}
    for be in ("torch", "reference"):
        with kernels.use_backend(be):
            xp, pp = kernels.permute_tokens(x, lay, p)
            out[be] = (xp, pp, kernels.unpermute_tokens(y, lay, p),
                       kernels.unpermute_tokens(y, lay))
    for a, b in zip(out["torch"], out["reference"]):
        assert_bit_equal(a, b)
    # the weighted combine is the weighted sum of each token's expert rows
    want = torch.zeros(T, 10, dtype=torch.float64)
    rp = lay.probs_per_row(p).double()
    want.index_add_(0, lay.row_map, y.double() * rp[:, None])
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(out["torch"][2].double(), want, **tol)


@pytest.mark.parametrize("backend", ["torch", "reference"])
@pytest.mark.parametrize("k,cap,pad", [(2, None, False), (3, 2, False), (1, 2, True)])
def test_gradcheck_topk_api(backend, k, cap, pad, monkeypatch):
    monkeypatch.setattr(kops, "_CHUNK_BYTES", 32)  # several chunks even at this size
    T, E, h = 5, 4, 3
    idx, p, _, _ = make_routing(T, E, k, seed=11)
    lay = kernels.routing_layout(idx, E, cap, pad)
    x = torch.randn(T, h, dtype=torch.float64, requires_grad=True)
    pr = p.double().requires_grad_()
    y = torch.randn(lay.num_rows, h, dtype=torch.float64, requires_grad=True)
    with kernels.use_backend(backend):
        assert torch.autograd.gradcheck(
            lambda a, b: kernels.permute_tokens(a, lay, b), (x, pr))
        assert torch.autograd.gradcheck(
            lambda a, b: kernels.unpermute_tokens(a, lay, b), (y, pr))
        assert torch.autograd.gradcheck(lambda a: kernels.unpermute_tokens(a, lay), (y,))


@pytest.mark.parametrize("drop_and_pad", [False, True])
def test_gradcheck_mcore_dropin_and_grads_match_mcore(drop_and_pad):
    T, E, k, h = 6, 4, 2, 3
    _, _, rmap, dense = make_routing(T, E, k, seed=4)
    nout = E * 2 if drop_and_pad else T * k
    x = torch.randn(T, h, dtype=torch.float64, requires_grad=True)
    pr = dense.double().requires_grad_()

    def ours(a, b):
        xp, pp, si = kernels.permute(a, rmap, probs=b, num_out_tokens=nout,
                                     drop_and_pad=drop_and_pad)
        return kernels.unpermute(xp * pp[:, None] + 1.0, si, a.shape, probs=b, routing_map=rmap,
                                 drop_and_pad=drop_and_pad)

    def theirs(a, b):
        xp, pp, si = mcore_permute(a, rmap, probs=b, num_out_tokens=nout, drop_and_pad=drop_and_pad)
        return mu.unpermute(xp * pp[:, None] + 1.0, si, a.shape, probs=b, routing_map=rmap,
                            drop_and_pad=drop_and_pad)

    assert torch.autograd.gradcheck(ours, (x, pr))
    go = torch.randn(T, h, dtype=torch.float64)
    ga = torch.autograd.grad(ours(x, pr), (x, pr), go)
    gb = torch.autograd.grad(theirs(x, pr), (x, pr), go)
    for a, b in zip(ga, gb):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("chunk_bytes", [8 << 20, 64])
def test_backward_bf16_matches_mcore(chunk_bytes, monkeypatch):
    monkeypatch.setattr(kops, "_CHUNK_BYTES", chunk_bytes)
    T, E, k, h = 33, 8, 2, 16
    _, _, rmap, dense = make_routing(T, E, k, seed=9)
    x = torch.randn(T, h).bfloat16()
    outs = []
    for fns in ((kernels.permute, kernels.unpermute), (mcore_permute, mu.unpermute)):
        a = x.clone().requires_grad_()
        b = dense.clone().requires_grad_()
        xp, _, si = fns[0](a, rmap, probs=b, num_out_tokens=T * k)
        y = fns[1](xp * 2, si, a.shape, probs=b, routing_map=rmap)
        y.float().pow(2).sum().backward()
        outs.append((y, a.grad, b.grad))
    assert_bit_equal(outs[0][0], outs[1][0])
    assert_bit_equal(outs[0][1], outs[1][1])  # grad of tokens: gather + scaled, exact
    torch.testing.assert_close(outs[0][2], outs[1][2], rtol=1e-5, atol=1e-5)


def test_hierarchical_layout_small_example():
    # nodes=2, local=2: blocks (n0,l0)=A (1 row), (n0,l1)=B (2), (n1,l0)=C (0), (n1,l1)=D (3)
    x = torch.arange(6.0).unsqueeze(1)  # A=[0], B=[1,2], C=[], D=[3,4,5]
    y, s = kernels.hierarchical_layout(x, [1, 2, 0, 3], nodes=2, local=2)
    # (local, node) order: (l0,n0)=A, (l0,n1)=C, (l1,n0)=B, (l1,n1)=D
    assert s == [1, 0, 2, 3]
    assert y.flatten().tolist() == [0, 1, 2, 3, 4, 5]
    y, s = kernels.hierarchical_layout(torch.arange(6.0), [2, 1, 0, 3], nodes=2, local=2)
    # A=[0,1], B=[2], C=[], D=[3,4,5] -> A, C, B, D
    assert s == [2, 0, 1, 3] and y.tolist() == [0, 1, 2, 3, 4, 5]
    y, s = kernels.hierarchical_layout(torch.arange(4.0), [1, 1, 1, 1], nodes=2, local=2)
    assert y.tolist() == [0, 2, 1, 3]


@pytest.mark.parametrize("nodes,local", [(2, 4), (3, 2), (1, 5), (4, 1)])
@pytest.mark.parametrize("backend", ["torch", "reference"])
def test_hierarchical_layout_roundtrip(nodes, local, backend):
    g = torch.Generator().manual_seed(nodes * 10 + local)
    sizes = torch.randint(0, 4, (nodes * local,), generator=g)
    sizes[0] = 0  # a rank receiving nothing
    x = torch.randn(int(sizes.sum()), 3, 2, generator=g)
    with kernels.use_backend(backend):
        y, s = kernels.hierarchical_layout(x, sizes, nodes, local)
        z, s2 = kernels.hierarchical_layout(y, s, nodes, local, inverse=True)
    assert torch.is_tensor(s) and torch.equal(s2, sizes)
    assert torch.equal(z, x)
    want, ws = ref.hierarchical_layout(x, sizes.tolist(), nodes, local)
    assert torch.equal(y, want) and s.tolist() == ws
    xr = x.double().requires_grad_()
    with kernels.use_backend(backend):
        assert torch.autograd.gradcheck(
            lambda a: kernels.hierarchical_layout(a, sizes, nodes, local)[0], (xr,))


def test_pool_never_hands_out_a_held_buffer():
    T, E, k, h = 1024, 8, 2, 512  # outputs of several MB -> pooled
    _, _, rmap, dense = make_routing(T, E, k, seed=1)
    x1, x2 = torch.randn(T, h), torch.randn(T, h)
    a = kernels.permute(x1, rmap, dense)[0]
    a_copy = a.clone()
    b = kernels.permute(x2, rmap, dense)[0]
    assert a.data_ptr() != b.data_ptr()
    assert torch.equal(a, a_copy)
    ptr = b.data_ptr()
    del b
    c = kernels.permute(x2, rmap, dense)[0]  # b's buffer is free again: reused
    assert c.data_ptr() == ptr
    view = c[:10]
    del c
    d = kernels.permute(x1, rmap, dense)[0]  # a view keeps c's buffer alive
    assert d.data_ptr() != ptr and torch.equal(view, x2[mcore_permute(x2, rmap)[2][:10]])
    kernels.empty_cache()


@pytest.mark.parametrize("h", [4, 1024])  # unpooled and pooled outputs
def test_outputs_can_be_modified_in_place(h):
    T = 600
    _, _, rmap, dense = make_routing(T, 4, 2, seed=3)
    x = torch.randn(T, h, requires_grad=True)
    xp, _, si = kernels.permute(x, rmap, dense)
    xp.mul_(2)
    y = kernels.unpermute(xp, si, x.shape, probs=dense, routing_map=rmap)
    y.add_(1)
    y.sum().backward()
    # d/dx of sum_t sum_copies 2 * x[t] * p = 2 * sum of the token's probs
    torch.testing.assert_close(x.grad, 2 * dense.sum(1, keepdim=True).expand(T, h))


def test_thread_setting_restored(monkeypatch):
    monkeypatch.setattr(kops, "_CHUNK_THREADS", 1)
    before = torch.get_num_threads()
    _, _, rmap, dense = make_routing(50, 4, 2, seed=3)
    x = torch.randn(50, 8, requires_grad=True)
    xp, _, si = kernels.permute(x, rmap, dense)
    kernels.unpermute(xp, si, x.shape, probs=dense, routing_map=rmap).sum().backward()
    assert torch.get_num_threads() == before


def test_bad_inputs_raise_clear_errors():
    idx = torch.tensor([[0, 1], [1, 1]])
    with pytest.raises(ValueError, match="same expert twice"):
        kernels.routing_layout(idx, 4)
    with pytest.raises(ValueError, match="num_experts=2"):
        kernels.routing_layout(torch.tensor([[0, 3]]), 2)
    with pytest.raises(ValueError, match="pad_to_capacity"):
        kernels.routing_layout(torch.tensor([[0, 1]]), 2, pad_to_capacity=True)
    with pytest.raises(ValueError, match="experts_per_rank"):
        kernels.routing_layout(torch.tensor([[0, 1]]), 4, experts_per_rank=3)
    with pytest.raises(ValueError, match="sum"):
        kernels.hierarchical_layout(torch.zeros(3), [1, 1, 0, 0], 2, 2)
    with pytest.raises(ValueError, match="nodes\\*local"):
        kernels.hierarchical_layout(torch.zeros(3), [1, 2], 2, 2)
    with pytest.raises(ValueError, match="routing_map must be given"):
        kernels.unpermute(torch.zeros(2, 1), torch.tensor([0, 1]), torch.Size([2, 1]),
                          probs=torch.ones(2, 2))
    lay = kernels.routing_layout(torch.tensor([[0, 1], [1, 2]]), 3)
    with pytest.raises(ValueError, match="expected \\[2, 2\\]"):
        kernels.permute_tokens(torch.zeros(2, 4), lay, torch.ones(2, 3))
    with pytest.raises(ValueError, match="expert_out has 3 rows, expected 4"):
        kernels.unpermute_tokens(torch.zeros(3, 4), lay)
    with pytest.raises(ValueError, match="MOE_KERNELS_BACKEND|expected one of"):
        kernels.set_backend("cuda-magic")
