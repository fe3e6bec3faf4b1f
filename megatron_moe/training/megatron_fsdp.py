"""Megatron-FSDP: megatron-core's fully sharded data parallel, chosen by Megatron-LM's flags
(``--use-megatron-fsdp``, ``--data-parallel-sharding-strategy``, ``--ckpt-format fsdp_dtensor``;
``megatron/training/training.py`` ``get_model`` and ``arguments.py``, core_v0.16.1 / core_v0.19.0).

The model chunks are wrapped in megatron-core's ``FullyShardedDataParallel`` instead of its
``DistributedDataParallel``: with ``optim_grads_params`` (ZeRO-3) every parameter, gradient and
optimizer state lives as a 1/DP shard, each transformer layer's parameters are all-gathered for its
forward and backward and its gradients reduce-scattered; ``optim_grads`` (ZeRO-2) and ``optim``
(ZeRO-1) keep more of them whole. The optimizer is megatron-core's distributed optimizer over those
shards (Megatron-LM turns ``--use-distributed-optimizer`` on); checkpoints are Megatron-LM's
``fsdp_dtensor`` format (training/fsdp_dtensor_checkpoint.py). Expert parameters are sharded over
the expert-data-parallel group, as megatron-core does.

On a CPU the wrapper runs on gloo with the shims of compat/cpu.py (its ``cuda`` devices and meshes
read as the host; its fused pre-scaled reduce-scatter, which gloo lacks, as a plain one followed by
the scale).
"""

from __future__ import annotations

import os

from megatron_moe.flags import exclusions

# Our features that edit or read the parameters' storage or their DDP gradient buffers in ways
# Megatron-FSDP's sharded buffers do not offer (refused at parse time, one line each).
EXCLUDES = (
    exclusions.Exclusion("--moe-balance-policy", "replicas add their gradients into the slices of "
                         "DDP's main_grad, which Megatron-FSDP shards"),
    exclusions.Exclusion("--moe-expert-offload", "offload rebinds expert parameters to host and "
                         "device slots; Megatron-FSDP owns their storage"),
    exclusions.Exclusion("--embedding-partition", "hidden re-shards the embedding's storage itself",
                         is_set=lambda args: getattr(args, "embedding_partition", "vocab") != "vocab"),
    exclusions.Exclusion("--moe-single-grouped-weight", "Megatron-LM's rule: Megatron-FSDP does "
                         "not remap grouped parameter storage"),
    exclusions.Exclusion("--cuda-graph-impl", "not tested with Megatron-FSDP here"),
    exclusions.Exclusion("--pipeline-model-parallel-size", "not tested with Megatron-FSDP here",
                         needs_one=True),
)


def add_arguments(parser):
    from megatron_moe.flags import add_megatron_argument as add

    g = parser.add_argument_group("Megatron-FSDP (megatron-core's fully sharded data parallel)")
    add(g, "--use-megatron-fsdp",
        help="Wrap the model in megatron-core's FullyShardedDataParallel (turns on the "
             "distributed optimizer; needs --ckpt-format fsdp_dtensor).")
    add(g, "--data-parallel-sharding-strategy",
        help="With --use-megatron-fsdp: what is sharded over data-parallel ranks: no_shard, optim "
             "(ZeRO-1), optim_grads (ZeRO-2), optim_grads_params (ZeRO-3).")
    add(g, "--outer-dp-sharding-strategy",
        help="Hybrid FSDP's outer data-parallel sharding; only no_shard here.")
    add(g, "--megatron-fsdp-main-params-dtype",
        help="Megatron-FSDP's main (optimizer) weight buffer dtype (megatron-core 0.19 or newer).")
    add(g, "--megatron-fsdp-main-grads-dtype",
        help="Megatron-FSDP's main gradient buffer dtype (megatron-core 0.19 or newer).")
    add(g, "--megatron-fsdp-grad-comm-dtype",
        help="Megatron-FSDP's gradient communication dtype (megatron-core 0.19 or newer).")
    add(g, "--suggested-communication-unit-size",
        help="With --use-megatron-fsdp: the elements per all-gather / reduce-scatter bucket "
             "megatron-core aims for (its default when not given).")
    add(g, "--no-strict-fsdp-dtensor-load",
        help="Load an fsdp_dtensor checkpoint that lacks some of this model's entries "
             "(they keep their initial values).")
    return parser


