"""Megatron-FSDP's differences between megatron-core releases and between CUDA and gloo."""

from __future__ import annotations

import torch

from megatron_moe.compat.versions import mcore_at_least

# Megatron-LM core_v0.19's flags for Megatron-FSDP's buffer dtypes (DistributedDataParallelConfig
# fields of the same names since megatron-core 0.19), with their defaults
DTYPE_FLAGS = {"megatron_fsdp_main_params_dtype": "fp32",
               "megatron_fsdp_main_grads_dtype": "auto",
               "megatron_fsdp_grad_comm_dtype": "auto"}


def validate(args):
    if mcore_at_least("0.19"):
        return
    for dest, default in DTYPE_FLAGS.items():
        value = getattr(args, dest, default)
        if value != default:
            flag = "--" + dest.replace("_", "-")
            raise ValueError(f"{flag} {value}: megatron-core "
                             f"{__import__('megatron.core').core.__version__} has no such "
                             f"Megatron-FSDP setting (0.19 or newer; its buffers are {default})")


def ddp_config_fields(args) -> dict:
    fields = {}
    if mcore_at_least("0.19"):
        fields.update({dest: getattr(args, dest, default) for dest, default in DTYPE_FLAGS.items()})
    if not torch.cuda.is_available():
        # gloo has no pre-multiplied sum (NCCL's PREMUL_SUM, Megatron-FSDP's fused gradient
        # scaling): megatron-core then scales the gradients and sums, the same average
        fields["gradient_reduce_div_fusion"] = False
    return fields
