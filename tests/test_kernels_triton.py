"""Every Triton kernel in kernels/triton_kernels.py, run on the CPU under TRITON_INTERPRET=1,
against the pure-torch reference: exact for layouts/permutations, tight tolerance for weighted
sums; gradcheck in float64.  Shapes are tiny: the interpreter runs each program in Python."""

import os
import subprocess
import sys

# must precede the first import of triton (its language functions are decorated at import)
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

import kernels  # noqa: E402
from kernels import reference as ref  # noqa: E402

from tests.test_kernels import CASES, LAYOUT_FIELDS, make_routing  # noqa: E402


def _runnable_here() -> bool:
    if torch.cuda.is_available():
        return True
    from triton.runtime.interpreter import InterpretedFunction

    # triton imported earlier in this process (e.g. by megatron-core) without the interpreter
    return isinstance(tl.zeros, InterpretedFunction)


IN_PROCESS = _runnable_here()
if IN_PROCESS:
    from kernels import triton_kernels as tk  # noqa: E402

# one of the two sets runs: the kernels here, or this whole file again in a clean subprocess
needs_interp = pytest.mark.skipif(not IN_PROCESS, reason="run by test_in_clean_subprocess")


@pytest.mark.skipif(IN_PROCESS, reason="interpreter active in this process")
def test_in_clean_subprocess():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if os.environ.get("_KERNELS_TRITON_CHILD"):
        pytest.fail("TRITON_INTERPRET=1 did not take effect in the clean subprocess")
    env = dict(os.environ, TRITON_INTERPRET="1", _KERNELS_TRITON_CHILD="1")
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        os.path.abspath(__file__)], cwd=root, env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert " passed" in r.stdout, r.stdout[-500:]


mu = pytest.importorskip("megatron.core.transformer.moe.moe_utils")


@pytest.fixture(autouse=True)
def triton_backend():
    torch.manual_seed(0)
    if not IN_PROCESS:
        yield
        return
    with kernels.use_backend("triton"):
        yield


@needs_interp
@pytest.mark.parametrize("T,E,k,cap,pad", CASES + [(70, 5, 3, 9, True), (130, 3, 2, None, False)])
@pytest.mark.parametrize("form", ["topk", "map"])
def test_layout_kernels_exact(T, E, k, cap, pad, form):
    # T=130 spans two token blocks: block prefixes must chain
    idx, _, rmap, _ = make_routing(T, E, k, seed=T * 3 + k)
    if form == "topk":
        want = ref.routing_layout(idx, E, cap, pad, experts_per_rank=1)
        got = kernels.routing_layout(idx, E, cap, pad, experts_per_rank=1)
    else:
        want = ref.routing_layout_from_map(rmap, cap, pad)
        got = kernels.routing_layout_from_map(rmap, cap, pad)
    for f in LAYOUT_FIELDS:
        assert torch.equal(getattr(got, f), getattr(want, f)), f
    if form == "topk":
        assert torch.equal(got.tokens_per_rank, want.tokens_per_rank)


@needs_interp
def test_layout_rank_with_zero_tokens():
    idx, _, _, _ = make_routing(20, 8, 2, seed=1, avoid=(2, 3))
    lay = kernels.routing_layout(idx, 8, experts_per_rank=2)
    assert lay.tokens_per_rank.tolist()[1] == 0
    assert torch.equal(lay.row_map, ref.routing_layout(idx, 8).row_map)


@needs_interp
@pytest.mark.parametrize("T,E,k,cap,pad", [(19, 8, 2, None, False), (21, 8, 8, 9, True),
                                           (7, 4, 1, 2, False), (11, 16, 2, None, False)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_permute_combine_kernels(T, E, k, cap, pad, dtype):
    idx, p, _, _ = make_routing(T, E, k, seed=2)
    lay = ref.routing_layout(idx, E, cap, pad)
    x = torch.randn(T, 33).to(dtype)  # odd hidden size: masked tail of the block
    y = torch.randn(lay.num_rows, 33).to(dtype)
    xp, pp = kernels.permute_tokens(x, lay, p)
    wx, wp = ref.permute_tokens(x, lay, p)
    assert torch.equal(xp, wx) and torch.equal(pp, wp)
    tol = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(kernels.unpermute_tokens(y, lay, p),
                               ref.unpermute_tokens(y, lay, p), **tol)
    torch.testing.assert_close(kernels.unpermute_tokens(y, lay), ref.unpermute_tokens(y, lay),
                               **tol)


@needs_interp
@pytest.mark.parametrize("drop_and_pad", [False, True])
def test_mcore_dropin_on_triton(drop_and_pad):
    T, E, k = 17, 8, 2
    _, _, rmap, dense = make_routing(T, E, k, seed=6)
    x = torch.randn(T, 20)
    nout = E * 3 if drop_and_pad else T * k
    want = mu.permute(x, rmap, probs=dense, num_out_tokens=nout, drop_and_pad=drop_and_pad)
    got = kernels.permute(x, rmap, probs=dense, num_out_tokens=nout, drop_and_pad=drop_and_pad)
    for a, b in zip(want, got):
        assert torch.equal(a, b)
    y = torch.randn(want[0].shape)
    for pr in (None, dense):
        w = mu.unpermute(y, want[2], x.shape, probs=pr, routing_map=rmap,
                         drop_and_pad=drop_and_pad)
        o = kernels.unpermute(y, want[2], x.shape, probs=pr, routing_map=rmap,
                              drop_and_pad=drop_and_pad)
        torch.testing.assert_close(o, w, rtol=1e-6, atol=1e-6)


@needs_interp
def test_gradcheck_triton():
    T, E, k, h = 4, 4, 2, 3
    idx, p, _, _ = make_routing(T, E, k, seed=3)
    lay = ref.routing_layout(idx, E)
    x = torch.randn(T, h, dtype=torch.float64, requires_grad=True)
    pr = p.double().requires_grad_()
    y = torch.randn(lay.num_rows, h, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: kernels.permute_tokens(a, lay, b), (x, pr))
    assert torch.autograd.gradcheck(lambda a, b: kernels.unpermute_tokens(a, lay, b), (y, pr))


@needs_interp
def test_row_dot_and_scaled_gather_kernels():
    g = torch.randn(5, 7)
    x = torch.randn(8, 7)
    rm = torch.tensor([4, 0, 0, 3, 2, 1, 4, 2])
    torch.testing.assert_close(tk.row_dot(g, rm, x), (g[rm] * x).sum(-1), rtol=1e-6, atol=1e-6)
    s = torch.rand(8)
    torch.testing.assert_close(tk.gather_rows(g, rm, scale=s, acc_dtype=torch.float32),
                               g[rm] * s[:, None])


@needs_interp
@pytest.mark.parametrize("nodes,local", [(2, 3), (3, 2)])
def test_hierarchical_layout_triton(nodes, local):
    sizes = torch.tensor([2, 0, 3, 1, 0, 4])
    x = torch.randn(int(sizes.sum()), 5)
    y, s = kernels.hierarchical_layout(x, sizes, nodes, local)
    want, ws = ref.hierarchical_layout(x, sizes, nodes, local)
    assert torch.equal(y, want) and torch.equal(s, ws)
    z, _ = kernels.hierarchical_layout(y, s, nodes, local, inverse=True)
    assert torch.equal(z, x)
