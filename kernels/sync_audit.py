"""Count the host synchronisations a piece of code would make on a GPU, on the CPU.

``torch.cuda.set_sync_debug_mode`` needs a GPU; this emulates it on CPU tensors: a
``TorchDispatchMode`` sees every aten op and flags those that block the host on a CUDA tensor
(reading a value back, or an output size that depends on the data), and the Python-level calls
that copy to the host (``.tolist()``, ``.cpu()``, ``.numpy()``) are wrapped.  Triton kernel
launches under ``TRITON_INTERPRET=1`` are not counted: the interpreter's own host copies stand in
for a GPU launch, which does not synchronise.

    with count_host_syncs() as syncs:
        y = kernels.permute(...)
    assert not syncs, syncs          # [(op name, python frame), ...]
"""

from __future__ import annotations

import contextlib
import traceback
from typing import List, Tuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

# aten ops that synchronise the host with the device on CUDA tensors (value read back, or an
# output whose size is data-dependent); cf. torch.cuda.set_sync_debug_mode's warnings.
_SYNC_OPS = {
    aten._local_scalar_dense.default,   # .item(), int(t), float(t), bool(t), if t: ...
    aten.nonzero.default,                # size from the data (nonzero_static is fine)
    aten.masked_select.default,
    aten._unique2.default, aten.unique_dim.default, aten.unique_consecutive.default,
    aten.bincount.default,               # max() read back for the output size
    aten.equal.default,                  # returns a Python bool
    aten.is_nonzero.default,
}


def _is_sync(func, args, kwargs) -> bool:
    if func in _SYNC_OPS:
        return True
    if func is aten.repeat_interleave.Tensor or func is aten.repeat_interleave.self_Tensor:
        return kwargs.get("output_size") is None and (len(args) < 4 or args[3] is None)
    if func in (aten.index.Tensor, aten.index_put.default, aten.index_put_.default,
                aten._index_put_impl_.default):
        idx = args[1] if len(args) > 1 else []
        return any(i is not None and i.dtype in (torch.bool, torch.uint8) for i in idx)
    return False


class _SyncCounter(TorchDispatchMode):
    def __init__(self, out: List[Tuple[str, str]]):
        super().__init__()
        self.out = out
        self.paused = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.paused and _is_sync(func, args, kwargs):
            self.out.append((str(func), _caller()))
        return func(*args, **kwargs)


def _caller() -> str:
    for fr in reversed(traceback.extract_stack()[:-2]):
        if "sync_audit" not in fr.filename and "/torch/" not in fr.filename:
            return f"{fr.filename}:{fr.lineno} {fr.name}"
    return "?"


@contextlib.contextmanager
def count_host_syncs():
    """Yield a list that collects ``(op, caller)`` for every would-be host sync in the block."""
    out: List[Tuple[str, str]] = []
    mode = _SyncCounter(out)
    patched = []

    def wrap(owner, name, label):
        orig = getattr(owner, name)

        def f(*a, **k):
            if not mode.paused:
                out.append((label, _caller()))
            mode.paused += 1          # the ops these make internally are this one sync
            try:
                return orig(*a, **k)
            finally:
                mode.paused -= 1

        patched.append((owner, name, orig))
        setattr(owner, name, f)

    def pause(owner, name):
        orig = getattr(owner, name)

        def f(*a, **k):
            mode.paused += 1
            try:
                return orig(*a, **k)
            finally:
                mode.paused -= 1

        patched.append((owner, name, orig))
        setattr(owner, name, f)

    wrap(torch.Tensor, "tolist", "Tensor.tolist")
    wrap(torch.Tensor, "cpu", "Tensor.cpu")
    wrap(torch.Tensor, "numpy", "Tensor.numpy")
    try:
        from triton.runtime.interpreter import GridExecutor

        pause(GridExecutor, "__call__")       # an interpreted kernel launch = a GPU launch
    except Exception:                          # no triton / no interpreter: nothing to pause
        pass
    try:
        with mode:
            yield out
    finally:
        for owner, name, orig in reversed(patched):
            setattr(owner, name, orig)
