"""Launcher environment (torchrun or Slurm) -> torch.distributed -> megatron-core parallel_state."""

from __future__ import annotations

import datetime
import random

import numpy as np
import torch
import torch.distributed as dist

from megatron_moe.runtime import launcher as _launcher


def launcher_env() -> tuple[int, int, int]:
    """(rank, world_size, local_rank) from torchrun's variables, else Slurm's, else a single process
    (megatron_moe/runtime/launcher.py: the parser reads the same)."""
    env = _launcher.launcher_env()
    return env.rank, env.world_size, env.local_rank


def initialize_distributed(args):
    """Start the default process group (unless the caller already did) and megatron-core's groups."""
    from megatron.core import parallel_state

    rank, world_size, local_rank = launcher_env()
    if getattr(args, "deterministic_mode", False):   # before NCCL/cuBLAS read their variables
        import os

        from megatron_moe.runtime import determinism

        determinism.apply(os.environ)
    if not dist.is_initialized():
        if args.distributed_backend == "nccl":
            torch.cuda.set_device(local_rank)
        _launcher.set_rendezvous_env()   # srun alone: first host of the job, port from its id
        dist.init_process_group(
            backend=args.distributed_backend, rank=rank, world_size=world_size,
            timeout=datetime.timedelta(minutes=args.distributed_timeout_minutes))
    from megatron_moe.compat import apply_cpu_shims, multi_tensor

    apply_cpu_shims()
    multi_tensor.install()   # gradient norm and scaling without a host read per parameter
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=args.tensor_model_parallel_size,
            pipeline_model_parallel_size=args.pipeline_model_parallel_size,
            virtual_pipeline_model_parallel_size=getattr(
                args, "virtual_pipeline_model_parallel_size", None),
            context_parallel_size=args.context_parallel_size,
            expert_model_parallel_size=args.expert_model_parallel_size,
            expert_tensor_parallel_size=args.expert_tensor_parallel_size,
            distributed_timeout_minutes=args.distributed_timeout_minutes,
            # Megatron's --num-distributed-optimizer-instances and --use-tp-pp-dp-mapping
            num_distributed_optimizer_instances=getattr(args, "num_distributed_optimizer_instances", 1),
            order="tp-cp-ep-pp-dp" if getattr(args, "use_tp_pp_dp_mapping", False)
            else "tp-cp-ep-dp-pp",
            # --disable-gloo-process-groups (NCCL runs): no Gloo copies of the groups
            create_gloo_process_groups=getattr(args, "use_gloo_process_groups", True),
        )
    args.rank = dist.get_rank()
    args.world_size = dist.get_world_size()
    _initialize_topology(args)
    # CUDA graphs need megatron-core's graph-safe RNG states (Megatron-LM's initialize)
    set_random_seed(args.seed, cudagraphable=getattr(args, "cuda_graph_impl", "none") != "none")


def _initialize_topology(args):
    """Nodes x ranks per node (--ranks-per-node / --topology-file / LOCAL_WORLD_SIZE), and the
    intra/inter-node groups the non-flat all-to-alls use (built-in or registered), made once on
    every rank."""
    from megatron.core import parallel_state

    from megatron_moe.runtime import topology
    from megatron_moe.comm import link

    topology.reset()
    link.configure(getattr(args, "moe_ep_link_gbps", None))
    topo = topology.configure(args=args)
    if dist.get_world_size() % topo.ranks_per_node:
        raise ValueError(f"--ranks-per-node {topo.ranks_per_node} ({topo.source}) must divide the "
                         f"world size {dist.get_world_size()}")
    if getattr(args, "num_experts", None) and \
            getattr(args, "moe_a2a_algorithm", "flat") != "flat":
        topology.init_hierarchy_groups(parallel_state.get_expert_model_parallel_group())


def set_random_seed(seed: int, cudagraphable: bool = False):
    """Megatron's rule: seed + 100 x pipeline rank, then the model-parallel RNG tracker
    (``cudagraphable``: its states graph-safe, for CUDA graphs)."""
    from megatron.core import parallel_state, tensor_parallel

    seed = seed + 100 * parallel_state.get_pipeline_model_parallel_rank()
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed, use_cudagraphable_rng=cudagraphable)
