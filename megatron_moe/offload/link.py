"""Copy link and fixed-slot device arena, shared by expert offload (training) and ring memory
(inference).

API (stable; other packages import it)::

    link = CopyLink(gbps=None, device=None, jitter_s=0.0)
        # A FIFO copy engine: one background thread (CPU), plus a side CUDA stream on GPU.
        # gbps: throttle to this bandwidth (GB/s = 1e9 bytes/s): each job first sleeps for
        # bytes/bandwidth, then copies, so data lands at the end of its transfer window (the
        # memcpy itself adds its own time). None: as fast as memcpy goes.
        # jitter_s: debug, add a random 0..jitter_s delay per job so that a missing wait shows.
    h = link.copy([(dst, src), ...], after=None)   # dst.copy_(src) for each pair, in order
        # after: a torch.cuda.Event the copies must wait for (e.g. compute done with a slot);
        # ignored on CPU (the caller's thread already finished that work).
    h = link.submit(fn, nbytes=0)                  # run fn() on the copy thread (e.g. an SSD
                                                   # read), FIFO with the copies; nbytes counts
    h.done() -> bool                               # finished (without blocking)
    h.wait()                                       # block until finished; the blocked time is
                                                   # the link's exposed wait; re-raises errors
    h.result                                       # fn()'s return value (submit), after wait
    link.stats() -> dict(bytes=, copies=, copy_s=, wait_s=, waits=, blocked_waits=,
                         hidden_fraction=)  # hidden_fraction = 1 - exposed wait / copy time
    link.drain()                                   # block until every queued job ran and landed
    link.reset_stats(); link.close()

    arena = SlotArena(slot_numel, slots, device=None, nan_fill=False)
        # at most `slots` fixed slots of {dtype: numel} flat tensors each, each allocated once.
        # nan_fill (--moe-offload-debug-nan-fill, --ring-memory-debug): a released slot is filled with NaN
        # (integer dtypes: -1) so that compute reading a slot whose copy it did not wait for
        # produces NaN instead of passing by luck.
    i = arena.acquire()          # a free slot index (RuntimeError if none is free); on CUDA a
                                 # newly allocated slot's ready_event is recorded on the
                                 # compute stream (pass it to the first link.copy(after=))
    arena.slot(i) -> {dtype: flat tensor}
    arena.release(i, after=None) # back to the free list (NaN-filled in debug mode); on CUDA,
                                 # `after` is the event after which the slot may be refilled,
                                 # kept in arena.ready_event(i) for the next link.copy(after=)
    arena.slot_bytes, arena.capacity_bytes, arena.in_use_bytes, arena.free_slots()
    arena.peak_bytes()           # device bytes the arena holds: its slots' storages, read from
                                 # the storages (a slot is allocated at its first acquire, kept)
    storage_bytes(tensors)       # bytes of the distinct storages behind tensors

Why hand-written: megatron-core's HybridDeviceOptimizer and GPUTensorPool are CUDA-only or
select by parameter order; nothing upstream offers a throttled CPU link for measuring overlap.
"""

from __future__ import annotations

import queue
import random
import threading
import time

import torch

__all__ = ["CopyLink", "CopyHandle", "SlotArena", "storage_bytes"]


class CopyHandle:
    """Event-like handle of one link job."""

    def __init__(self, link):
        self._link = link
        self._done = threading.Event()
        self._cuda_event = None
        self.error = None
        self.result = None
        self.nbytes = 0

    def done(self) -> bool:
        if not self._done.is_set():
            return False
        return self._cuda_event is None or self._cuda_event.query()

    def wait(self):
        t0 = time.perf_counter()
        blocked = not self.done()
        self._done.wait()
        if self._cuda_event is not None:
            # the compute stream waits on the copy stream; the host blocks only for accounting
            torch.cuda.current_stream().wait_event(self._cuda_event)
            if blocked:
                self._cuda_event.synchronize()
        self._link._record_wait(time.perf_counter() - t0, blocked)
        if self.error is not None:
            raise self.error
        return self.result


