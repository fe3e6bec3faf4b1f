"""The one place that teaches megatron-core to run on a CPU-only torch build (gloo).

megatron-core assumes CUDA in a handful of spots (hard-coded ``device="cuda"`` tensors, CUDA RNG
state, CUDA streams, ``param.type() == 'torch.cuda.FloatTensor'`` checks, uneven all-gather that
gloo lacks). Each shim below replaces exactly one such spot and is idempotent. ``apply()`` is a
no-op when CUDA is available, so GPU runs use megatron-core unmodified.

Tested on megatron-core 0.16.1 and 0.19.x (see docs/compat.md). Each shim has a scenario in
tests/test_compat.py that fails without it; a shim a newer release no longer needs (NEEDED_BEFORE)
is not applied there, and its scenario must pass without it.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import time

import torch

_APPLIED = False


# --- helpers --------------------------------------------------------------------------------------
class _CpuTorchProxy:
    """Stands in for ``torch`` inside one megatron-core module: ``device='cuda'`` becomes cpu, and
    ``pin_memory=True`` (a staging buffer for a host-to-device copy) is dropped: a CPU-only build
    has no pinned-memory allocator."""

    _FACTORIES = ("zeros", "ones", "empty", "tensor", "full", "arange", "zeros_like", "empty_like")

    def __getattr__(self, name):
        attr = getattr(torch, name)
        if name not in self._FACTORIES:
            return attr

        def factory(*args, **kwargs):
            device = kwargs.get("device")
            if device == "cuda" or (isinstance(device, torch.device) and device.type == "cuda"):
                kwargs["device"] = torch.device("cpu")  # an object: comm/strict.py reads it as the data device
            if kwargs.get("pin_memory"):
                kwargs["pin_memory"] = False
            return attr(*args, **kwargs)

        return factory


class _NoopEvent:
    # With no device queue an event completes when recorded; its timestamp serves elapsed_time
    # (megatron-core's static text-generation controller times every decode step with events).
    def __init__(self, *args, **kwargs):
        self._t = None

    def record(self, stream=None):
        self._t = time.perf_counter()

    def elapsed_time(self, end):
        if self._t is None or end._t is None:
            return 0.0
        return (end._t - self._t) * 1000.0

    def wait(self, stream=None):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True


class _NoopStream:
    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, other):
        pass

    def wait_event(self, event):
        pass

    def record_event(self, event=None):
        return event or _NoopEvent()

    def synchronize(self):
        pass

    def query(self):
        return True


_NOOP_STREAM = _NoopStream()

# Modules that build tensors with a literal device="cuda".
HARDCODED_CUDA_MODULES = (
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.optimizer.distrib_optimizer",
    "megatron.core.optimizer.grad_scaler",
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.distributed.distributed_data_parallel",
    "megatron.core.distributed.finalize_model_grads",
    "megatron.core.utils",
    "megatron.core.transformer.utils",
    "megatron.core.transformer.moe.moe_utils",
    "megatron.core.transformer.moe.router",
    "megatron.core.rerun_state_machine",   # its all-reduce of the re-run verdict
    # RoPE under context parallelism: this CP rank's positions, a pinned index copied to CUDA
    "megatron.core.models.common.embeddings.rope_utils",
)


# --- the shims ------------------------------------------------------------------------------------
def patch_torch_cuda():
    """torch.cuda.{current_device,synchronize,Stream,Event,...} raise on a CPU build."""
    torch.cuda.current_device = lambda: torch.device("cpu")
    # the rerun state machine saves and restores the "CUDA" generator around a re-run: the CPU's
    torch.cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    torch.cuda.set_rng_state = lambda new_state, device="cuda": torch.set_rng_state(new_state)
    torch.cuda.synchronize = lambda device=None: None
    torch.cuda.Stream = _NoopStream
    torch.cuda.Event = _NoopEvent
    torch.cuda.current_stream = lambda device=None: _NOOP_STREAM
    torch.cuda.default_stream = lambda device=None: _NOOP_STREAM
    torch.cuda.stream = lambda stream=None: contextlib.nullcontext()


def patch_rng_tracker():
    """The model-parallel RNG tracker stores CUDA RNG states; keep CPU generator states instead."""
    from megatron.core.tensor_parallel import random as mrandom

    if getattr(mrandom.CudaRNGStatesTracker, "_megatron_moe_cpu", False):
        return

    class CpuRNGStatesTracker(mrandom.CudaRNGStatesTracker):
        _megatron_moe_cpu = True

        def add(self, name, seed):
            self._is_initialized = True
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            self.seeds_.add(seed)
            if name in self.states_:
                raise Exception(f"rng state {name} already exists")
            saved = torch.get_rng_state()
            torch.manual_seed(seed)
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(saved)

        @contextlib.contextmanager
        def fork(self, name=mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME):
            if name not in self.states_:
                raise Exception(f"rng state {name} is not added")
            saved, saved_name = torch.get_rng_state(), self._current_state_name
            if saved_name != "default-rng":
                self.states_[saved_name] = saved
            torch.set_rng_state(self.states_[name])
            self._current_state_name = name
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                if saved_name != "default-rng":
                    saved = self.states_[saved_name]
                torch.set_rng_state(saved)
                self._current_state_name = saved_name

    mrandom.CudaRNGStatesTracker = CpuRNGStatesTracker
    mrandom.initialize_rng_tracker(force_reset=True)
    # Activation recomputation (CheckpointFunction) saves and restores the "CUDA" generator next
    # to the CPU one; on a CPU build the device generator is the CPU generator.
    mrandom._get_cuda_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda new_state, *args, **kwargs: torch.set_rng_state(new_state)


def patch_alltoall_dispatcher():
    """The alltoall dispatcher opens a CUDA side stream for device-to-host copies of the splits."""
    from megatron.core.transformer.moe import token_dispatcher as td

    cls = td.MoEAlltoAllTokenDispatcher
    if getattr(cls, "_megatron_moe_cpu", False):
        return
    cls.cuda_dtoh_stream = _NOOP_STREAM

    def _maybe_dtoh_and_synchronize(self, point, tokens_per_expert=None):
        if not self.drop_and_pad and point == self.cuda_dtoh_point:
            as_numpy = lambda t: t.numpy() if torch.is_tensor(t) else t  # noqa: E731
            self.input_splits = as_numpy(self.input_splits)
            self.output_splits = as_numpy(self.output_splits)
            self.output_splits_tp = as_numpy(self.output_splits_tp)
        return tokens_per_expert

    cls._maybe_dtoh_and_synchronize = _maybe_dtoh_and_synchronize
    cls._megatron_moe_cpu = True


def patch_te_general_gemm():
    """megatron-core 0.16 references ``te_general_gemm`` unguarded when TE is absent (0.17 binds it
    to None itself, so the shim is dropped there: see ``NEEDED_BEFORE``)."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def patch_torch_norm_sequence_parallel():
    """The torch LayerNorm fallback refuses sequence parallelism, which MoE with TP>1 requires.

    With SP the norm weights see only a sequence shard; tagging them ``sequence_parallel`` makes
    megatron-core all-reduce their grads over TP, exactly as it does for TE/apex norms.
    """
    from megatron.core.transformer import torch_norm

    if getattr(torch_norm.WrappedTorchNorm, "_megatron_moe_cpu", False):
        return

    def __new__(cls, config, hidden_size, eps=1e-5, persist_layer_norm=False,
                zero_centered_gamma=False, normalization="LayerNorm"):
        assert not config.layernorm_zero_centered_gamma, "zero-centered gamma needs TE or apex"
        norm_cls = {"LayerNorm": torch.nn.LayerNorm, "RMSNorm": torch.nn.RMSNorm}[config.normalization]
        module = norm_cls(normalized_shape=hidden_size, eps=eps)
        for p in module.parameters():
            setattr(p, "sequence_parallel", config.sequence_parallel)
        return module

    torch_norm.WrappedTorchNorm.__new__ = __new__
    torch_norm.WrappedTorchNorm._megatron_moe_cpu = True


