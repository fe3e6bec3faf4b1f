"""Test tools: count the host reads of device data (what is a ``cudaStreamSynchronize`` on a GPU)
and the aten ops a piece of code runs, on CPU.

``HostReadCounter`` combines two views, because on CPU not every host read reaches the dispatcher:

* a ``TorchDispatchMode`` sees ``aten._local_scalar_dense`` (``.item()``, ``float(t)``, ``int(t)``,
  ``bool(t)``, ``if t:``), ``aten.is_nonzero`` / ``aten.equal``, and the ops whose output size
  depends on the data (``nonzero``, ``masked_select``, boolean indexing, ``unique``,
  ``repeat_interleave`` without ``output_size``): on CUDA each waits for the device;
* ``Tensor.tolist`` / ``.numpy`` / ``.cpu`` / ``.item`` and ``.to(<cpu>)`` are wrapped: on a CPU
  tensor they are plain Python calls (no dispatch), on a CUDA tensor each is a device-to-host copy.

Each read is attributed by walking the Python stack from the call outward, past torch's own frames
and this module: the first frame decides its owner, ``ours`` (``megatron_moe/``, ``kernels/``,
the entry scripts), ``megatron-core`` or ``other`` (tests, torch internals reached without a
Python caller). A read made inside megatron-core counts for megatron-core even when our code called
it: the alltoall dispatcher's split sizes are megatron-core's own read.

A tensor the strict device mode (megatron_moe/comm/strict.py) tagged as made on the host is no
device read (reading a host copy again costs nothing), and a ``.to()`` counts only when it names
the host by the string ``"cpu"`` (a ``torch.device`` is the data's device, the strict mode's
convention). Not seen on the CPU: blocking host-to-device copies (``.to(device)`` of a host tensor
waits for the stream on CUDA); the GPU kit's ``training-syncs`` check counts those.
``stand_ins``: functions a test monkeypatched into our code (a mutation) count as ours.

``phase`` labels the reads: tests set it (e.g. to the iteration number) and read ``by_phase``.
"""

from __future__ import annotations

import collections
import functools
import os
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_OURS = tuple(os.path.join(_ROOT, d) + os.sep for d in ("megatron_moe", "kernels", "tools"))
_OUR_SCRIPTS = tuple(os.path.join(_ROOT, f) for f in ("pretrain_gpt_moe.py", "pretrain_bert_moe.py"))
_TORCH = os.path.dirname(torch.__file__) + os.sep
# frames that only pass a call on: this module and the strict device mode's TorchFunctionMode
# (megatron_moe/comm/strict.py, on in every multi-process test)
_TRANSPARENT = (os.path.abspath(__file__), os.path.join(_ROOT, "megatron_moe", "comm", "strict.py"))
_CPU_SHIMS = os.path.join(_ROOT, "megatron_moe", "compat", "cpu.py")

aten = torch.ops.aten
# ops that read device data on the host (a scalar to Python) or size their output by the data
SYNC_OPS = {aten._local_scalar_dense.default, aten.is_nonzero.default, aten.equal.default,
            aten.nonzero.default, aten.masked_select.default,
            aten._unique2.default, aten.unique_consecutive.default, aten.unique_dim.default}


def owner_of(filename: str) -> str:
    filename = os.path.abspath(filename)
    if filename == _CPU_SHIMS:   # megatron-core's own code, rewritten for a CPU build
        return "megatron-core"
    if filename.startswith(_OURS) or filename in _OUR_SCRIPTS:
        return "ours"
    if f"{os.sep}megatron{os.sep}core{os.sep}" in filename:
        return "megatron-core"
    return "other"


def _caller(stand_ins=()):
    """(owner, 'file:line func') of the innermost frame that is neither torch's nor this module's.
    ``stand_ins``: code objects of functions a test monkeypatched into our code (mutations): they
    count as ours."""
    frame = sys._getframe(2)
    while frame is not None:
        name = os.path.abspath(frame.f_code.co_filename)
        if not name.startswith(_TORCH) and name not in _TRANSPARENT and "<" not in name[:1]:
            rel = os.path.relpath(name, _ROOT) if name.startswith(_ROOT) else name
            owner = "ours" if frame.f_code in stand_ins else owner_of(name)
            return owner, f"{rel}:{frame.f_lineno} {frame.f_code.co_name}"
        frame = frame.f_back
    return "other", "<no python caller>"


def _is_data_sized(func, args, kwargs) -> bool:
    """Ops whose output size depends on the data: on CUDA they copy a count to the host."""
    if func in SYNC_OPS:
        return True
    if func is aten.index.Tensor:   # x[mask]: nonzero under the hood
        return any(i is not None and i.dtype in (torch.bool, torch.uint8) for i in args[1])
    if func in (aten.repeat_interleave.Tensor, aten.repeat_interleave.self_Tensor):
        return kwargs.get("output_size") is None
    return False