class CopyLink:
    def __init__(self, gbps: float | None = None, device=None, jitter_s: float = 0.0):
        if gbps is not None and gbps <= 0:
            raise ValueError(f"link bandwidth must be > 0 GB/s (got {gbps})")
        self.gbps = gbps
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.jitter_s = jitter_s
        self._stream = torch.cuda.Stream(device=self.device) if self.device.type == "cuda" else None
        self._queue: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self.reset_stats()
        self._thread = threading.Thread(target=self._run, name="offload-copy-link", daemon=True)
        self._thread.start()

    # --- submitting ------------------------------------------------------------------------------
    def copy(self, pairs, after=None) -> CopyHandle:
        pairs = list(pairs)
        nbytes = sum(s.numel() * s.element_size() for _, s in pairs)

        def job():
            for dst, src in pairs:
                dst.copy_(src, non_blocking=self._stream is not None)
        return self._put(job, nbytes, after, count_copy=True)

    def submit(self, fn, nbytes: int = 0, after=None) -> CopyHandle:
        return self._put(fn, nbytes, after, count_copy=False)

    def _put(self, fn, nbytes, after, count_copy):
        if self._thread is None:
            raise RuntimeError("CopyLink is closed")
        handle = CopyHandle(self)
        handle.nbytes = nbytes
        self._queue.put((fn, handle, after, count_copy))
        return handle

    # --- the copy thread -------------------------------------------------------------------------
    def _run(self):
        while True:
            item = self._queue.get()
            if item is None:
                return
            fn, handle, after, count_copy = item
            t0 = time.perf_counter()
            try:
                # The data lands at the END of its transfer window (sleep first, then copy), so
                # reading a slot without waiting sees the old (NaN) contents, as on a real link.
                if self.jitter_s:
                    time.sleep(random.uniform(0.0, self.jitter_s))
                if self.gbps and handle.nbytes:
                    time.sleep(handle.nbytes / (self.gbps * 1e9))
                if self._stream is not None:
                    with torch.cuda.stream(self._stream):
                        if after is not None:
                            self._stream.wait_event(after)
                        handle.result = fn()
                        handle._cuda_event = torch.cuda.Event()
                        handle._cuda_event.record(self._stream)
                else:
                    handle.result = fn()
            except BaseException as exc:  # surfaced to the waiter, never lost on the thread
                handle.error = exc
            elapsed = time.perf_counter() - t0
            with self._lock:
                self._copy_s += elapsed
                self._bytes += handle.nbytes
                self._copies += int(count_copy)
                self._jobs += 1
            handle._done.set()

    # --- accounting ------------------------------------------------------------------------------
    def _record_wait(self, seconds, blocked):
        with self._lock:
            self._wait_s += seconds
            self._waits += 1
            self._blocked += int(blocked)

    def reset_stats(self):
        with getattr(self, "_lock", threading.Lock()):
            self._bytes = self._copies = self._jobs = self._waits = self._blocked = 0
            self._copy_s = self._wait_s = 0.0

    def stats(self) -> dict:
        with self._lock:
            copy_s, wait_s = self._copy_s, self._wait_s
            hidden = 1.0 - min(1.0, wait_s / copy_s) if copy_s > 0 else 1.0
            return dict(bytes=self._bytes, copies=self._copies, jobs=self._jobs, copy_s=copy_s,
                        wait_s=wait_s, waits=self._waits, blocked_waits=self._blocked,
                        hidden_fraction=hidden)

    def drain(self):
        """Block until every queued job ran (not counted as exposed wait)."""
        h = CopyHandle(self)
        self._queue.put((lambda: None, h, None, False))
        h._done.wait()
        if self._stream is not None:  # and every copy it launched has landed
            self._stream.synchronize()

    def close(self):
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout=60)
            self._thread = None

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


class SlotArena:
    """At most K fixed slots of ``{dtype: numel}`` flat tensors on the compute device.

    A slot's storage is allocated the first time it is acquired and kept (no fragmentation, never
    more than K), so the arena's high-water mark is read from the storages themselves
    (``storage_bytes``), not from counters: what it reports is what it holds."""

    def __init__(self, slot_numel: dict, slots: int, device=None, nan_fill: bool | None = None):
        if slots < 1:
            raise ValueError(f"arena needs >= 1 slot (got {slots})")
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.nan_fill = nan_fill_from_env() if nan_fill is None else bool(nan_fill)
        self.slot_numel = {d: int(n) for d, n in slot_numel.items()}
        self._slots = [None] * slots  # allocated on first use
        self.slot_bytes = sum(n * torch.empty((), dtype=d).element_size()
                              for d, n in self.slot_numel.items())
        self.capacity_bytes = self.slot_bytes * slots
        self._free = list(range(slots))
        self._events = [None] * slots

    @property
    def slots(self) -> int:
        return len(self._slots)

    @property
    def in_use_bytes(self) -> int:
        return (len(self._slots) - len(self._free)) * self.slot_bytes

    def free_slots(self) -> int:
        return len(self._free)

    def acquire(self) -> int:
        if not self._free:
            raise RuntimeError(f"arena: all {len(self._slots)} slots are in use")
        i = self._free.pop(0)
        if self._slots[i] is None:
            self._slots[i] = {d: torch.empty(n, dtype=d, device=self.device)
                              for d, n in self.slot_numel.items()}
            if self.nan_fill:
                self._fill(i)
            if self.device.type == "cuda":
                # the first copy into a new slot (on the link's stream) waits for the compute
                # stream too: for the fill above, and because the caching allocator may hand out
                # a block that kernels still queued on the compute stream use
                self._events[i] = torch.cuda.Event()
                self._events[i].record()
        return i

    def slot(self, i: int) -> dict:
        if self._slots[i] is None:
            raise RuntimeError(f"arena: slot {i} was never acquired")
        return self._slots[i]

    def ready_event(self, i: int):
        return self._events[i]

    def release(self, i: int, after=None):
        if i in self._free:
            raise RuntimeError(f"arena: slot {i} released twice")
        if self.nan_fill:
            self._fill(i)
            if after is not None:  # the next copy into the slot waits for the fill too
                after = torch.cuda.Event()
                after.record()
        self._events[i] = after
        self._free.append(i)

    def _fill(self, i):
        for t in self._slots[i].values():
            t.fill_(float("nan") if t.is_floating_point() else -1)

    def peak_bytes(self) -> int:
        """Bytes of device storage the arena has ever held (its slots are never freed)."""
        return storage_bytes(t for s in self._slots if s is not None for t in s.values())


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors``, read from the storages themselves."""
    seen = {}
    for t in tensors:
        st = t.untyped_storage()
        seen[(st.device.type, st.data_ptr())] = st.nbytes()
    return sum(seen.values())
