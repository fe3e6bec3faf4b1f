"""megatron-core's stand-ins for apex's multi-tensor kernels, replaced by torch's foreach kernels.

Without apex or Transformer Engine (the local path: a pip install, the GPU kit's machine)
megatron-core falls back to two helpers in ``megatron.core.utils``:

* ``local_multi_tensor_l2_norm`` (the gradient norm of every step): one ``torch.norm`` per
  parameter, then ``torch.tensor(<list of those device scalars>)`` and ``float()`` of the total.
  Building a host tensor from device scalars reads each one on the host: one
  ``cudaStreamSynchronize`` per parameter per step (1024 of the 1066 per iteration in the GPU
  kit's 128-expert model on the H200, docs/gpu_runs/2026-11-28-h200/), and every sync lets the
  device run dry while the host queues the next kernels.
* ``local_multi_tensor_scale`` (gradient clipping, and fp16's main -> model parameter copy): a
  multiply and a copy per tensor, two launches per parameter; under bf16 that copy is
  ``optimizer._multi_tensor_copy_this_to_that``'s loop, one ``copy_`` per parameter, with or
  without apex.

``torch._foreach_norm`` / ``_foreach_mul`` / ``_foreach_copy_`` do each list in a few launches and
leave the result on the device. The norm and scale are installed only where megatron-core picked
its local fallbacks, so with apex or TE its fused kernels stay. Same results: the norm within float
rounding (each tensor's norm in fp32, then the norm of those, as megatron-core), the scale and the
copy bit-exact.
"""

from __future__ import annotations

import torch


def _default_device():
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
        else torch.device("cpu")


def foreach_l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    """Drop-in for ``local_multi_tensor_l2_norm`` (and apex's ``multi_tensor_l2norm`` without
    per-tensor norms): ``(tensor([norm]), None)`` on the tensors' device, no host read."""
    tensors = [t for tensor_list in tensor_lists for t in tensor_list]
    if not tensors:
        return torch.zeros(1, dtype=torch.float, device=_default_device()), None
    norms = torch._foreach_norm(tensors, 2, dtype=torch.float32)
    return torch.linalg.vector_norm(torch.stack(norms)).reshape(1), None


def foreach_scale(chunk_size, noop_flag, tensor_lists, scale):
    """Drop-in for ``local_multi_tensor_scale``: ``dst.copy_(src * scale)`` for each pair, in
    foreach launches (the product in the source's dtype, then cast by the copy, as the loop)."""
    srcs, dsts = list(tensor_lists[0]), list(tensor_lists[1])
    if not srcs:
        return
    if all(s is d for s, d in zip(srcs, dsts)):     # clipping scales the gradients in place
        torch._foreach_mul_(dsts, scale)
        return
    torch._foreach_copy_(dsts, srcs if scale == 1.0 else torch._foreach_mul(srcs, scale))


def foreach_copy_this_to_that(this, that, overflow_buf=None):
    """Drop-in for megatron-core's ``optimizer._multi_tensor_copy_this_to_that``, which copies the
    fp32 main parameters into the bf16 model parameters after every step with one ``copy_`` per
    parameter (its multi-tensor kernel serves fp16 only)."""
    if overflow_buf is not None:
        overflow_buf.fill_(0)
    if this:
        torch._foreach_copy_(list(that), list(this))


def install() -> list:
    """Rebind megatron-core's optimizer modules from its local fallbacks to the foreach versions;
    the names rebound (none when apex or TE provided the fused kernels). Idempotent."""
    from megatron.core import utils as mcore_utils
    from megatron.core.optimizer import clip_grads
    from megatron.core.optimizer import optimizer as mcore_optimizer

    replacements = {
        getattr(mcore_utils, "local_multi_tensor_l2_norm", None): foreach_l2_norm,
        getattr(mcore_utils, "local_multi_tensor_scale", None): foreach_scale,
    }
    rebound = []
    if getattr(mcore_optimizer, "_multi_tensor_copy_this_to_that", foreach_copy_this_to_that) \
            is not foreach_copy_this_to_that:
        mcore_optimizer._multi_tensor_copy_this_to_that = foreach_copy_this_to_that
        rebound.append(f"{mcore_optimizer.__name__}._multi_tensor_copy_this_to_that")
    for module, name in ((clip_grads, "l2_norm_impl"), (clip_grads, "multi_tensor_scale_impl"),
                         (mcore_optimizer, "multi_tensor_scale_impl")):
        current = getattr(module, name, None)
        new = replacements.get(current) if current is not None else None
        if new is not None:
            setattr(module, name, new)
            rebound.append(f"{module.__name__}.{name}")
    return rebound
