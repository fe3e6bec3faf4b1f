"""Spawned-rank body for tests/test_cuda_graph.py: pretrain() with --cuda-graph-impl full_iteration
accepted as on a GPU, megatron-core's FullCudaGraphWrapper replaced by an emulated capture that
runs every post-warm-up call of the region under the host-read counter (a real capture fails at
the first host read of device data), with optional mutations that bring a host read back."""

from __future__ import annotations

import collections

import torch


class EmulatedCapture:
    """Stands in for FullCudaGraphWrapper (same arguments): ``warmup`` eager calls per stage
    (training / validation), then each call of ``forward_backward`` under the host-read counter,
    where on CUDA the wrapper would capture once and replay."""

    instances = []
    counter = None   # the host-read counter of the call in progress

    def __init__(self, forward_backward, warmup_steps, single_mempool):
        self.forward_backward, self.warmup = forward_backward, warmup_steps
        self.calls = collections.Counter()
        self.reads = collections.defaultdict(list)   # stage -> [(owner, where, what)]
        EmulatedCapture.instances.append(self)

    def __call__(self, **kwargs):
        from tests._sync_counter import CaptureCounter

        stage = "validation" if kwargs["forward_only"] else "training"
        self.calls[stage] += 1
        self.config_impl = kwargs["model"][0].config.cuda_graph_impl
        if self.calls[stage] <= self.warmup:
            return self.forward_backward(**kwargs)
        with CaptureCounter() as counter:
            EmulatedCapture.counter = counter
            try:
                out = self.forward_backward(**kwargs)
            finally:
                EmulatedCapture.counter = None
        self.reads[stage] += [(owner, where, what) for _, owner, where, what in counter.reads]
        return out


def _record_dispatcher_host_copies():
    """megatron-core's alltoall dispatcher copies its counts to the host on a side stream at
    ``cuda_dtoh_point`` and waits for the copy at ``cuda_sync_point``; on a CPU build both are
    no-ops (compat/cpu.py), so the counter cannot see them. On CUDA the copy is a device-to-host
    read and the wait (an event synchronize) fails a capture: record each reached point as a
    read, as megatron-core's code decides (not under ``drop_and_pad``)."""
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher as td

    reach = td._maybe_dtoh_and_synchronize

    def recorded(self, point, tokens_per_expert=None):
        counter = EmulatedCapture.counter
        if counter is not None and not self.drop_and_pad:
            for kind, at in (("copy", self.cuda_dtoh_point), ("wait", self.cuda_sync_point)):
                if point == at:
                    counter._record(f"alltoall dispatcher's host {kind} at {point}")
        return reach(self, point, tokens_per_expert)

    td._maybe_dtoh_and_synchronize = recorded


def _mutate_counts_on_host():
    """Our layers leave megatron-core's copy and wait points as it sets them."""
    from megatron_moe.moe import layer

    layer.keep_counts_on_device = lambda td: False


def _mutate_loss_func(extra):
    import pretrain_gpt_moe

    orig = pretrain_gpt_moe.loss_func

    def loss_func(*a, **k):
        out = orig(*a, **k)
        extra(out[0])
        return out

    pretrain_gpt_moe.loss_func = loss_func


MUTATIONS = {
    # the loss read on the host every micro-batch
    "loss-item": lambda: _mutate_loss_func(lambda loss: loss.detach().sum().item()),
    # a host wait every micro-batch
    "synchronize": lambda: _mutate_loss_func(lambda loss: torch.cuda.synchronize()),
    # a tensor made from Python data on the loss's device every micro-batch
    "host-to-device": lambda: _mutate_loss_func(
        lambda loss: torch.tensor([1.0], device=loss.device)),
    "counts-on-host": lambda: _mutate_counts_on_host(),
}


def train(rank, world_size, argv, mutate=None):
    """(losses, {stage: calls}, {stage: [(owner, where, what)] read after warm-up}, the model
    config's cuda_graph_impl as megatron-core saw it)."""
    from megatron_moe import arguments
    from megatron_moe.compat import cuda_graph as compat
    from tests._train_cases import _pretrain

    from megatron_moe.compat.versions import mcore_at_least
    from megatron_moe.runtime import initialize

    arguments._cuda_available = lambda: True   # parse as on a GPU
    compat.full_cuda_graph_wrapper = EmulatedCapture
    # CUDA-only parts, left out on the CPU: megatron-core's graph-safe RNG states (CUDA generator
    # states) and core_v0.16's per-module CudaGraphManager, which its "local" impl builds (it asks
    # the device's compute capability); test_both_spellings_reach_megatron_cores_config checks
    # the config fields on both releases
    seed = initialize.set_random_seed
    initialize.set_random_seed = lambda s, cudagraphable=False: seed(s)
    if not mcore_at_least("0.19"):
        compat.full_iteration_config_fields = lambda: dict(cuda_graph_impl="none")
    _record_dispatcher_host_copies()
    for name in mutate or ():
        MUTATIONS[name]()
    losses = _pretrain(argv)["history"]["lm_loss"]
    (capture,) = EmulatedCapture.instances
    return losses, dict(capture.calls), dict(capture.reads), capture.config_impl