def patch_uneven_collectives():
    """gloo has no uneven all-gather / reduce-scatter; pad (gather) or reduce then slice (scatter)."""
    import torch.distributed as dist
    from megatron.core.tensor_parallel import mappings

    if getattr(mappings, "_megatron_moe_cpu", False):
        return
    orig_gather, orig_rs = mappings._gather_along_first_dim, mappings._reduce_scatter_along_first_dim

    def _gather(input_, group, output_split_sizes=None, use_global_buffer=False):
        if output_split_sizes is None or group.size() == 1:
            return orig_gather(input_, group, output_split_sizes, use_global_buffer)
        sizes = [int(s) for s in output_split_sizes]
        biggest = max(sizes)
        padded = input_.new_zeros((biggest,) + tuple(input_.shape[1:]))
        padded[: input_.shape[0]] = input_
        out = input_.new_empty((biggest * group.size(),) + tuple(input_.shape[1:]))
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(out, padded.contiguous(), group=group)
        return torch.cat([out[i * biggest: i * biggest + s] for i, s in enumerate(sizes)], dim=0)

    def _reduce_scatter(input_, group, input_split_sizes=None, use_global_buffer=False):
        if input_split_sizes is None or group.size() == 1:
            return orig_rs(input_, group, input_split_sizes, use_global_buffer)
        full = input_.contiguous().clone()
        dist.all_reduce(full, group=group)
        return torch.split(full, [int(s) for s in input_split_sizes], dim=0)[group.rank()].clone()

    mappings._gather_along_first_dim = _gather
    mappings._reduce_scatter_along_first_dim = _reduce_scatter
    mappings._megatron_moe_cpu = True


