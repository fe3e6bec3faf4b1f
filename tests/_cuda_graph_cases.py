"""Spawned-rank body for tests/test_cuda_graph.py: pretrain() with --cuda-graph-impl full_iteration
accepted as on a GPU, megatron-core's FullCudaGraphWrapper replaced by an emulated capture that
runs every post-warm-up call of the region under the host-read counter (a real capture fails at
the first host read of device data) and checks that its backward reaches no AccumulateGrad node
made before the call (a real capture fails accumulating into a node of the default stream), with
optional mutations that bring a host read or a kept node back."""

from __future__ import annotations

import collections

import torch


# marks the AccumulateGrad nodes alive before a captured call (an autograd node's metadata dict
# lives on the node: a node made later lacks it)
_BEFORE = "tests.made_before_the_capture"


class EmulatedCapture:
    """Stands in for FullCudaGraphWrapper (same arguments): ``warmup`` eager calls per stage
    (training / validation), then each call of ``forward_backward`` under the host-read counter,
    where on CUDA the wrapper would capture once and replay. Before a training call past the
    warm-up, every parameter's AccumulateGrad node alive then is marked; each micro-batch's loss
    graph is walked (``walk_loss``) for the AccumulateGrad nodes its backward accumulates into."""

    instances = []
    counter = None   # the host-read counter of the call in progress
    capturing = None  # the instance whose training call past the warm-up is in progress

    def __init__(self, forward_backward, warmup_steps, single_mempool):
        self.forward_backward, self.warmup = forward_backward, warmup_steps
        self.calls = collections.Counter()
        self.reads = collections.defaultdict(list)   # stage -> [(owner, where, what)]
        self.accumulators = 0   # AccumulateGrad nodes the captured backwards reach
        self.stale = []         # the parameters of those of them made before the call
        EmulatedCapture.instances.append(self)

    def __call__(self, **kwargs):
        from tests._sync_counter import CaptureCounter

        stage = "validation" if kwargs["forward_only"] else "training"
        self.calls[stage] += 1
        self.model = kwargs["model"]
        self.config_impl = kwargs["model"][0].config.cuda_graph_impl
        if self.calls[stage] <= self.warmup:
            return self.forward_backward(**kwargs)
        if stage == "training":
            self._mark_nodes_alive()
            EmulatedCapture.capturing = self
        with CaptureCounter() as counter:
            EmulatedCapture.counter = counter
            try:
                out = self.forward_backward(**kwargs)
            finally:
                EmulatedCapture.counter = EmulatedCapture.capturing = None
        self.reads[stage] += [(owner, where, what) for _, owner, where, what in counter.reads]
        return out

    def _mark_nodes_alive(self):
        """Mark each parameter's AccumulateGrad node alive now (what DDP or an old graph keeps:
        on CUDA made on the default stream, not the capture's). The probe makes a node where none
        is alive; that one goes with the probe, unmarked as far as the call can see."""
        from megatron_moe.compat.ddp import grad_accumulator

        for chunk in self.model:
            for p in chunk.parameters():
                if p.requires_grad:
                    grad_accumulator(p).metadata[_BEFORE] = True

    def walk_loss(self, loss):
        """Count the AccumulateGrad nodes of ``loss``'s graph; note the parameters of those
        marked before the call (the node a real capture's backward fails on)."""
        names = {id(p): n for chunk in self.model for n, p in chunk.named_parameters()}
        seen, todo = {}, [loss.grad_fn]
        while todo:
            node = todo.pop()
            if node is None or id(node) in seen:
                continue
            seen[id(node)] = node    # held: ids stay unique during the walk
            if type(node).__name__ == "AccumulateGrad":
                self.accumulators += 1
                if _BEFORE in node.metadata:
                    self.stale.append(names.get(id(node.variable), tuple(node.variable.shape)))
            todo.extend(n for n, _ in node.next_functions)


def _walk_each_loss():
    """Each micro-batch's loss walked (EmulatedCapture.walk_loss) in captured training calls."""
    _mutate_loss_func(lambda loss: EmulatedCapture.capturing and
                      EmulatedCapture.capturing.walk_loss(loss))


def _count_ddp_hooks():
    """megatron-core DDP's backward hooks counted by where they run: on an AccumulateGrad node
    (autograd passes the node's grads) or on the parameter after accumulation (no arguments,
    compat.ddp.hook_parameters)."""
    from megatron.core.distributed import DistributedDataParallel as DDP

    counts = collections.Counter()
    make = DDP._make_backward_post_hook

    def counted(self, param):
        hook = make(self, param)

        def run(*args):
            counts["node" if args else "parameter"] += 1
            return hook(*args)
        return run

    DDP._make_backward_post_hook = counted
    return counts


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


def _layers_as_under_a_full_iteration_config():
    """core_v0.16's config says "none" here (above): our MoE layers decide as with its
    full-iteration fields (the counts stay on the device either way; the dispatcher's kept graph
    is dropped after each forward, compat/dispatch.py drop_kept_graph)."""
    from megatron_moe.moe import layer

    init = layer.MoELayer.__init__

    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.drops_kept_graph = True

    layer.MoELayer.__init__ = __init__


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
    # DDP's hooks left on the AccumulateGrad nodes it keeps from its construction
    "ddp-nodes-kept": lambda: _mutate_ddp_nodes_kept(),
    # megatron-core's dispatchers keep the last forward's probs with their graph
    "dispatcher-graph": lambda: _mutate_dispatcher_graph(),
}


def _mutate_dispatcher_graph():
    from megatron_moe.moe import layer

    layer.drop_kept_graph = lambda td: 0


def _mutate_ddp_nodes_kept():
    from megatron_moe.compat import ddp

    ddp.hook_parameters = lambda model_chunks: 0


def train(rank, world_size, argv, mutate=None):
    """losses and grad norms; calls {stage: calls}; reads {stage: [(owner, where, what)] read
    after warm-up}; impl: the model config's cuda_graph_impl as megatron-core saw it;
    accumulators / stale: the AccumulateGrad nodes the captured backwards reach / the parameters
    of those made before the call; hooks: DDP's hooks run, by where (node / parameter);
    grad_accs: the nodes each DDP chunk keeps at the end; wgrads_into_main_grad: the grouped
    experts' weight grads added into DDP's main_grad in their backward."""
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
        _layers_as_under_a_full_iteration_config()
    _record_dispatcher_host_copies()
    _walk_each_loss()
    hooks = _count_ddp_hooks()
    for name in mutate or ():
        MUTATIONS[name]()
    history = _pretrain(argv)["history"]
    (capture,) = EmulatedCapture.instances
    from megatron_moe.moe.grouped_experts import GroupedSequentialMLP

    return dict(losses=history["lm_loss"], grad_norms=history["grad_norm"],
                calls=dict(capture.calls), reads=dict(capture.reads), impl=capture.config_impl,
                accumulators=capture.accumulators, stale=capture.stale, hooks=dict(hooks),
                grad_accs=[len(chunk.grad_accs) for chunk in capture.model],
                wgrads_into_main_grad=GroupedSequentialMLP.wgrads_into_main_grad)
