"""Megatron-FSDP's differences between megatron-core releases and between CUDA and gloo."""

from __future__ import annotations

import torch

from megatron_moe.compat.versions import mcore_at_least, megatron_core_version

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
            raise ValueError(f"{flag} {value}: megatron-core {megatron_core_version()} has no "
                             f"such Megatron-FSDP setting (0.19 or newer; its buffers are "
                             f"{default})")


def ddp_config_fields(args) -> dict:
    fields = {}
    if mcore_at_least("0.19"):   # Megatron-LM's mapping of the flags' strings ('auto': None)
        dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
                  "auto": None}
        fields.update({dest: dtypes[getattr(args, dest, default)]
                       for dest, default in DTYPE_FLAGS.items()})
    if not torch.cuda.is_available():
        # gloo has no pre-multiplied sum (NCCL's PREMUL_SUM, Megatron-FSDP's fused gradient
        # scaling): megatron-core then scales the gradients and sums, the same average
        fields["gradient_reduce_div_fusion"] = False
    return fields


def main_grad_bytes(args, ddp_bytes: int, param_bytes: int) -> int:
    """Bytes per element of Megatron-FSDP's gradient buffer. megatron-core 0.19 keeps it in
    ``--megatron-fsdp-main-grads-dtype`` ('auto', the default: the parameters' dtype, so bf16
    gradients under --bf16); 0.16 in fp32 under DDP's ``grad_reduce_in_fp32`` rule
    (``ddp_bytes``)."""
    if not mcore_at_least("0.19"):
        return ddp_bytes
    value = getattr(args, "megatron_fsdp_main_grads_dtype", "auto")
    return param_bytes if value == "auto" else {"fp32": 4, "bf16": 2, "fp16": 2}[value]


class _NoTransformerEngineLinear:
    """Stands for Transformer Engine's TELinear where it is not installed: no module is one."""


def without_transformer_engine():
    """megatron-core's Megatron-FSDP adapter (0.16 and 0.19) tests ``isinstance(module,
    (TELinear,))`` under tensor parallelism; without Transformer Engine TELinear is not a class
    (None, or megatron-core's MagicMock stand-in) and the test raises TypeError. With a class no
    module is an instance of, the local linears (which carry megatron-core's own tensor-parallel
    attributes) take the adapter's non-TE branch."""
    from megatron.core.distributed.fsdp import mcore_fsdp_adapter

    if not isinstance(getattr(mcore_fsdp_adapter, "TELinear", None), type):
        mcore_fsdp_adapter.TELinear = _NoTransformerEngineLinear
