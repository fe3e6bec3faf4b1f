"""SSD tier: a file of fp32 expert states read/written with pread/pwrite, behind a bounded host
cache with MoESys's LFU rule (moesys.md section 2.3, Algorithm 2) or LRU (for comparison).

Why hand-written: the cache policy is the paper's (hit counts with periodic decay, victim = the
least-hit entry at or above the threshold), and mmap is ruled out because its resident pages are
not bounded by us (the point of the tier is a bounded host footprint).
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict

import torch



class SsdFile:
    """One flat file; regions are (offset, numel) of fp32, allocated in order."""

    def __init__(self, path: str):
        self.path = path
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        self.size = 0
        self.bytes_read = 0
        self.bytes_written = 0

    def alloc(self, numel: int) -> tuple:
        offset = self.size
        self.size += numel * 4
        os.ftruncate(self.fd, self.size)
        return offset, numel

    def read_into(self, region, out: torch.Tensor):
        offset, numel = region
        assert out.dtype == torch.float32 and out.numel() == numel and out.is_contiguous()
        view = memoryview(out.numpy()).cast("B")
        done = 0
        while done < len(view):  # pread may return short counts
            n = os.preadv(self.fd, [view[done:]], offset + done)
            if n <= 0:
                raise OSError(f"{self.path}: short read at offset {offset + done}")
            done += n
        self.bytes_read += done

    def write_from(self, region, src: torch.Tensor):
        offset, numel = region
        assert src.dtype == torch.float32 and src.numel() == numel
        view = memoryview(src.detach().contiguous().numpy()).cast("B")
        done = 0
        while done < len(view):
            done += os.pwritev(self.fd, [view[done:]], offset + done)
        self.bytes_written += done

    def close(self):
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
            try:
                os.unlink(self.path)
            except OSError:
                pass


class HostCache:
    """Bounded host cache of SSD regions keyed by any hashable id.

    ``policy="lfu"`` (MoESys): every access adds a hit; every ``decay_period`` accesses all hit
    counts are multiplied by ``beta`` (frequency with ageing). On a full cache the victim is the
    entry with the fewest hits among those with hits >= ``threshold``, else the global fewest
    (the note's fix of the literal pseudo-code, which could evict nothing); ties go to the entry
    used most recently. ``policy="lru"``:
    least recently used. Dirty entries are written back on eviction and on ``flush()``. Pinned
    entries (in use by a copy or the optimizer step) are never evicted; if only pinned entries
    remain the cache overflows its budget until they are unpinned (counted in ``overflows``).
    """

    def __init__(self, ssd: SsdFile, capacity_bytes: int, policy: str = "lfu", beta: float = 0.5,
                 decay_period: int = 64, threshold: float = 1.0, pin_memory: bool = False):
        if policy not in ("lfu", "lru"):
            raise ValueError(f"host cache policy must be lfu or lru (got {policy!r})")
        self.ssd = ssd
        self.capacity = int(capacity_bytes)
        self.policy = policy
        self.beta, self.decay_period, self.threshold = beta, max(1, decay_period), threshold
        self.pin_memory = pin_memory
        self.regions = {}                  # key -> (offset, numel) in the file
        self.entries = OrderedDict()       # key -> host tensor (LRU order: oldest first)
        self.hits = {}                     # LFU counts, kept for evicted keys too (history)
        self.dirty = set()
        self.pins = {}
        self.bytes = 0
        self.peak_bytes = 0
        self.accesses = self.hit_count = self.overflows = self.writebacks = 0
        self._calls = 0
        self.lock = threading.RLock()      # the copy thread and the optimizer step both use it

    def add(self, key, init: torch.Tensor):
        """Register ``key`` with its initial contents (written straight to the file)."""
        with self.lock:
            region = self.ssd.alloc(init.numel())
            self.regions[key] = region
            self.ssd.write_from(region, init.reshape(-1).float())

    def get(self, key, pin: bool = False) -> torch.Tensor:
        with self.lock:
            self.accesses += 1
            self._calls += 1
            if self.policy == "lfu":
                self.hits[key] = self.hits.get(key, 0.0) + 1.0
                if self._calls % self.decay_period == 0:
                    for k in self.hits:
                        self.hits[k] *= self.beta
            t = self.entries.get(key)
            if t is not None:
                self.hit_count += 1
                self.entries.move_to_end(key)
            else:
                numel = self.regions[key][1]
                self._make_room(numel * 4, exclude=key)
                t = torch.empty(numel, dtype=torch.float32, pin_memory=self.pin_memory)
                self.ssd.read_into(self.regions[key], t)
                self.entries[key] = t
                self.bytes += numel * 4
                self.peak_bytes = max(self.peak_bytes, self.bytes)
            if pin:
                self.pins[key] = self.pins.get(key, 0) + 1
            return t

    def unpin(self, key, dirty: bool = False):
        with self.lock:
            self.pins[key] -= 1
            if not self.pins[key]:
                del self.pins[key]
            if dirty:
                self.dirty.add(key)
            self._make_room(0)

    def mark_dirty(self, key):
        with self.lock:
            self.dirty.add(key)

    def _victim(self):
        candidates = [k for k in self.entries if k not in self.pins]
        if not candidates:
            return None
        if self.policy == "lru":
            return candidates[0]
        above = [k for k in candidates if self.hits.get(k, 0.0) >= self.threshold]
        pool = above or candidates
        # ties: evict the most recently loaded (entries is in load/use order; keeping long-time
        # residents is what lets LFU hit on a cyclic scan where LRU always misses)
        return min(reversed(pool), key=lambda k: self.hits.get(k, 0.0))

    def _make_room(self, nbytes, exclude=None):
        while self.entries and self.bytes + nbytes > self.capacity:
            victim = self._victim()
            if victim is None or victim == exclude:
                self.overflows += 1
                return
            self._evict(victim)

    def _evict(self, key):
        t = self.entries.pop(key)
        if key in self.dirty:
            self._write_back(key, t)
        self.bytes -= t.numel() * 4

    def _write_back(self, key, t):
        """An evicted dirty entry -> the file (a test leaves it out to show updates get lost)."""
        self.ssd.write_from(self.regions[key], t)
        self.dirty.discard(key)
        self.writebacks += 1

    def flush(self):
        """Write every dirty entry back (kept cached): the file then holds the current states."""
        with self.lock:
            for key in list(self.dirty):
                self.ssd.write_from(self.regions[key], self.entries[key])
                self.writebacks += 1
            self.dirty.clear()

    def hit_rate(self) -> float:
        return self.hit_count / self.accesses if self.accesses else 0.0
