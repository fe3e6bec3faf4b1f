"""The emulated expert-parallel link (megatron_moe/comm/link.py, ``--moe-ep-link-gbps``).

What is checked: a send through ``comm.isend`` lands at the receiver no earlier than its window on
the sender's link ends (a lower bound that sleeping guarantees, not a performance figure), windows
queue FIFO on one link, an all-to-all blocks for the larger of its cross-rank send / receive bytes,
data arrive bit-exact, and each skipped step (mutation) shows: no wait, or no window.
"""

from __future__ import annotations

import argparse
import time

import pytest
import torch
import torch.distributed as dist

from megatron_moe import comm
from megatron_moe.comm import link
from megatron_moe.runtime.local_ranks import run_distributed

GBPS = 0.01          # 10 MB/s: 1 MB takes 0.1 s on the link
MB = 1 << 20


def _skipping(step):
    """Leave one step of the link out (the mutation), in this rank's process: ``send_window``
    issues each send at once, ``a2a_window`` does not block an all-to-all for its window."""
    if step == "send_window":
        link._Link._hold_until = staticmethod(lambda end: None)
    elif step == "a2a_window":
        link.wait_until = lambda end, since=None: None
    else:
        assert step is None, step


def _p2p_rank(rank, world, n_msgs, skip=None):
    _skipping(skip)
    link.configure(GBPS)
    group = dist.group.WORLD
    out = {}
    dist.barrier()
    # one clock for both ranks: perf_counter is CLOCK_MONOTONIC, system-wide on Linux, so the
    # receiver's landing times are read against the sender's issue time (each rank's own start
    # after the barrier differs by the ranks' scheduling: 1.5 ms on a loaded host made a send
    # look early)
    t0 = time.perf_counter()
    if rank == 0:
        payloads = [torch.full((MB // 4,), float(i + 1)) for i in range(n_msgs)]
        out["issued_at"] = t0
        works = [comm.isend(p, 1, group, tag=i) for i, p in enumerate(payloads)]
        out["issue_s"] = time.perf_counter() - t0        # issuing does not block
        for w in works:
            w.wait()
    else:
        bufs = [torch.empty(MB // 4) for _ in range(n_msgs)]
        works = [comm.irecv(b, 0, group, tag=i) for i, b in enumerate(bufs)]
        done = []
        for w in works:
            w.wait()
            done.append(time.perf_counter())
        out["done_at"] = done
        out["exact"] = all(bool((b == i + 1).all()) for i, b in enumerate(bufs))
    out["stats"] = link.stats()
    link.configure(None)
    return out


def _a2a_rank(rank, world, rows_to_peer):
    link.configure(GBPS)
    group = dist.group.WORLD
    row = 1024                                   # fp32 elements: 4 KB per row
    ins = [0] * world
    ins[rank] = 3
    for j in range(world):
        if j != rank:
            ins[j] = rows_to_peer[rank]
    outs = [rows_to_peer[j] if j != rank else 3 for j in range(world)]
    x = torch.arange(sum(ins) * row, dtype=torch.float32).reshape(-1, row) + 1e6 * rank
    y = comm.all_to_all(x, outs, ins, group)
    windows = link.stats()["a2a_windows"]
    link.configure(None)
    ref = torch.empty(sum(outs), row)
    dist.all_to_all_single(ref, x, outs, ins, group=group)
    return {"exact": bool(torch.equal(y, ref)), "windows": windows}


def _a2a_stats_rank(rank, world, rows_to_peer, skip=None):
    _skipping(skip)
    link.configure(GBPS)
    group = dist.group.WORLD
    row = 1024
    ins = [3 if j == rank else rows_to_peer[rank] for j in range(world)]
    outs = [3 if j == rank else rows_to_peer[j] for j in range(world)]
    x = torch.ones(sum(ins), row)
    dist.barrier()
    t0 = time.perf_counter()
    comm.all_to_all(x, outs, ins, group)
    elapsed = time.perf_counter() - t0
    st = link.stats()
    link.configure(None)
    return {"elapsed": elapsed, "stats": st}


def _async_rank(rank, world, work_s):
    """An asynchronous exchange issued, ``work_s`` of other work, then its wait."""
    link.configure(GBPS)
    group = dist.group.WORLD
    x = torch.ones(2 * 64, 1024)                 # 64 rows (256 KB) to the peer
    dist.barrier()
    t_issue = time.perf_counter()
    h = comm.all_to_all_async(x, [64, 64], [64, 64], group)
    time.sleep(work_s)
    t0 = time.perf_counter()
    h.wait()
    st = link.stats()
    link.configure(None)
    # gap_s: issue to wait (on a loaded host more than the sleep: that much of the window passed)
    return {"wait_s": time.perf_counter() - t0, "gap_s": t0 - t_issue, "stats": st}


def test_async_all_to_all_window_runs_from_its_issue():
    window = 64 * 4096 / (GBPS * 1e9)            # 26 ms
    out = run_distributed(_async_rank, 2, 8 * window, timeout_s=120, collective_timeout_s=60)
    for r in out:
        assert r["stats"]["a2a_windows"] == 1 and r["stats"]["a2a_bytes"] == 64 * 4096
        assert r["stats"]["exposed_s"] < window * 0.9    # the work between issue and wait hid it
    out = run_distributed(_async_rank, 2, 0.0, timeout_s=120, collective_timeout_s=60)
    for r in out:   # nothing to hide behind: the wait pays what the issue-to-wait gap did not
        left = window - r["gap_s"]
        assert r["wait_s"] >= left * 0.9 and r["stats"]["exposed_s"] >= left * 0.9, (r, window)


def test_send_lands_after_its_window_and_windows_queue():
    out = run_distributed(_p2p_rank, 2, 3, timeout_s=120, collective_timeout_s=60)
    sender, receiver = out[0], out[1]
    assert sender["stats"]["p2p_bytes"] == 3 * MB and sender["stats"]["p2p_windows"] == 3
    assert sender["stats"]["busy_s"] == pytest.approx(3 * MB / (GBPS * 1e9))
    assert receiver["stats"]["p2p_windows"] == 0          # receives are not modelled ...
    assert receiver["stats"]["exposed_s"] >= 3 * MB / (GBPS * 1e9) * 0.9   # ... but their waits count
    assert receiver["exact"]
    # FIFO on one link: the k-th message cannot land before k windows have passed
    window = MB / (GBPS * 1e9)
    for k, t in enumerate(receiver["done_at"], start=1):
        assert t - sender["issued_at"] >= k * window * 0.99, (k, t - sender["issued_at"])
    assert sender["issue_s"] < 3 * window * 0.95        # isend did not wait for the windows


def test_send_window_skipped_is_visible():
    out = run_distributed(_p2p_rank, 2, 3, "send_window", timeout_s=120, collective_timeout_s=60)
    window = MB / (GBPS * 1e9)
    # the mutation sends at once: the last of three 0.1 s windows cannot have been waited for
    assert out[1]["done_at"][-1] - out[0]["issued_at"] < 3 * window * 0.99
    assert out[1]["exact"]


def test_all_to_all_blocks_for_the_larger_of_send_and_receive():
    rows = [64, 16]          # rank 0 sends 64 rows (256 KB) to rank 1, receives 16 (64 KB)
    out = run_distributed(_a2a_stats_rank, 2, rows, timeout_s=120, collective_timeout_s=60)
    row_bytes = 1024 * 4
    for r in range(2):
        st = out[r]["stats"]
        assert st["a2a_windows"] == 1 and st["a2a_bytes"] == 64 * row_bytes       # max(send, recv)
        assert out[r]["elapsed"] >= 64 * row_bytes / (GBPS * 1e9) * 0.99
        assert st["exposed_s"] >= 64 * row_bytes / (GBPS * 1e9) * 0.99


def test_all_to_all_window_skipped_is_visible():
    out = run_distributed(_a2a_stats_rank, 2, [64, 16], "a2a_window", timeout_s=120,
                          collective_timeout_s=60)
    for r in range(2):
        assert out[r]["stats"]["a2a_windows"] == 1 and out[r]["stats"]["exposed_s"] == 0.0


def test_all_to_all_output_unchanged_by_the_link():
    out = run_distributed(_a2a_rank, 3, [5, 0, 7], timeout_s=120, collective_timeout_s=60)
    assert all(o["exact"] and o["windows"] == 1 for o in out)


def test_flag_refused_at_parse_time(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    p = comm.add_arguments(argparse.ArgumentParser())
    args = p.parse_args(["--moe-ep-link-gbps", "0"])
    with pytest.raises(ValueError, match="--moe-ep-link-gbps"):
        comm.validate_args(args)
    comm.validate_args(p.parse_args(["--moe-ep-link-gbps", "2.5"]))
    with pytest.raises(ValueError, match="--moe-ep-link-gbps"):
        link.configure(-1.0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(ValueError, match="--moe-ep-link-gbps emulates a network on CPU"):
        comm.validate_args(p.parse_args(["--moe-ep-link-gbps", "2.5"]))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the flag is refused on a GPU machine (CPU emulation)")
def test_training_behind_the_link_logs_it_and_keeps_the_math(capfd):
    """pretrain() with --moe-ep-link-gbps: megatron-core's dispatcher (no balance policy) and the
    balanced layer (Trans/Agg) both pay the link, the [moe] line reports it, and the loss is what
    plain EP gives (the link only delays)."""
    from tests._train_cases import run_pretrain
    from tests.test_balance_training import TINY

    argv = TINY + ["--moe-ep-link-gbps", "0.5"]
    plain = run_distributed(run_pretrain, 2, argv, timeout_s=300)[0]
    out_plain = capfd.readouterr().out
    ours = run_distributed(run_pretrain, 2, argv + ["--moe-balance-policy", "proprophet", "--moe-balance-alpha", "0",
                                                    "--moe-balance-overlap"], timeout_s=300)[0]
    out_ours = capfd.readouterr().out
    assert ours["lm_loss"] == pytest.approx(plain["lm_loss"], rel=1e-4, abs=1e-5)

    def link_lines(out):
        lines = [l for l in out.splitlines() if "[moe] ep link (emulated)" in l]
        assert len(lines) == 3, out[-3000:]                 # one per logged iteration (3, interval 1)
        return [{k.strip(): float(v.split("|")[0]) for k, v in
                 (f.split(":") for f in l.split("|")[1:] if ":" in f)} for l in lines]

    for d in link_lines(out_plain):
        assert d["all-to-all MB"] > 0 and d["p2p MB"] == 0
    assert any(d["p2p MB"] > 0 for d in link_lines(out_ours))   # Trans/Agg on the link