def patch_hardcoded_cuda_devices():
    """Replace ``torch`` inside the modules that build ``device='cuda'`` tensors."""
    for name in HARDCODED_CUDA_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:  # module moved in another megatron-core version
            continue
        if not isinstance(module.torch, _CpuTorchProxy):
            module.torch = _CpuTorchProxy()


class _UnevenAllGather:
    """``torch.distributed`` with an all_gather that takes per-rank tensors of different sizes
    (NCCL does, gloo does not): every rank sends its tensor padded to the largest, then each
    slot gets its own length back."""

    def __getattr__(self, name):
        return getattr(torch.distributed, name)

    @staticmethod
    def all_gather(tensor_list, tensor, group=None, async_op=False):
        sizes = [t.numel() for t in tensor_list]
        if len(set(sizes)) == 1:
            return torch.distributed.all_gather(tensor_list, tensor, group=group, async_op=async_op)
        biggest = max(sizes)
        padded = tensor.new_zeros(biggest)
        padded[: tensor.numel()] = tensor.reshape(-1)
        slots = [tensor.new_empty(biggest) for _ in sizes]
        torch.distributed.all_gather(slots, padded, group=group)
        for out, slot, size in zip(tensor_list, slots, sizes):
            if out.data_ptr() != tensor.data_ptr():
                out.copy_(slot[:size].view_as(out))
        return None


class _LayerWiseCpuTorch(_CpuTorchProxy):
    distributed = _UnevenAllGather()


def patch_layer_wise_optimizer():
    """megatron-core 0.19's layer-wise distributed optimizer (Muon with --use-distributed-optimizer
    or dist_muon) builds a ``device='cuda'`` flag tensor and all-gathers each rank's updated
    params with uneven sizes, which gloo refuses."""
    try:
        module = importlib.import_module("megatron.core.optimizer.layer_wise_optimizer")
    except ImportError:  # megatron-core 0.16.1 (no Muon), or emerging-optimizers absent
        return
    if not isinstance(module.torch, _LayerWiseCpuTorch):
        module.torch = _LayerWiseCpuTorch()


def patch_param_type():
    """Optimizers check ``param.type() == 'torch.cuda.FloatTensor'``; report CPU params that way."""
    if getattr(torch.nn.Parameter, "_megatron_moe_cpu", False):
        return
    orig_type = torch.Tensor.type

    def _type(self, dtype=None, non_blocking=False, **kwargs):
        if dtype is None and not kwargs:
            name = orig_type(self)
            return name.replace("torch.", "torch.cuda.", 1) if self.device.type == "cpu" else name
        return orig_type(self, dtype, non_blocking, **kwargs)

    torch.nn.Parameter.type = _type
    torch.nn.Parameter._megatron_moe_cpu = True


