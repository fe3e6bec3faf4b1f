"""Compression around the all-to-all (ScheMoE's AbsCompressor), by name.

A compressor turns a 2-D floating tensor ``[rows, cols]`` into ONE wire tensor whose dim 0 is
still ``rows`` (metadata is packed into each row's bytes), so any all-to-all algorithm moves it
with the same split sizes and no extra collective for metadata. ``decompress`` inverts it.

Error bounds (elementwise, x the input, x^ the round trip), tested in tests/test_comm.py:

=========  ===========================================================================
none       exact
fp16       |x^ - x| <= 2^-11 |x| for 2^-14 <= |x| <= 65504 (round to nearest); below the
           normal range the absolute error is <= 2^-25; |x| > 65504 is not representable
bf16       |x^ - x| <= 2^-8 |x| for normal fp32 values (round to nearest)
int8       per-row affine: lo = min(row), s = max(row) - min(row), q = floor((x-lo)/s*255);
           x^ = lo + q*s/255 with 0 <= x - x^ <= s/255 (+ fp32 rounding of lo, s: <= 2 ulp of
           max|row|); a constant row (s = 0) is exact. Wire: cols bytes + 8 bytes per row
           (lo, s as fp32) vs 4*cols for fp32. Assumes finite input: a row holding inf or
           NaN decodes to all-NaN, so the loss turns NaN and the NaN-loss check stops the run
           instead of training on silently clipped values
=========  ===========================================================================

Used in forward AND backward: the gradient of an all-to-all is itself compressed with the same
compressor (as ScheMoE's repo does); the round trip is treated as identity for autograd
(straight-through), so gradients of a compressed exchange are the compressed exchange of the
gradients.
"""

from __future__ import annotations

from typing import Callable, Dict

import torch

__all__ = ["Compressor", "register_compression", "get_compression", "available_compressions"]


class Compressor:
    """Base class: identity. Subclasses override ``compress``/``decompress``/``wire_bytes_per_row``."""

    name = "none"

    def applies_to(self, x: torch.Tensor) -> bool:
        """Only floating tensors with a feature dim are compressed (e.g. not 1-D routing probs)."""
        return x.is_floating_point() and x.dim() >= 2

    def compress(self, x: torch.Tensor) -> torch.Tensor:  # x: [rows, cols]
        return x

    def decompress(self, y: torch.Tensor, dtype: torch.dtype, cols: int) -> torch.Tensor:
        return y.to(dtype)

    def wire_bytes_per_row(self, cols: int, dtype: torch.dtype) -> int:
        return cols * _itemsize(dtype)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


class _Cast(Compressor):
    def __init__(self, name, wire_dtype):
        self.name, self.wire_dtype = name, wire_dtype

    def applies_to(self, x):
        # casting down a tensor that is already as small gains nothing
        return super().applies_to(x) and _itemsize(x.dtype) > _itemsize(self.wire_dtype)

    def compress(self, x):
        return x.to(self.wire_dtype)

    def wire_bytes_per_row(self, cols, dtype):
        return cols * _itemsize(self.wire_dtype)


class Int8RowCompressor(Compressor):
    """Per-row min/max uint8 quantisation, truncating; (lo, scale) fp32 packed in the row."""

    name = "int8"

    def compress(self, x):
        rows, cols = x.shape
        xf = x.float()
        if rows == 0:
            return torch.empty((0, cols + 8), dtype=torch.uint8, device=x.device)
        lo = xf.amin(dim=1, keepdim=True)
        scale = xf.amax(dim=1, keepdim=True) - lo
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))  # constant row: q = 0
        q = ((xf - lo) / safe * 255.0).clamp_(0, 255).floor_().to(torch.uint8)
        meta = torch.cat([lo, scale], dim=1).contiguous().view(torch.uint8)  # [rows, 8]
        return torch.cat([q, meta], dim=1)

    def decompress(self, y, dtype, cols):
        q = y[:, :cols].float()
        meta = y[:, cols:].contiguous().view(torch.float32)  # [rows, 2]
        lo, scale = meta[:, :1], meta[:, 1:2]
        return (lo + q * (scale / 255.0)).to(dtype)

    def wire_bytes_per_row(self, cols, dtype):
        return cols + 8


_REGISTRY: Dict[str, Compressor] = {}


def register_compression(name: str, compressor) -> None:
    """Register a compressor instance (or a zero-arg factory) under ``name``."""
    if not isinstance(name, str) or not name:
        raise ValueError("register_compression: name must be a non-empty string")
    obj = compressor() if isinstance(compressor, type) or (
        callable(compressor) and not isinstance(compressor, Compressor)) else compressor
    for m in ("compress", "decompress", "wire_bytes_per_row", "applies_to"):
        if not callable(getattr(obj, m, None)):
            raise TypeError(f"register_compression({name!r}): object lacks method {m}()")
    try:
        obj.name = name  # the registered name is the one flags, logs and the bench show
    except AttributeError:
        pass
    _REGISTRY[name] = obj


def get_compression(name) -> Compressor:
    if name is None:
        name = "none"
    if isinstance(name, Compressor):
        return name
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"--moe-a2a-compression={name!r}: unknown; registered: "
                         f"{sorted(_REGISTRY)}") from None


def available_compressions():
    return sorted(_REGISTRY)


register_compression("none", Compressor())
register_compression("fp16", _Cast("fp16", torch.float16))
register_compression("bf16", _Cast("bf16", torch.bfloat16))
register_compression("int8", Int8RowCompressor())
