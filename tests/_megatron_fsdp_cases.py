"""Rank functions for tests/test_megatron_fsdp.py (spawned by run_distributed). ``mutate`` breaks
the feature inside the spawned rank; the test expects that run to fail its assertions."""


def _drop_fsdp():
    """models.builder wraps in DDP whatever the flags say (Megatron-FSDP never runs)."""
    from megatron.core.distributed import DistributedDataParallel

    from megatron_moe.training import megatron_fsdp

    wrapper, fields = megatron_fsdp.data_parallel_wrapper, megatron_fsdp.ddp_config_fields
    megatron_fsdp.data_parallel_wrapper = lambda args: DistributedDataParallel
    megatron_fsdp.ddp_config_fields = lambda args: {}

    def restore():
        megatron_fsdp.data_parallel_wrapper, megatron_fsdp.ddp_config_fields = wrapper, fields
    return restore


def _undo_cpu_shim():
    """compat/cpu.py's Megatron-FSDP shim undone: its modules see the real torch and DeviceMesh."""
    import importlib

    import torch
    from torch.distributed import DeviceMesh

    from megatron_moe.compat import cpu

    for name in cpu.MEGATRON_FSDP_MODULES:
        module = importlib.import_module(name)
        if hasattr(module, "torch"):
            module.torch = torch
        if name.endswith("mcore_fsdp_adapter"):
            module.DeviceMesh = DeviceMesh
    return lambda: cpu.patch_megatron_fsdp()


def _skip_optimizer_load():
    """The fsdp_dtensor load reads no optimizer entries (the Adam moments stay as a fresh
    optimizer's; DCP would otherwise fill them in place)."""
    from megatron_moe.training import fsdp_dtensor_checkpoint

    real = fsdp_dtensor_checkpoint.dcp

    class WithoutOptimizer:
        def __getattr__(self, name):
            return getattr(real, name)

        @staticmethod
        def load(state_dict, **kwargs):   # DCP loads in place: the same dict, less its entry
            optimizer = state_dict.pop("optimizer", None)
            try:
                return real.load(state_dict, **kwargs)
            finally:
                if optimizer is not None:
                    state_dict["optimizer"] = optimizer

    fsdp_dtensor_checkpoint.dcp = WithoutOptimizer()
    return lambda: setattr(fsdp_dtensor_checkpoint, "dcp", real)


MUTATIONS = {"fsdp-dropped": _drop_fsdp, "no-cpu-shim": _undo_cpu_shim,
             "optimizer-not-loaded": _skip_optimizer_load}


def train(rank, world_size, argv, mutate=None):
    """pretrain(); returns (losses, proof): the data-parallel wrapper's class name and this
    rank's share of the weights' elements (local elements / whole-weight elements) after a step."""
    from torch.distributed.tensor import DTensor

    from tests._train_cases import pretrain_with_step

    restore = MUTATIONS[mutate]() if mutate else (lambda: None)
    proof = {}

    def wrap(step):
        def train_step(self, data_iterator):
            out = step(self, data_iterator)
            chunk = self.model[0]
            # the weights as the wrapper keeps them between steps (Megatron-FSDP: DTensors over
            # its sharded buffers, gathered only inside a layer's forward and backward)
            weights = [t for t in chunk.state_dict().values() if hasattr(t, "numel")]
            local = sum(t.to_local().numel() if isinstance(t, DTensor) else t.numel()
                        for t in weights)
            proof.update(wrapper=type(chunk).__name__,
                         share=local / sum(t.numel() for t in weights),
                         unit=chunk.ddp_config.suggested_communication_unit_size)
            return out
        return train_step

    try:
        losses = pretrain_with_step(argv, wrap)["history"]["lm_loss"]
    finally:
        restore()
    return losses, proof
