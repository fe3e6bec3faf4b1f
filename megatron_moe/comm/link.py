"""An emulated expert-parallel network link for the MoE data path (``--moe-ep-link-gbps``).

On one CPU host the ranks' "network" is local memory: a Trans, an Agg or an all-to-all costs next
to nothing against the expert compute, so nothing that hides or avoids communication (the
Pro-Prophet scheduler, Eq. 8, shadowing decisions) can show what it does on a cluster. With a link
configured, every transfer of this package pays the time it would take on a link of that bandwidth,
as a wait that uses no CPU (so an overlapped transfer really is hidden behind compute):

* each rank has one outgoing link, a FIFO timeline: a transfer issued at ``t`` occupies it from
  ``max(t, link free)`` for ``bytes / bandwidth`` (full duplex; receive sides are not modelled);
* point-to-point sends (``comm.isend``: Trans, Agg, replica moves, sum-back) are issued to the peer
  by a link thread at the end of their window, so the data lands at the receiver then, and the
  receiver's ``irecv`` needs no change;
* an all-to-all occupies the link for the larger of the bytes the rank sends to and receives from
  other ranks: a blocking one from when its real exchange has completed, an asynchronous one (the
  chunked schedules, the balanced layer's dispatch) from when it is issued, and its ``wait`` blocks
  until the window ends, so work done between issue and wait hides it. A peer that issues late
  delays the real exchange only (its lateness is not added to the window).

Stats (``stats()``): bytes and windows per kind, ``busy_s`` (this rank's emulated sending time) and
``exposed_s`` (time this rank blocked on transfers: its sends' and receives' waits and its
all-to-alls, real exchange and window; a receive or an exchange also waits for a late peer, so this
is what the rank lost to communication, not to its own link alone).

Why hand-written: torch.distributed has no traffic shaping, and ``offload/link.py``'s CopyLink
throttles local copies, not messages to a peer.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Optional

import torch.distributed as dist

__all__ = ["configure", "active", "stats", "reset_stats", "send", "recv", "exchange_window", "reserve_exchange",
           "wait_until"]

_LINK: Optional["_Link"] = None


class _SendHandle:
    def __init__(self, link, job):
        self.link, self.job = link, job

    def wait(self):
        t0 = time.perf_counter()
        self.job["issued"].wait()
        if self.job.get("error") is not None:
            raise self.job["error"]
        self.job["work"].wait()
        self.link._add(exposed_s=time.perf_counter() - t0)


class _TimedHandle:
    """A receive's work handle whose blocked time counts as exposed."""

    def __init__(self, link, work):
        self.link, self.work = link, work

    def wait(self):
        t0 = time.perf_counter()
        self.work.wait()
        self.link._add(exposed_s=time.perf_counter() - t0)


class _Link:
    def __init__(self, gbps: float):
        self.bps = float(gbps) * 1e9
        self.free_at = 0.0
        self.lock = threading.Lock()
        self.q: "queue.Queue" = queue.Queue()
        self.thread: Optional[threading.Thread] = None
        self.reset_stats()

    def reset_stats(self):
        self._stats = {"p2p_bytes": 0, "p2p_windows": 0, "a2a_bytes": 0, "a2a_windows": 0,
                       "busy_s": 0.0, "exposed_s": 0.0}

    def _add(self, **kv):
        with self.lock:
            for k, v in kv.items():
                self._stats[k] += v

    def reserve(self, nbytes: int, kind: str) -> float:
        """Occupy the link for ``nbytes`` from now (or when it frees); the window's end."""
        dur = nbytes / self.bps
        with self.lock:
            start = max(time.perf_counter(), self.free_at)
            self.free_at = start + dur
            self._stats[kind + "_bytes"] += nbytes
            self._stats[kind + "_windows"] += 1
            self._stats["busy_s"] += dur
            return self.free_at

    def _run(self):
        while True:
            job = self.q.get()
            if job is None:
                return
            self._hold_until(job["end"])
            try:
                job["work"] = dist.isend(*job["args"], **job["kwargs"])
            except Exception as exc:           # surfaced by the handle's wait
                job["error"] = exc
            job["issued"].set()

    @staticmethod
    def _hold_until(end):
        """A send is issued at the end of its window (a test leaves this out: sent at once)."""
        delay = end - time.perf_counter()
        if delay > 0:
            time.sleep(delay)

    def send(self, t, dst_global, group, tag):
        end = self.reserve(t.numel() * t.element_size(), "p2p")
        if self.thread is None:
            self.thread = threading.Thread(target=self._run, name="moe-ep-link", daemon=True)
            self.thread.start()
        job = {"end": end, "args": (t, dst_global, group), "kwargs": {"tag": tag},
               "issued": threading.Event(), "work": None, "error": None}
        self.q.put(job)
        return _SendHandle(self, job)

    def close(self):
        if self.thread is not None:
            self.q.put(None)
            self.thread.join(timeout=60)
            self.thread = None


def configure(gbps: Optional[float]) -> None:
    """Emulate a link of ``gbps`` GB/s (1e9 bytes/s) for this process's MoE transfers; None: off."""
    global _LINK
    if gbps is not None and not gbps > 0:
        raise ValueError(f"--moe-ep-link-gbps must be > 0 (got {gbps})")
    if _LINK is not None:
        _LINK.close()
    _LINK = _Link(gbps) if gbps is not None else None


def active() -> bool:
    return _LINK is not None


def stats() -> dict:
    if _LINK is None:
        return {}
    with _LINK.lock:
        return dict(_LINK._stats)


def reset_stats() -> None:
    if _LINK is not None:
        _LINK.reset_stats()


def send(t, dst_global: int, group, tag: int):
    """``dist.isend`` through the link (caller: ``comm.isend``)."""
    return _LINK.send(t, dst_global, group, tag)


def recv(t, src_global: int, group, tag: int):
    """``dist.irecv``, its wait counted as exposed (caller: ``comm.irecv``)."""
    return _TimedHandle(_LINK, dist.irecv(t, src_global, group, tag=tag))


def reserve_exchange(nbytes: int) -> float:
    """An asynchronous all-to-all issued now: its window on the link (end time; 0 for no link)."""
    if _LINK is None or nbytes <= 0:
        return 0.0
    return _LINK.reserve(nbytes, "a2a")


def wait_until(end: float, since: Optional[float] = None) -> None:
    """Block until a reserved window ends; the caller blocked from ``since`` (default: now; its
    real exchange included) and that time counts as exposed."""
    if _LINK is None:
        return
    t0 = time.perf_counter()
    if end > t0:
        time.sleep(end - t0)
    _LINK._add(exposed_s=time.perf_counter() - (t0 if since is None else since))


def exchange_window(nbytes: int, since: Optional[float] = None) -> None:
    """A blocking all-to-all whose real exchange has completed: block for its window on the link."""
    if _LINK is None or nbytes <= 0:
        return
    wait_until(_LINK.reserve(nbytes, "a2a"), since)
