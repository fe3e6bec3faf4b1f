"""megatron_moe/offload/link.py: the throttled copy link and the fixed-slot arena."""

import time

import pytest
import torch

from megatron_moe.offload.link import CopyLink, SlotArena


def test_copy_is_exact_and_counted():
    link = CopyLink()
    src = [torch.randn(1000), torch.randn(37, 3)]
    dst = [torch.empty(1000), torch.empty(37, 3)]
    h = link.copy(zip(dst, src))
    h.wait()
    assert all(torch.equal(d, s) for d, s in zip(dst, src))
    s = link.stats()
    assert s["bytes"] == (1000 + 111) * 4 and s["copies"] == 1 and s["waits"] == 1
    link.close()


def test_throttle_and_exposed_wait():
    # 4 MB at 0.2 GB/s = 20 ms of link time; waiting at once exposes most of it
    link = CopyLink(gbps=0.2)
    src, dst = torch.ones(1_000_000), torch.empty(1_000_000)
    t0 = time.perf_counter()
    link.copy([(dst, src)]).wait()
    assert time.perf_counter() - t0 >= 0.019
    s = link.stats()
    assert s["copy_s"] >= 0.019 and s["blocked_waits"] == 1 and s["hidden_fraction"] < 0.5
    # overlapped: compute (a sleep) longer than the copy hides it entirely
    link.reset_stats()
    h = link.copy([(dst, src)])
    time.sleep(0.05)
    assert h.done()
    h.wait()
    s = link.stats()
    assert s["blocked_waits"] == 0 and s["hidden_fraction"] > 0.9
    link.close()


def test_fifo_submit_and_errors():
    link = CopyLink()
    order = []
    hs = [link.submit(lambda i=i: order.append(i) or i, nbytes=8) for i in range(5)]
    assert [h.wait() for h in hs] == list(range(5)) and order == list(range(5))
    assert link.stats()["bytes"] == 40 and link.stats()["copies"] == 0

    def boom():
        raise OSError("disk gone")
    with pytest.raises(OSError, match="disk gone"):
        link.submit(boom).wait()
    link.close()
    with pytest.raises(RuntimeError, match="closed"):
        link.submit(lambda: None)


def test_arena_slots_peak_and_nan_fill():
    arena = SlotArena({torch.float32: 10, torch.int64: 2}, 3, nan_fill=True)
    assert arena.slot_bytes == 10 * 4 + 2 * 8 and arena.capacity_bytes == 3 * 56
    a, b = arena.acquire(), arena.acquire()
    assert arena.peak_bytes() == 2 * 56 and arena.free_slots() == 1
    arena.slot(a)[torch.float32].fill_(1.0)
    arena.release(a)
    assert torch.isnan(arena.slot(a)[torch.float32]).all()  # a missing wait would read NaN
    assert (arena.slot(a)[torch.int64] == -1).all()
    with pytest.raises(RuntimeError, match="released twice"):
        arena.release(a)
    arena.acquire(), arena.acquire()
    with pytest.raises(RuntimeError, match="in use"):
        arena.acquire()
    assert arena.peak_bytes() == 3 * 56
    arena.release(b)
    arena.acquire()
    assert arena.peak_bytes() == 3 * 56  # bounded: a slot's storage is reused, never grown


def test_missing_wait_reads_nan():
    """The debug mode's point: copying into a NaN-filled slot and reading without waiting fails."""
    link = CopyLink(gbps=0.05)  # 4 MB -> 80 ms
    arena = SlotArena({torch.float32: 1_000_000}, 1, nan_fill=True)
    i = arena.acquire()
    arena.release(i)
    i = arena.acquire()
    h = link.copy([(arena.slot(i)[torch.float32], torch.ones(1_000_000))])
    early = arena.slot(i)[torch.float32].sum()  # no wait: the copy has not landed
    h.wait()
    late = arena.slot(i)[torch.float32].sum()
    assert torch.isnan(early) and late.item() == 1_000_000
    link.close()
