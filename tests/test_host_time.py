"""The performance section's host-time breakdown (megatron_moe/gpucheck/host_time.py): each
function's own time to its file's package, a C function's time to its Python callers."""

import types

import pytest
import torch

from megatron_moe.gpucheck import host_time

OURS = ("/x/megatron_moe/moe/a.py", 1, "f")
CORE = ("/y/megatron/core/b.py", 2, "g")
ADD = ("~", 0, "<built-in method add>")
STATS = types.SimpleNamespace(stats={
    OURS: (1, 1, 0.010, 0.050, {}),
    CORE: (1, 1, 0.001, 0.011, {}),
    # the C op: 30 ms of it called from ours, 10 ms from megatron-core, 5 ms from C (no caller)
    ADD: (3, 3, 0.045, 0.045, {OURS: (1, 1, 0.030, 0.030), CORE: (1, 1, 0.010, 0.010)}),
})


def _check(b):
    assert b["by_package_s"]["megatron_moe"] == pytest.approx(0.040)
    assert b["by_package_s"]["megatron.core"] == pytest.approx(0.011)
    assert b["by_package_s"]["other"] == pytest.approx(0.005)
    assert b["total_s"] == pytest.approx(0.056)
    assert b["top"][0][0].startswith("megatron_moe:a.py:1 f")


def test_c_time_goes_to_the_python_caller():
    _check(host_time.breakdown(STATS, iterations=1))
    half = host_time.breakdown(STATS, iterations=2)
    assert half["total_s"] == pytest.approx(0.028)


def test_without_charging_callers_the_split_is_wrong(monkeypatch):
    # mutation: C functions treated as files of their own (no caller charged)
    monkeypatch.setattr(host_time, "_is_c", lambda func: False)
    with pytest.raises(AssertionError):
        _check(host_time.breakdown(STATS, iterations=1))


def test_a_real_profile_charges_our_ops_to_us():
    from megatron.core.transformer.moe import moe_utils

    from megatron_moe.moe.dispatcher import sort_chunks_by_idxs

    x = torch.randn(4096, 64)
    sizes, order = torch.tensor([1024, 1024, 2048]), torch.tensor([2, 0, 1])
    with host_time.HostProfile() as hp:
        for _ in range(20):
            sort_chunks_by_idxs(x, sizes, order)
            moe_utils.sort_chunks_by_idxs(x, sizes, order)
    b = hp.breakdown(iterations=20)
    assert b["by_package_s"]["megatron_moe"] > 0 and b["by_package_s"]["megatron.core"] > 0
    assert "megatron_moe:dispatcher.py" in " ".join(name for name, _ in b["top"])
    assert "host time per iteration" in host_time.format_breakdown(b)
