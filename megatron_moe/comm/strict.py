"""Strict device checks of every ``torch.distributed`` call: NCCL-readiness tested on gloo.

NCCL moves device memory only; gloo moves anything, so a host tensor that slips into a collective
passes every CPU test and fails on the first GPU run ("No backend type associated with device type
cpu"). With ``MEGATRON_MOE_STRICT_DEVICES=1`` (set by megatron_moe/runtime/local_ranks.py for every
multi-process test) :func:`enable` wraps the collectives and point-to-point calls of
``torch.distributed`` and checks each call:

1. all tensors of one call are on one device (the data tensor's);
2. on a group whose production backend is NCCL (every group except those created with
   ``backend="gloo"``, e.g. megatron-core's checkpointing groups) no tensor is a *host* tensor;
3. no Python-object collective (``all_gather_object``, ``broadcast_object_list``, ...) runs on the
   hot path (inside :func:`hot_path`: a training step, an MoE layer's forward); setup and
   checkpointing may use them.

A violation raises :class:`StrictDeviceError` naming the call and the tensor's origin.

On a GPU machine rule 2 is a plain ``device.type == "cpu"`` check. Without a GPU every tensor is on
the CPU, so a "pretend device" stands in: the data is taken to live on CUDA, and a tensor counts as
a host tensor when it was *made* on the host, as it would be on a GPU machine. A ``TorchFunctionMode``
tags (attribute ``_mm_host``) the results of

* factories (``torch.tensor/as_tensor/empty/zeros/ones/full/arange/...``) called with a device
  *string* ``"cpu"``, or without a ``device`` from our production code (``megatron_moe``,
  ``kernels``; tests and megatron-core build CPU tensors that production then moves with
  ``.cuda()``); ``torch.from_numpy`` / ``frombuffer``;
* ``.cpu()`` and ``.to("cpu")`` (a fresh alias, since on the CPU they return the tensor itself);

and passes the tag on through any op whose tensor inputs are all tagged (``.t()``, ``.view``,
``.contiguous()``, arithmetic). A device taken from data (``x.device``, ``x.new_empty``,
``torch.empty_like``) or a ``torch.device`` object (``torch.cuda.current_device()``, which the
CPU shims answer with ``torch.device("cpu")``) is trusted as the data device: code that must pick a
device for a collective buffer takes it from the payload, never from a string literal. That is the
convention the check enforces (docs/comm.md, "Strict device mode").
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

__all__ = ["ENV", "StrictDeviceError", "enable", "enabled", "hot_path", "in_hot_path", "suspended",
           "host_origin"]

ENV = "MEGATRON_MOE_STRICT_DEVICES"

# tensor collectives / p2p: every tensor argument is checked
_TENSOR_CALLS = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter",
                 "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "broadcast", "reduce",
                 "gather", "scatter", "send", "recv", "isend", "irecv", "batch_isend_irecv",
                 "_all_gather_base", "_reduce_scatter_base")
_OBJECT_CALLS = ("all_gather_object", "broadcast_object_list", "gather_object",
                 "scatter_object_list", "send_object_list", "recv_object_list")
_FACTORIES = {torch.tensor, torch.as_tensor, torch.asarray, torch.empty, torch.zeros, torch.ones,
              torch.full, torch.arange, torch.range, torch.linspace, torch.logspace, torch.eye,
              torch.rand, torch.randn, torch.randint, torch.randperm, torch.empty_strided,
              torch.scalar_tensor, torch.tril_indices, torch.triu_indices}
_HOST_ALWAYS = {torch.from_numpy, torch.frombuffer}

_ENABLED = False
_EMULATE = False          # no GPU: provenance stands in for the device (module doc)
_HOT = 0                  # hot_path() depth
_INSIDE = 0               # inside a wrapped call (torch's own nested calls are not re-checked)
_HOST_GROUPS: list = []   # groups created with backend="gloo": host tensors are right there
_MODE = None


class StrictDeviceError(RuntimeError):
    pass


def enabled() -> bool:
    return _ENABLED


def in_hot_path() -> bool:
    return _HOT > 0


@contextlib.contextmanager
def suspended():
    """Checks off inside the block (tests: the same calls pass without strict mode)."""
    global _INSIDE
    _INSIDE += 1
    try:
        yield
    finally:
        _INSIDE -= 1


@contextlib.contextmanager
def hot_path():
    """Mark the hot path (a training step, an MoE forward): Python-object collectives are refused
    there in strict mode. Cheap and harmless when strict mode is off."""
    global _HOT
    _HOT += 1
    try:
        yield
    finally:
        _HOT -= 1


def host_origin(t) -> str | None:
    """Why ``t`` counts as a host tensor (None: it is on the data's device)."""
    if not torch.is_tensor(t):
        return None
    if not _EMULATE:
        return "a CPU tensor" if t.device.type == "cpu" else None
    return getattr(t, "_mm_host", None)


# ---------------------------------------------------------------------------------------------
# provenance (CPU emulation)

_OWN = ("megatron_moe.", "kernels")                     # production code judged for no-device factories
_NOT_OWN = ("megatron_moe.runtime.local_ranks", "megatron_moe.comm.strict")


def _tag(out, origin):
    if torch.is_tensor(out):
        try:
            out._mm_host = origin
        except (AttributeError, RuntimeError):
            pass
    elif isinstance(out, (tuple, list)):
        for o in out:
            _tag(o, origin)
    return out


def _alias(t):
    # x.cpu() / x.to("cpu") return x itself on the CPU: tag a fresh alias, never the data tensor
    return t.view_as(t) if torch.is_tensor(t) and not t.requires_grad else t


def _to_target(args, kwargs):
    dev = kwargs.get("device")
    if dev is None:
        for a in args[1:]:
            if isinstance(a, (str, torch.device)):
                dev = a
                break
            if torch.is_tensor(a):
                return "tensor", a
    return ("device", dev) if dev is not None else (None, None)


class _Provenance(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in _FACTORIES:
            dev = kwargs.get("device")
            if dev is None:
                if func in (torch.tensor, torch.as_tensor, torch.asarray) and args and \
                        torch.is_tensor(args[0]):
                    return out
                # no device: a host tensor on a GPU machine; judged in our own code only (tests
                # and megatron-core build CPU tensors that production code then moves)
                caller = sys._getframe(1).f_globals.get("__name__", "")
                if caller.startswith(_OWN) and caller not in _NOT_OWN:
                    return _tag(out, f"torch.{func.__name__}() without a device ({caller})")
                return out
            if isinstance(dev, str) and dev.split(":")[0] == "cpu":
                return _tag(out, f"torch.{func.__name__}(device={dev!r})")
            return out
        if func in _HOST_ALWAYS:
            return _tag(out, f"torch.{func.__name__}()")
        name = getattr(func, "__name__", "")
        if name == "cpu" and args and torch.is_tensor(args[0]):
            return _tag(_alias(out) if out is args[0] else out, ".cpu()")
        if name == "to" and args and torch.is_tensor(args[0]):
            kind, target = _to_target(args, kwargs)
            if kind == "device":
                if isinstance(target, str) and target.split(":")[0] == "cpu":
                    return _tag(_alias(out) if out is args[0] else out, f".to({target!r})")
                if getattr(args[0], "_mm_host", None) and out is args[0]:
                    return _alias(out)                # moved to the data's device: untagged alias
                return out
            if kind == "tensor":
                origin = getattr(target, "_mm_host", None)
                if origin is None and out is args[0] and getattr(args[0], "_mm_host", None):
                    return _alias(out)
                return _tag(out, origin) if origin and out is not args[0] else out
        # propagate: the result is a host tensor when every tensor input is one
        origin = None
        for a in args:
            if torch.is_tensor(a):
                o = getattr(a, "_mm_host", None)
                if o is None:
                    return out
                origin = origin or o
            elif isinstance(a, (list, tuple)):
                for b in a:
                    if torch.is_tensor(b):
                        o = getattr(b, "_mm_host", None)
                        if o is None:
                            return out
                        origin = origin or o
        if origin is not None and out is not None:
            if isinstance(out, (tuple, list)) or (torch.is_tensor(out) and
                                                  getattr(out, "_mm_host", None) is None):
                _tag(out, origin)
        return out


# ---------------------------------------------------------------------------------------------
# the checks

def _tensors(args, kwargs):
    for a in list(args) + list(kwargs.values()):
        if torch.is_tensor(a):
            yield a
        elif isinstance(a, (list, tuple)):
            for b in a:
                if torch.is_tensor(b):
                    yield b
                elif isinstance(b, dist.P2POp):
                    yield b.tensor


def _group(args, kwargs):
    g = kwargs.get("group")
    if g is None:
        for a in args:
            if isinstance(a, dist.ProcessGroup):
                return a
            if isinstance(a, (list, tuple)) and a and isinstance(a[0], dist.P2POp):
                return a[0].group
    return g


def _check(name, args, kwargs):
    ts = list(_tensors(args, kwargs))
    devices = {t.device for t in ts}
    if len(devices) > 1:
        raise StrictDeviceError(f"strict devices: torch.distributed.{name} mixes devices "
                                f"{sorted(str(d) for d in devices)}: every tensor of one call must "
                                "be on the data tensor's device")
    g = _group(args, kwargs)
    if g is not None and any(g is h for h in _HOST_GROUPS):
        return
    for t in ts:
        origin = host_origin(t)
        if origin:
            raise StrictDeviceError(
                f"strict devices: torch.distributed.{name} got a host tensor (made by {origin}, "
                f"shape {tuple(t.shape)}, {t.dtype}) on a group that runs on NCCL in production: "
                "create it on the payload's device (x.device / x.new_empty), see docs/comm.md")


def _wrap_tensor_call(name, fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        global _INSIDE
        if _INSIDE:
            return fn(*args, **kwargs)
        _check(name, args, kwargs)
        _INSIDE += 1
        try:
            return fn(*args, **kwargs)
        finally:
            _INSIDE -= 1
    wrapper._mm_strict = True
    return wrapper


def _wrap_object_call(name, fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        global _INSIDE
        if _HOT and not _INSIDE:
            raise StrictDeviceError(f"strict devices: torch.distributed.{name} (a Python-object "
                                    "collective: pickling and a host round trip) on the hot path; "
                                    "exchange tensors, or move it to setup")
        _INSIDE += 1
        try:
            return fn(*args, **kwargs)
        finally:
            _INSIDE -= 1
    wrapper._mm_strict = True
    return wrapper


def _wrap_new_group(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        pg = fn(*args, **kwargs)
        backend = kwargs.get("backend", args[2] if len(args) > 2 else None)
        if pg is not None and backend is not None and "gloo" in str(backend).lower():
            _HOST_GROUPS.append(pg)
        return pg
    wrapper._mm_strict = True
    return wrapper


def enable(emulate: bool | None = None) -> None:
    """Turn strict mode on for this process (idempotent). ``emulate`` (default: no CUDA) tracks
    host tensors by provenance, as the module doc explains. Call it after the CPU shims
    (``compat.apply_cpu_shims``), so the ``Tensor.cuda`` it wraps is the shimmed one."""
    global _ENABLED, _EMULATE, _MODE
    if _ENABLED:
        return
    from torch.distributed import distributed_c10d as c10d

    _EMULATE = (not torch.cuda.is_available()) if emulate is None else bool(emulate)
    swapped = {}
    for names, wrap in ((_TENSOR_CALLS, _wrap_tensor_call), (_OBJECT_CALLS, _wrap_object_call),
                        (("new_group",), lambda _, fn: _wrap_new_group(fn))):
        for name in names:
            fn = getattr(c10d, name, None)
            if fn is None or getattr(fn, "_mm_strict", False):
                continue
            w = wrap(name, fn)
            swapped[id(fn)] = (fn, w)
            # both namespaces: torch's P2POp checks ``op in (c10d.isend, c10d.irecv)``
            setattr(c10d, name, w)
            if getattr(dist, name, None) is fn:
                setattr(dist, name, w)
    # modules imported already may hold their own reference (megatron-core binds
    # ``dist_all_gather_func = torch.distributed.all_gather_into_tensor`` at import)
    for mname, mod in list(sys.modules.items()):
        if mod is None or not mname.startswith(("megatron", "kernels")):
            continue
        for k, v in list(vars(mod).items()):
            hit = swapped.get(id(v))
            if hit is not None and hit[0] is v:
                setattr(mod, k, hit[1])
    if _EMULATE:
        _wrap_tensor_cuda()
        _MODE = _Provenance()
        _MODE.__enter__()        # process-wide, for the rest of the process
    _ENABLED = True


def _wrap_tensor_cuda():
    """``x.cuda()`` puts a host tensor on the data's device; on a CPU build (the shims keep the
    tensor where it is) it returns an untagged alias instead."""
    orig = torch.Tensor.cuda
    if getattr(orig, "_mm_strict", False):
        return

    @functools.wraps(orig)
    def cuda(self, *args, **kwargs):
        out = orig(self, *args, **kwargs)
        if getattr(out, "_mm_host", None) is not None:
            out = out.view_as(out) if out is self and not out.requires_grad else out
            if out is not self:
                try:
                    del out._mm_host
                except AttributeError:
                    pass
        return out
    cuda._mm_strict = True
    cuda._megatron_moe_cpu = getattr(orig, "_megatron_moe_cpu", False)
    torch.Tensor.cuda = cuda


def enable_from_env() -> bool:
    if os.environ.get(ENV, "0") not in ("", "0"):
        enable()
    return _ENABLED
