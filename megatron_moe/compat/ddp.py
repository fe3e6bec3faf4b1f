"""megatron-core DDP's gradient hook: kept alive across a change of a parameter's device, or moved
off the AccumulateGrad nodes for a full-iteration CUDA graph.

megatron-core's ``DistributedDataParallel`` (0.16 and 0.19 alike) copies each parameter's grad into
its contiguous buffer (``param.main_grad``) from a hook on the parameter's AccumulateGrad node,
found as ``param.expand_as(param).grad_fn.next_functions[0][0]`` and kept in ``ddp.grad_accs``.
Autograd caches that node per parameter and DROPS it when ``param.data`` is set to a tensor of
another device or dtype (torch's ``VariableHooks::set_data``): the next forward creates a new node
without DDP's hook, so from then on the parameter's grads never reach ``main_grad`` (which stays
zero) and the optimizer steps on zero gradients. Expert offload (megatron_moe/offload/) binds the
experts' parameters to host memory for the host step and for checkpoints; on the CPU host and
device are one device, so only a GPU run showed it (grad norm below resident's from the second
iteration on). ``rehook`` puts DDP's own hook on the new node.

A full-iteration CUDA graph (megatron_moe/training/cuda_graph.py) needs the opposite: no node
kept alive. ``grad_accs`` holds nodes made on the default (legacy) stream when DDP was built;
megatron-core's FullCudaGraphWrapper captures on a side stream, and the capture's backward
accumulating into such a node makes the legacy stream wait on the capturing stream, which fails
the capture ("operation would make the legacy stream depend on a capturing blocking stream"; torch
warns that DDP keeps the node). ``hook_parameters`` puts DDP's hook on each parameter (a
post-accumulate-grad hook) and drops the nodes: autograd then makes each iteration's nodes in that
iteration's forward, the capture's on the capture stream.
"""

from __future__ import annotations

import torch


def grad_accumulator(param):
    """The AccumulateGrad node autograd uses for ``param`` now (created when it holds none; its
    recorded shape, dtype and device are those of ``param.data`` at that moment)."""
    with torch.enable_grad():
        return param.expand_as(param).grad_fn.next_functions[0][0]


def hooked_accumulators(model_chunks, params):
    """{param: (ddp, node)} for those of ``params`` whose AccumulateGrad node megatron-core's DDP
    hooked (the node is in its ``grad_accs``). Call before any ``.data`` of them changes device."""
    wanted = set(params)
    out = {}
    for ddp in model_chunks:
        nodes = getattr(ddp, "grad_accs", None)
        if nodes is None or not hasattr(ddp, "_make_backward_post_hook"):
            continue
        hooked = {id(n) for n in nodes}
        for p in ddp.module.parameters():
            if p in wanted and p.requires_grad:
                node = grad_accumulator(p)
                if id(node) in hooked:
                    out[p] = (ddp, node)
    return out


def rehook(ddp, param, node):
    """The node DDP's hook is on now: ``node`` when autograd still uses it for ``param``, else
    the node autograd uses now, given DDP's hook and kept alive in ``ddp.grad_accs`` in place of
    ``node``. ``param.data`` must have its true shape, dtype and device (the new node records
    them and checks every gradient against them)."""
    current = grad_accumulator(param)
    if current is node:
        return node
    current.register_hook(ddp._make_backward_post_hook(param))
    for i, n in enumerate(ddp.grad_accs):
        if n is node:
            ddp.grad_accs[i] = current
            break
    else:
        ddp.grad_accs.append(current)
    return current


# marks the nodes hook_parameters drops (autograd nodes take no weak references; their metadata
# dict lives on the node itself, so only a node that survived the drop carries it)
_DROPPED = "megatron_moe.ddp.hook_moved_to_parameter"


def hook_parameters(model_chunks) -> int:
    """Move megatron-core DDP's backward hook of every parameter whose AccumulateGrad node it
    hooked onto the parameter itself (``register_post_accumulate_grad_hook``: it runs inside
    AccumulateGrad right after the accumulation, the point at which the node's hook ran, and it
    stays when autograd makes a new node), and drop DDP's references to the nodes (``grad_accs``
    emptied).
    The hook is DDP's own (``_make_backward_post_hook``): the same ``main_grad`` add, ``grad =
    None`` and grad-ready registration as before. Call right after DDP is built, before any
    forward. RuntimeError when a dropped node is still alive (something else holds it or a graph
    through it): the next forward would reuse it with both hooks. The number of parameters moved."""
    moved = 0
    for ddp in model_chunks:
        if not getattr(ddp, "grad_accs", None) or not hasattr(ddp, "_make_backward_post_hook"):
            continue
        hooked = hooked_accumulators([ddp], list(ddp.module.parameters()))
        if len(hooked) != len(ddp.grad_accs):
            raise RuntimeError(f"megatron-core DDP hooked {len(ddp.grad_accs)} AccumulateGrad "
                               f"nodes, {len(hooked)} of them its parameters' current ones: "
                               f"its hooks cannot be moved to the parameters")
        for _, node in hooked.values():
            node.metadata[_DROPPED] = True
        params = list(hooked)
        del hooked, node   # (hooked is not empty: grad_accs is not)
        ddp.grad_accs.clear()
        # a probe makes a new node when the old one is gone (freed again with the probe)
        alive = {p for p in params if _DROPPED in grad_accumulator(p).metadata}
        if alive:
            names = [n for n, p in ddp.module.named_parameters() if p in alive]
            raise RuntimeError(
                f"{len(alive)} AccumulateGrad node(s) of megatron-core DDP stay alive after its "
                f"references are dropped (a graph or a tensor outside DDP holds them), e.g. "
                f"{names[:3]}: the next forward would reuse them with DDP's hook on the node "
                f"and on the parameter, and a CUDA graph capture would accumulate into a node of "
                f"the default stream")
        for p in params:
            hook = ddp._make_backward_post_hook(p)
            p.register_post_accumulate_grad_hook(_after_accumulation(hook))
        moved += len(params)
    return moved


def _after_accumulation(hook):
    """DDP's node hook (it ignores its arguments) as a post-accumulate-grad hook."""
    return lambda param: hook()
