"""megatron-core DDP's gradient hook, kept alive across a change of a parameter's device.

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