def setting(args):
    return "--use-megatron-fsdp" if getattr(args, "use_megatron_fsdp", False) else None


def validate_args(args):
    from megatron_moe.compat import megatron_fsdp as compat_fsdp

    if args.ckpt_format == "fsdp_dtensor" and not args.use_megatron_fsdp:
        raise ValueError("--ckpt-format fsdp_dtensor needs --use-megatron-fsdp (Megatron-LM's rule)")
    if not args.use_megatron_fsdp:
        if args.suggested_communication_unit_size is not None:
            raise ValueError("--suggested-communication-unit-size needs --use-megatron-fsdp")
        return
    if args.ckpt_format != "fsdp_dtensor":
        raise ValueError(f"--use-megatron-fsdp needs --ckpt-format fsdp_dtensor (Megatron-LM's "
                         f"rule), not {args.ckpt_format}")
    if args.optimizer not in ("sgd", "adam"):
        raise ValueError(f"--use-megatron-fsdp: Megatron-FSDP does not support --optimizer "
                         f"{args.optimizer} (sgd or adam; Megatron-LM's rule)")
    if (args.data_parallel_sharding_strategy == "optim_grads_params"
            and getattr(args, "check_weight_hash_across_dp_replicas_interval", None) is not None):
        raise ValueError("--check-weight-hash-across-dp-replicas-interval cannot run with "
                         "--data-parallel-sharding-strategy optim_grads_params (no rank holds "
                         "whole weights; Megatron-LM's rule)")
    if os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS") == "1":
        raise ValueError("--use-megatron-fsdp needs CUDA_DEVICE_MAX_CONNECTIONS unset or > 1 "
                         "(Megatron-LM's rule)")
    if getattr(args, "async_save", False):
        raise ValueError("--async-save cannot run with --ckpt-format fsdp_dtensor (Megatron-LM "
                         "saves that format synchronously)")
    compat_fsdp.validate(args)
    if args.outer_dp_sharding_strategy != "no_shard":
        raise ValueError(f"--outer-dp-sharding-strategy {args.outer_dp_sharding_strategy}: hybrid "
                         f"FSDP is not supported here (no_shard only)")
    if not args.use_distributed_optimizer and getattr(args, "rank", 0) == 0:
        print(" note: Megatron-FSDP is only compatible with --use-distributed-optimizer; using the "
              "distributed optimizer", flush=True)
    args.use_distributed_optimizer = True   # Megatron-LM's


def ddp_config_fields(args) -> dict:
    """Megatron-FSDP's fields of megatron-core's DistributedDataParallelConfig (empty when off)."""
    if not getattr(args, "use_megatron_fsdp", False):
        return {}
    from megatron_moe.compat.megatron_fsdp import ddp_config_fields as version_fields

    return {"use_megatron_fsdp": True,
            "data_parallel_sharding_strategy": args.data_parallel_sharding_strategy,
            "outer_dp_sharding_strategy": args.outer_dp_sharding_strategy,
            **({"suggested_communication_unit_size": args.suggested_communication_unit_size}
               if args.suggested_communication_unit_size is not None else {}),
            **version_fields(args)}


def data_parallel_wrapper(args):
    """megatron-core's wrapper for each model chunk: FullyShardedDataParallel or DDP."""
    import functools

    import torch
    from megatron.core.distributed import DistributedDataParallel, FullyShardedDataParallel

    from megatron_moe.compat.megatron_fsdp import without_transformer_engine

    if not args.use_megatron_fsdp:
        return DistributedDataParallel
    without_transformer_engine()
    if torch.cuda.is_available():
        return FullyShardedDataParallel
    # its default device is the current CUDA device
    return functools.partial(FullyShardedDataParallel, device=torch.device("cpu"))
