"""Host syncs per training iteration on a GPU, for the kit's ``training-syncs`` check (docs/gpu.md).

Under ``torch.cuda.set_sync_debug_mode("warn")`` torch warns at every call that makes the host wait
for the device: ``cudaStreamSynchronize`` / ``cudaDeviceSynchronize`` / event waits, ``.item()``,
device-to-host and blocking host-to-device copies, ``nonzero``. :class:`SyncCounter` counts those
warnings, labels each with the training iteration it happens in and with the innermost Python frame
outside torch: ``ours`` (``megatron_moe/``, ``kernels/``, the entry scripts), ``megatron-core``, or
``other``. Syncs in a backward pass that the autograd engine runs on its device thread are
replayed by torch on the calling thread, so they count for the caller of ``backward()``
(megatron-core's schedule).

On the CPU there is no such mode (``torch.cuda`` is not compiled): the counter runs, counts
nothing and says so; tests/test_host_syncs.py counts the host reads on the CPU with a dispatch
mode instead.
"""

from __future__ import annotations

import collections
import os
import sys
import warnings

import torch

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_OURS = tuple(os.path.join(_ROOT, d) + os.sep for d in ("megatron_moe", "kernels"))
_OUR_SCRIPTS = tuple(os.path.join(_ROOT, f) for f in ("pretrain_gpt_moe.py", "pretrain_bert_moe.py"))
_SKIP = (os.path.dirname(torch.__file__) + os.sep, os.path.abspath(__file__),
         os.path.abspath(warnings.__file__))
MESSAGE = "synchronizing CUDA operation"   # c10/cuda warn_or_error_on_sync's text


def owner_of(filename: str) -> str:
    filename = os.path.abspath(filename)
    if filename.startswith(_OURS) or filename in _OUR_SCRIPTS:
        return "ours"
    if f"{os.sep}megatron{os.sep}core{os.sep}" in filename:
        return "megatron-core"
    return "other"


def _site():
    frame = sys._getframe(1)
    while frame is not None:
        name = os.path.abspath(frame.f_code.co_filename)
        if not name.startswith(_SKIP) and not name.startswith("<"):
            rel = os.path.relpath(name, _ROOT) if name.startswith(_ROOT) else name
            return owner_of(name), f"{rel}:{frame.f_lineno} {frame.f_code.co_name}"
        frame = frame.f_back
    return "other", "<no python caller>"


class SyncCounter:
    """``with SyncCounter() as c:`` around training; ``c.phase`` = the iteration (set by the
    caller); ``c.events``: [(phase, owner, site)]. ``c.available``: False without CUDA."""

    def __init__(self):
        self.available = torch.cuda.is_available()
        self.phase = None
        self.events = []
        self._catch = None

    def on_warning(self, message, category, filename, lineno, file=None, line=None):
        if MESSAGE in str(message):
            owner, site = _site()
            self.events.append((self.phase, owner, site))
        elif self._show is not None:
            self._show(message, category, filename, lineno, file, line)

    def __enter__(self):
        self._catch = warnings.catch_warnings()
        self._catch.__enter__()
        # every sync, not once per call site; other warnings keep their filters
        warnings.filterwarnings("always", message=".*" + MESSAGE)
        self._show, warnings.showwarning = warnings.showwarning, self.on_warning
        if self.available:
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc):
        if self.available:
            torch.cuda.set_sync_debug_mode(0)
        self._catch.__exit__(*exc)
        return False

    def per_phase(self):
        """{phase: {"total": n, "ours": n, "megatron-core": n, "other": n}}"""
        out = collections.defaultdict(lambda: {"total": 0, "ours": 0, "megatron-core": 0,
                                               "other": 0})
        for phase, owner, _ in self.events:
            out[phase]["total"] += 1
            out[phase][owner] += 1
        return dict(out)

    def sites(self, phases, owner=None, top=10):
        """The most frequent call sites over ``phases``, as [(site, count per phase)]."""
        n = max(1, len(phases))
        c = collections.Counter(f"{o}: {s}" for p, o, s in self.events
                                if p in phases and (owner is None or o == owner))
        return [(site, k / n) for site, k in c.most_common(top)]
