"""The CUDA path of permute/unpermute (the Triton backend) makes no host synchronisation, forward
and backward; the ones that must stay are exactly the documented ones (docs/kernels.md).  Counted
on the CPU with kernels.sync_audit (a TorchDispatchMode standing in for
torch.cuda.set_sync_debug_mode), the kernels running under TRITON_INTERPRET=1."""

import os
import subprocess
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

import kernels  # noqa: E402
from kernels import ops  # noqa: E402
from kernels.sync_audit import count_host_syncs  # noqa: E402
from tests.test_kernels import make_routing  # noqa: E402


def _runnable_here() -> bool:
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(tl.zeros, InterpretedFunction)


IN_PROCESS = _runnable_here()
needs_interp = pytest.mark.skipif(not IN_PROCESS, reason="run by test_in_clean_subprocess")
mu = pytest.importorskip("megatron.core.transformer.moe.moe_utils")
from megatron_moe.compat.dispatch import mcore_permute  # noqa: E402  (0.16 contract, any version)


@pytest.mark.skipif(IN_PROCESS, reason="interpreter active in this process")
def test_in_clean_subprocess():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if os.environ.get("_KERNELS_SYNC_CHILD"):
        pytest.fail("TRITON_INTERPRET=1 did not take effect in the clean subprocess")
    env = dict(os.environ, TRITON_INTERPRET="1", _KERNELS_SYNC_CHILD="1")
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        os.path.abspath(__file__)], cwd=root, env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert " passed" in r.stdout, r.stdout[-500:]


@pytest.fixture
def launches(monkeypatch):
    """Triton kernel launches by name: proves the GPU path ran."""
    from triton.runtime.interpreter import GridExecutor

    seen = []
    orig = GridExecutor.__call__

    def call(self, *a, **k):
        seen.append(self.fn.__name__)
        return orig(self, *a, **k)

    monkeypatch.setattr(GridExecutor, "__call__", call)
    with kernels.use_backend("triton"):
        yield seen


@needs_interp
@pytest.mark.parametrize("pad", [False, True])
def test_topk_api_no_sync(launches, pad):
    T, E, k, h = 24, 8, 2, 16
    idx, p, _, _ = make_routing(T, E, k, seed=1)
    # seeded: the row-dot gradient sums in another order than the reference, and an unseeded draw
    # once landed 1.55e-6 off on two elements (CI, session 33)
    x = torch.randn(T, h, generator=torch.Generator().manual_seed(1), requires_grad=True)
    p = p.clone().requires_grad_(True)
    cap = 5 if pad else None
    with count_host_syncs() as syncs:
        lay = kernels.routing_layout(idx, E, capacity=cap, pad_to_capacity=pad)
        y, _ = kernels.permute_tokens(x, lay)
        out = kernels.unpermute_tokens(y * 2, lay, p)
        out.sum().backward()
    assert syncs == [], syncs
    assert {"_layout_count_kernel", "_layout_scatter_kernel", "_gather_rows_kernel",
            "_combine_kernel", "_row_dot_kernel"} <= set(launches), launches
    gx, gp = x.grad.clone(), p.grad.clone()
    x.grad = p.grad = None
    with kernels.use_backend("reference"):
        lay = kernels.routing_layout(idx, E, capacity=cap, pad_to_capacity=pad)
        want = kernels.unpermute_tokens(kernels.permute_tokens(x, lay)[0] * 2, lay, p)
        want.sum().backward()
    torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(gx, x.grad, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(gp, p.grad, rtol=1e-6, atol=1e-6)


@needs_interp
@pytest.mark.parametrize("drop_and_pad", [False, True])
def test_mcore_dropin_no_sync(launches, drop_and_pad):
    """megatron-core's dispatchers call permute with num_out_tokens (a host int) and unpermute with
    or without probs; neither reads anything back from the device."""
    T, E, k, h = 17, 8, 2, 12
    _, _, rmap, dense = make_routing(T, E, k, seed=6)
    x = torch.randn(T, h, generator=torch.Generator().manual_seed(6), requires_grad=True)
    nout = E * 3 if drop_and_pad else T * k
    probs = dense.clone().requires_grad_(True)
    with count_host_syncs() as syncs:
        y, _, idx = kernels.permute(x, rmap, num_out_tokens=nout, drop_and_pad=drop_and_pad)
        o1 = kernels.unpermute(y, idx, x.shape, routing_map=rmap, drop_and_pad=drop_and_pad)
        o2 = kernels.unpermute(y, idx, x.shape, probs=probs, routing_map=rmap,
                               drop_and_pad=drop_and_pad)
        (o1.sum() + o2.square().sum()).backward()
    assert syncs == [], syncs
    assert "_combine_kernel" in launches and "_layout_scatter_kernel" in launches
    wy, _, widx = mcore_permute(x.detach(), rmap, num_out_tokens=nout, drop_and_pad=drop_and_pad)
    assert torch.equal(y, wy) and torch.equal(idx, widx)
    w2 = mu.unpermute(wy, widx, x.shape, probs=dense, routing_map=rmap, drop_and_pad=drop_and_pad)
    torch.testing.assert_close(o2, w2, rtol=1e-6, atol=1e-6)


@needs_interp
def test_documented_syncs_stay_and_are_counted(launches):
    """The output size of the map form without num_out_tokens, and of capacity dropping without
    padding, is data-dependent: one read-back each (docs/kernels.md)."""
    T, E, k = 20, 8, 2
    idx, _, rmap, _ = make_routing(T, E, k, seed=2)
    x = torch.randn(T, 8, generator=torch.Generator().manual_seed(2))
    with count_host_syncs() as s1:
        kernels.permute(x, rmap)                       # no num_out_tokens
    with count_host_syncs() as s2:
        kernels.routing_layout(idx, E, capacity=3)     # dropping, no padding
    assert [op for op, _ in s1] == ["aten._local_scalar_dense.default"], s1
    assert [op for op, _ in s2] == ["aten._local_scalar_dense.default"], s2
    assert "triton_kernels.py" in s1[0][1]


def test_counter_sees_each_kind_of_sync():
    """Mutation control: the counter flags what would block a GPU host, and nothing else."""
    t = torch.arange(6)
    with count_host_syncs() as s:
        t.sum().item()
        t.tolist()
        t.nonzero()
        t[t > 2]
        torch.repeat_interleave(t[:3], t[:3])
        torch.bincount(t)
        t.cpu()
        if t[0]:
            pass
    names = [op for op, _ in s]
    assert len(names) == 8, names
    with count_host_syncs() as s:
        torch.repeat_interleave(t[:3], t[:3], output_size=3)
        torch.sort(t, stable=True)
        torch.searchsorted(t, t)
        torch.cumsum(t, 0)
    assert s == [], s
    # the host-side inverse map the Triton combine used before (max copies read back, a Python
    # loop over levels) is caught
    with count_host_syncs() as s:
        ops._combine_plan(torch.tensor([0, 1, 0, 2]), 3)
    assert s, "the old combine plan's int(counts.max()) went unseen"