def patch_clip_grads():
    """clip_grad_by_total_norm_fp32 asserts CUDA grads and uses apex's multi_tensor_scale."""
    from megatron.core.optimizer import clip_grads
    from megatron.core.optimizer import optimizer as mopt

    def clip_grad_by_total_norm_fp32(parameters, max_norm, total_norm, use_decoupled_grad=False):
        if isinstance(parameters, torch.Tensor):
            parameters = [parameters]
        attr = "decoupled_grad" if use_decoupled_grad else "grad"
        grads = [getattr(p, attr).detach() for p in parameters if getattr(p, attr, None) is not None]
        coeff = max_norm / (total_norm + 1.0e-6)
        if coeff < 1.0 and grads:
            torch._foreach_mul_(grads, coeff)

    clip_grads.clip_grad_by_total_norm_fp32 = clip_grad_by_total_norm_fp32
    mopt.clip_grad_by_total_norm_fp32 = clip_grad_by_total_norm_fp32


def patch_tensor_cuda():
    """``tensor.cuda()`` (tied embeddings under PP, optimizer state load) raises on a CPU build.

    On a CPU-only build there is no device to move to, so keep the tensor where it is.
    """
    if getattr(torch.Tensor.cuda, "_megatron_moe_cpu", False):
        return

    def cuda(self, device=None, non_blocking=False, memory_format=torch.preserve_format):
        return self

    cuda._megatron_moe_cpu = True
    torch.Tensor.cuda = cuda


class _FsdpCpuTorch(_CpuTorchProxy):
    """``torch`` inside Megatron-FSDP: it names its device ``cuda:<current_device()>`` (and
    ``torch.device("cuda", ...)``), which a CPU build cannot make: those are the host."""

    @staticmethod
    def device(*args, **kwargs):
        if args and str(args[0]).startswith("cuda"):
            return torch.device("cpu")
        return torch.device(*args, **kwargs)


class _CpuDeviceMesh:
    """``DeviceMesh`` for Megatron-FSDP's adapter, which builds its meshes with
    ``device_type="cuda"``: the same mesh over the host (gloo)."""

    def __getattr__(self, name):
        from torch.distributed import DeviceMesh

        return getattr(DeviceMesh, name)

    @staticmethod
    def from_group(*args, device_type="cuda", **kwargs):
        from torch.distributed import DeviceMesh

        return DeviceMesh.from_group(*args, device_type="cpu" if device_type == "cuda"
                                     else device_type, **kwargs)


MEGATRON_FSDP_MODULES = tuple(
    "megatron.core.distributed.fsdp." + name
    for name in ("mcore_fsdp_adapter", "src.megatron_fsdp.megatron_fsdp",
                 "src.megatron_fsdp.param_and_grad_buffer", "src.megatron_fsdp.utils",
                 "src.megatron_fsdp.fully_shard", "src.megatron_fsdp.uneven_dtensor",
                 "src.megatron_fsdp.mixed_precision"))


def patch_megatron_fsdp():
    """Megatron-FSDP (--use-megatron-fsdp) places its buffers, DTensors and meshes on ``cuda``;
    on a CPU build they go to the host."""
    for name in MEGATRON_FSDP_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:  # module moved in another megatron-core version
            continue
        if hasattr(module, "torch") and not isinstance(module.torch, _FsdpCpuTorch):
            module.torch = _FsdpCpuTorch()
        if name.endswith("mcore_fsdp_adapter"):   # the others use it in isinstance checks
            module.DeviceMesh = _CpuDeviceMesh()