class HostReadCounter(TorchDispatchMode):
    """``with HostReadCounter() as c: ...``; then ``c.reads`` (list of (phase, owner, where, what))."""

    def __init__(self):
        super().__init__()
        self.reads = []
        self.phase = None
        self.stand_ins = set()  # code objects counted as ours (see _caller)
        self._inside = 0        # a wrapped method calling another (cpu -> to): count once
        self._patched = []      # (owner, name, original), restored in reverse on exit

    # --- bookkeeping ---------------------------------------------------------------------------
    def _record(self, what):
        owner, where = _caller(self.stand_ins)
        self.reads.append((self.phase, owner, where, what))

    def by_phase(self, owner="ours"):
        out = collections.defaultdict(list)
        for phase, who, where, what in self.reads:
            if owner is None or who == owner:
                out[phase].append(f"{what} at {where}")
        return out

    # --- the dispatcher view -------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self._inside and not (args and _on_host(args[0])) and \
                _is_data_sized(func, args, kwargs):
            self._record(str(func.overloadpacket.__name__))
        return func(*args, **kwargs)

    # --- the Python view: methods that skip the dispatcher on CPU --------------------------------
    def _patch(self, owner, name, replacement):
        self._patched.append((owner, name, getattr(owner, name)))
        setattr(owner, name, replacement)

    def _wrap(self, name, is_read=lambda *a, **k: True):
        orig = getattr(torch.Tensor, name)
        counter = self

        @functools.wraps(orig)   # torch's function modes find the method by its __name__
        def wrapped(t, *args, **kwargs):
            if counter._inside or _on_host(t) or not is_read(t, *args, **kwargs):
                return orig(t, *args, **kwargs)
            counter._record(f"Tensor.{name}")
            counter._inside += 1
            try:
                return orig(t, *args, **kwargs)
            finally:
                counter._inside -= 1

        self._patch(torch.Tensor, name, wrapped)

    def __enter__(self):
        for name in ("tolist", "numpy", "cpu", "item"):
            self._wrap(name)
        self._wrap("to", _to_host)
        return super().__enter__()

    def __exit__(self, *exc):
        out = super().__exit__(*exc)
        while self._patched:
            owner, name, orig = self._patched.pop()
            setattr(owner, name, orig)
        return out


def _on_host(t) -> bool:
    """A tensor the strict device mode knows was made on the host (its provenance tag; the mode is
    on in every multi-process test): reading it is no device read."""
    return torch.is_tensor(t) and bool(getattr(t, "_mm_host", None))


def _to_host(t, *args, **kwargs):
    """``t.to(...)`` names the host as its device (a device-to-host copy on a GPU). As in the strict
    device mode (docs/comm.md), only the string names the host: a ``torch.device`` object is what
    ``torch.cuda.current_device()`` or a tensor's ``.device`` gave, the data's device on a GPU."""
    device = kwargs.get("device")
    for a in args:
        if isinstance(a, (str, torch.device)):
            device = a
    return _names_host(device)


def _names_host(device) -> bool:
    """The strict device mode's convention: only the string ``"cpu"`` names the host."""
    return isinstance(device, str) and device.split(":")[0] == "cpu"


class OpCounter(TorchDispatchMode):
    """Counts every aten op dispatched (forward and the autograd backward), by op name."""

    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self):
        return sum(self.ops.values())


class CaptureCounter(HostReadCounter):
    """A ``HostReadCounter`` for a region that CUDA would capture as a graph: it also records what
    fails a capture or is baked into it without being a read of device data, which a CPU build
    cannot show otherwise (its CUDA shims, megatron_moe/compat/cpu.py, are no-ops):

    * host waits: ``torch.cuda.synchronize``, a stream's or an event's ``synchronize``;
    * host-to-device copies: ``torch.tensor`` / ``torch.as_tensor`` of Python data with a device
      (a pageable copy on CUDA), ``.to(<device>)`` / ``.cuda()`` / ``copy_`` of a tensor the strict
      device mode tagged as made on the host.
    """

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if (func is aten.copy_.default and not self._inside and len(args) > 1
                and _on_host(args[1]) and not _on_host(args[0])):
            self._record("host-to-device copy_")
        return super().__torch_dispatch__(func, types, args, kwargs)

    def __enter__(self):
        from megatron_moe.compat import cpu

        counter = self

        def waits(what, orig):
            def wait(*args, **kwargs):
                counter._record(what)
                return orig(*args, **kwargs)
            return wait

        self._patch(torch.cuda, "synchronize", waits("torch.cuda.synchronize", torch.cuda.synchronize))
        for cls in (cpu._NoopEvent, cpu._NoopStream):
            self._patch(cls, "synchronize", waits(f"{cls.__name__[5:]}.synchronize", cls.synchronize))

        def factory(name, orig):
            def make(data, *args, **kwargs):
                device = kwargs.get("device")
                if device is not None and not torch.is_tensor(data) and not _names_host(device):
                    counter._record(f"torch.{name} of host data to a device")
                return orig(data, *args, **kwargs)
            return make

        for name in ("tensor", "as_tensor"):
            self._patch(torch, name, factory(name, getattr(torch, name)))

        def h2d(name, orig, moves):
            @functools.wraps(orig)
            def move(t, *args, **kwargs):
                if not counter._inside and _on_host(t) and moves(*args, **kwargs):
                    counter._record(f"host-to-device Tensor.{name}")
                return orig(t, *args, **kwargs)
            return move

        self._patch(torch.Tensor, "cuda", h2d("cuda", torch.Tensor.cuda, lambda *a, **k: True))
        out = super().__enter__()
        # after the base class wrapped .to for device-to-host reads
        to_device = lambda *a, **k: any(  # noqa: E731
            isinstance(x, (str, torch.device)) and not _names_host(x)
            for x in list(a) + [k.get("device")])
        self._patch(torch.Tensor, "to", h2d("to", torch.Tensor.to, to_device))
        return out