class _KeptSend:
    """A gloo pipeline send, kept in ``_UNWAITED_SENDS`` until waited, with an alias of the memory
    it sends from (megatron-core's deallocate_output_tensor swaps the tensor's ``.data`` after the
    send); ``wait()`` may be called twice (gloo's own send handle would block on a second wait)."""

    def __init__(self, work, tensor):
        self._work, self._memory = work, tensor.detach()
        self.waited = False
        _UNWAITED_SENDS.append(self)

    def wait(self, *args, **kwargs):
        if not self.waited:
            self._work.wait(*args, **kwargs)
            self.waited, self._memory = True, None
            _UNWAITED_SENDS.remove(self)
        return True

    def is_completed(self):
        return self.waited


# gloo pipeline sends not waited yet (a handful at a time), and how many megatron-core left
# unwaited at the end of a schedule call (the count proves the shim ran; tests read it)
_UNWAITED_SENDS: list = []
PIPELINE_SENDS_COMPLETED_AFTER_SCHEDULE = [0]


def patch_pipeline_sends():
    """The interleaved schedule with ``overlap_p2p_comm_warmup_flush`` never waits on its last
    send_next: in a forward-only call (evaluation) the first stage returns and drops its handle.
    On NCCL the send runs on its stream anyway. gloo sends only when the peer has posted the
    matching receive, and a send whose handle is dropped before that is lost: the next stage then
    waits forever for its input (megatron-core 0.16.1, schedules.py's warm-up loop; 0.19 waits
    on each send at once under deallocate_pipeline_outputs, which the builder sets as
    Megatron-LM does). With deallocate_pipeline_outputs 0.16 also frees a sent output's data
    before its gloo send completed (a NaN on the next stage): the kept send holds that memory.
    So on gloo every pipeline send is kept until waited, and the sends megatron-core left
    unwaited are completed when the schedule returns. NCCL groups are untouched."""
    from megatron.core.pipeline_parallel import p2p_communication, schedules

    if getattr(p2p_communication._p2p_ops, "_megatron_moe_cpu", False):
        return
    p2p_ops = p2p_communication._p2p_ops
    interleaved = schedules.forward_backward_pipelining_with_interleaving

    @functools.wraps(p2p_ops)
    def kept_sends_p2p_ops(**kwargs):
        reqs = p2p_ops(**kwargs)
        if torch.distributed.get_backend(kwargs["group"]) == "gloo":
            for name in ("send_next", "send_prev"):
                if name in reqs:
                    reqs[name] = _KeptSend(reqs[name], kwargs[f"tensor_{name}"])
        return reqs

    @functools.wraps(interleaved)
    def sends_completed_interleaved(*args, **kwargs):
        out = interleaved(*args, **kwargs)
        while _UNWAITED_SENDS:
            _UNWAITED_SENDS[0].wait()
            PIPELINE_SENDS_COMPLETED_AFTER_SCHEDULE[0] += 1
        return out

    kept_sends_p2p_ops._megatron_moe_cpu = True
    p2p_communication._p2p_ops = kept_sends_p2p_ops
    schedules.forward_backward_pipelining_with_interleaving = sends_completed_interleaved


SHIMS = (
    patch_torch_cuda,
    patch_rng_tracker,
    patch_alltoall_dispatcher,
    patch_te_general_gemm,
    patch_torch_norm_sequence_parallel,
    patch_uneven_collectives,
    patch_hardcoded_cuda_devices,
    patch_layer_wise_optimizer,
    patch_param_type,
    patch_clip_grads,
    patch_tensor_cuda,
    patch_pipeline_sends,
    patch_megatron_fsdp,
)


# Shims that a newer megatron-core no longer needs: name -> first release that fixed it.
NEEDED_BEFORE = {"patch_te_general_gemm": "0.17"}


def active_shims():
    """The shims the installed megatron-core needs."""
    from megatron_moe.compat.versions import mcore_at_least

    return tuple(s for s in SHIMS
                 if s.__name__ not in NEEDED_BEFORE or not mcore_at_least(NEEDED_BEFORE[s.__name__]))


def apply(force: bool = False) -> bool:
    """Apply every shim once, only when CUDA is unavailable (or ``force``). Returns True if applied."""
    global _APPLIED
    if _APPLIED:
        return True
    if torch.cuda.is_available() and not force:
        return False
    for shim in active_shims():
        shim()
    _APPLIED = True
    return True
