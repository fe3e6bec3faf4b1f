"""ExpertOffload: MoESys hierarchical storage for the experts of a megatron-core model.

The expert parameters stay registered in megatron-core's DDP and optimizer exactly as in resident
training; only where their storage lives changes (so the update is megatron-core's own: Adam,
weight decay, clipping with the global grad norm, the LR schedule):

* ``host``: between uses every expert parameter's ``.data`` is a view into a per-layer host
  buffer (pinned on CUDA); its main grad (DDP's buffer) and Adam moments stay on the host, where
  the torch optimizer creates them (the parameter lives there at step time).
* ``ssd``: between uses parameters and Adam moments are zero-byte placeholders; the fp32 master
  weights and moments live in a file (pread/pwrite) behind a bounded LFU host cache; the optimizer
  step runs layer by layer with each layer's states pinned in the cache (torch's Adam updates every
  parameter independently, so a per-layer step is the whole step, bit for bit).
* The compute device holds a ``SlotArena`` of K layers. Forward pre-hook of MoE layer i: wait for
  its copy, point the experts' ``.data`` at the slot, queue the next K-1 layers (i+1, ... then the
  backward order) on the ``CopyLink`` thread. Backward: a hook on the layer's output gradient does
  the same in reverse order (i-1, ...); when every expert parameter of the layer has accumulated
  its gradient the layer is unbound (autograd's saved weights are the parameter itself, so they see
  whatever ``.data`` points at when backward runs, which is why backward re-binds the slot).
* A slot stays valid ("cached") after its layer is unbound until evicted (LRU among unbound
  layers outside the prefetch window) or until the optimizer step changes the weights.
"""

from __future__ import annotations

import contextlib
import os
import time

import torch

from megatron_moe.compat import ddp as ddp_compat
from megatron_moe.offload.link import CopyLink, SlotArena, storage_bytes
from megatron_moe.offload.store import HostCache, SsdFile


def _itemsize(dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def moe_layers(model_chunks):
    """(MoE module, experts module) of every MoE layer, in forward order."""
    from megatron_moe.models.builder import unwrap

    out = []
    for chunk in model_chunks:
        decoder = getattr(unwrap(chunk), "decoder", None)
        for layer in getattr(decoder, "layers", []):
            mlp = getattr(layer, "mlp", None)
            experts = getattr(mlp, "experts", None)
            if experts is not None and any(True for _ in experts.parameters()):
                out.append((mlp, experts))
    return out


def set_data(p, data):
    """``p.data = data``. Every ``.data`` the manager sets goes through here: on the CPU the tests
    emulate here what a change of device does on CUDA (megatron_moe/compat/ddp.py)."""
    p.data = data


def set_data_with_grad(p, data):
    """set_data, carrying ``p.grad`` to data's device (torch checks .grad against .data)."""
    g = p.grad
    if g is not None and g.device != data.device:
        p.grad = None
        set_data(p, data)
        p.grad = g.to(data.device)
    else:
        set_data(p, data)


def _leaf_optimizers(optimizer):
    if optimizer is None:
        return []
    if hasattr(optimizer, "chained_optimizers"):
        return [o for sub in optimizer.chained_optimizers for o in _leaf_optimizers(sub)]
    return [optimizer]


def torch_optimizers(optimizer):
    """The torch optimizers inside a megatron-core (chained) optimizer."""
    if optimizer is None:
        return []
    if hasattr(optimizer, "chained_optimizers"):
        return [o for sub in optimizer.chained_optimizers for o in torch_optimizers(sub)]
    inner = getattr(optimizer, "optimizer", None)
    return [inner] if isinstance(inner, torch.optim.Optimizer) else []


class _Layer:
    def __init__(self, index, mlp, experts):
        self.index = index
        self.mlp = mlp
        self.params = list(experts.parameters())
        dtypes = {p.dtype for p in self.params}
        if len(dtypes) != 1:
            raise ValueError(f"expert offload: MoE layer {index} mixes parameter dtypes {dtypes}")
        self.dtype = dtypes.pop()
        # recorded now: between uses .data is a zero-element placeholder (no NaN fill), so the
        # parameter's own shape and numel read [0] and 0 there
        self.shapes = [p.shape for p in self.params]
        self.numels = [p.numel() for p in self.params]
        self.offsets = [sum(self.numels[:k]) for k in range(len(self.numels))]
        self.numel = sum(self.numels)
        self.nbytes = self.numel * _itemsize(self.dtype)
        self.host = None          # host tier: flat host buffer
        self.host_views = None
        self.poison = None        # what .data points at between uses (never the host copy)
        self.stand_ins = None     # shape-true NaN views of 4 bytes: the ssd tier's step view
        self.slot = None
        self.slot_views = None
        self.handle = None
        self.version = -1
        self.bound = False
        self.on_host = False      # bound to host tensors (a host step, a checkpoint): see _unbind
        self.last_bound = 0
        self.bwd_left = 0

    def views(self, flat):
        return [flat[o:o + n].view(shape) for shape, o, n in zip(self.shapes, self.offsets, self.numels)]

    def bind(self, tensors, carry_grads=False):
        put = set_data_with_grad if carry_grads else set_data
        for p, t in zip(self.params, tensors):
            put(p, t)


class ExpertOffload:
    def __init__(self, args, model_chunks, optimizer=None, device=None):
        self.args = args
        self.mode = args.moe_expert_offload
        assert self.mode in ("host", "ssd")
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) \
                if torch.cuda.is_available() else torch.device("cpu")
        self.device = torch.device(device)
        pin = self.device.type == "cuda"
        self.layers = [_Layer(i, mlp, ex) for i, (mlp, ex) in enumerate(moe_layers(model_chunks))]
        if not self.layers:
            raise ValueError("--moe-expert-offload: the model has no MoE layer with experts")
        self.k = min(args.moe_offload_cache_layers, len(self.layers))
        self.nan_fill = bool(args.moe_offload_debug_nan_fill)
        dtypes = {l.dtype for l in self.layers}
        slot_numel = {d: max(l.numel for l in self.layers if l.dtype == d) for d in dtypes}
        self.arena = SlotArena(slot_numel, self.k, device=self.device, nan_fill=self.nan_fill)
        # debug mode also jitters the link so a missing wait cannot pass by lucky timing
        self.link = CopyLink(args.moe_offload_link_gbps, device=self.device,
                             jitter_s=0.002 if self.nan_fill else 0.0)
        self.version = 0
        self.clock = 0
        self.steps = 0
        self.cache = None
        self._param_layer = {}
        for layer in self.layers:
            for p in layer.params:
                self._param_layer[p] = layer
        # DDP's grad hook sits on each parameter's AccumulateGrad node, which autograd drops when
        # .data changes device (binding host copies on CUDA): found now, renewed in _unbind
        self._ddp_nodes = ddp_compat.hooked_accumulators(model_chunks, self._param_layer)
        self.grad_hooks_renewed = 0
        for layer in self.layers:
            # between uses: NaN (debug; a missed bind computes NaN) or a zero-element tensor (a
            # missed bind fails on the shape); never the host copy, which would pass silently
            layer.stand_ins = [torch.full((), float("nan"), dtype=p.dtype, device=self.device)
                               .expand(p.shape) for p in layer.params]
            layer.poison = layer.stand_ins if self.nan_fill else \
                [torch.empty(0, dtype=p.dtype, device=self.device) for p in layer.params]
        # what resident training holds on the device for these experts' weights, read from their
        # storages before they move (the arena's figure is read the same way)
        self.resident_bytes = storage_bytes(p.data for l in self.layers for p in l.params)
        if self.mode == "host":
            for layer in self.layers:
                layer.host = torch.empty(layer.numel, dtype=layer.dtype, pin_memory=pin)
                layer.host_views = layer.views(layer.host)
                for p, v in zip(layer.params, layer.host_views):
                    v.copy_(p.data)
                layer.bind(layer.poison)  # the device copies are freed here
        else:
            rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
            path = os.path.join(args.moe_offload_dir, f"experts_rank{rank:05d}.bin")
            n_mb = max(1, getattr(args, "num_microbatches", 1) or 1)
            # LFU decay period: the cache calls of about one iteration (moesys.md 2.3, note 4)
            self.cache = HostCache(SsdFile(path), int(args.moe_offload_host_cache_gb * 1e9),
                                   policy=getattr(args, "moe_offload_cache_policy", "lfu"),
                                   decay_period=(2 * n_mb + 2) * len(self.layers), pin_memory=pin)
            for layer in self.layers:
                flat = torch.cat([p.data.reshape(-1).float().cpu() for p in layer.params])
                self.cache.add((layer.index, "w"), flat)
                self.cache.add((layer.index, "m"), torch.zeros(2 * layer.numel))
                layer.bind(layer.poison)
        # mixed precision: megatron-core's fp32 master copies of offloaded params go to the host
        # (host copy, device stand-in) of each: see _bind_step_views
        self._masters = {}
        for sub in _leaf_optimizers(optimizer):
            for model_group, main_group in zip(getattr(sub, "float16_groups", []),
                                               getattr(sub, "fp32_from_float16_groups", [])):
                for mp_, main in zip(model_group, main_group):
                    if mp_ in self._param_layer:
                        if main.device.type != "cpu":
                            set_data(main, main.data.cpu().pin_memory() if pin else main.data.cpu())
                        self._masters[main] = (main.data, torch.full(
                            (), float("nan"), dtype=main.dtype, device=self.device
                        ).expand(main.shape))
        offloaded = set(self._param_layer) | set(self._masters)
        self.torch_opts = [o for o in torch_optimizers(optimizer)
                           if any(p in offloaded for g in o.param_groups for p in g["params"])]
        self._hooks = []
        for layer in self.layers:
            self._hooks.append(layer.mlp.register_forward_pre_hook(self._pre_hook(layer)))
            self._hooks.append(layer.mlp.register_forward_hook(self._post_hook(layer)))
            for p in layer.params:
                if p.requires_grad:
                    self._hooks.append(p.register_post_accumulate_grad_hook(self._acc_hook(layer)))
        for opt in self.torch_opts:
            # CUDA: DDP's main grads stay in its device buffer (clipped there with the global
            # norm); the host step needs them, and (host tier) the host copies, on the host
            if self.mode == "host":  # binds the host copies and carries the grads with them
                self._hooks.append(opt.register_step_pre_hook(self._host_step_hook))
            else:
                self._hooks.append(opt.register_step_pre_hook(self._grads_to_host(offloaded)))
                opt.step = self._layerwise_step(opt, opt.step)
        # megatron-core's whole step (grads -> .grad, clip, the torch step, under mixed precision
        # the master -> model copy): see _bind_step_views
        self._optimizer = optimizer
        if optimizer is not None:
            optimizer.step = self._whole_step(optimizer.step)
        self._interval = dict(steps=0, ssd_bytes=self._ssd_bytes())
        self._totals = dict(copy_s=0.0, wait_s=0.0, bytes=0)  # run-wide (the log resets the link's)

    # --- binding and prefetch --------------------------------------------------------------------
    def _free_slot(self, keep):
        if self.arena.free_slots():
            return self.arena.acquire()
        victims = [l for l in self.layers if l.slot is not None and not l.bound and l not in keep]
        if not victims:
            return None
        victim = min(victims, key=lambda l: l.last_bound)
        self._drop(victim)
        return self.arena.acquire()

    def _drop(self, layer):
        if layer.handle is not None:  # never refill a slot a queued copy still writes into
            layer.handle.wait()
            layer.handle = None
        self.arena.release(layer.slot, after=self._compute_event())
        layer.slot, layer.slot_views = None, None

    def _compute_event(self):
        if self.device.type != "cuda":
            return None
        event = torch.cuda.Event()
        event.record()
        return event

    def _load(self, layer, keep) -> bool:
        slot = self._free_slot(keep)
        if slot is None:
            return False
        layer.slot, layer.version = slot, self.version
        dst = self.arena.slot(slot)[layer.dtype][:layer.numel]
        layer.slot_views = layer.views(dst)
        if self.mode == "host":
            layer.handle = self.link.copy([(dst, layer.host)], after=self.arena.ready_event(slot))
        else:
            key, cache = (layer.index, "w"), self.cache

            def job():  # on the copy thread: SSD -> host cache (if missed) -> device slot
                t = cache.get(key, pin=True)
                try:
                    dst.copy_(t, non_blocking=dst.is_cuda)
                    if dst.is_cuda:  # the entry may be evicted once unpinned: copy done first
                        torch.cuda.current_stream().synchronize()
                finally:
                    cache.unpin(key)
            # on CUDA the copy stream waits for the slot's last reader (and its NaN fill): the
            # ssd runs of the first GPU run had no such wait and lost bit-equality from step 2
            layer.handle = self.link.submit(job, nbytes=layer.nbytes,
                                            after=self.arena.ready_event(slot))
        return True

    def _valid(self, layer):
        return layer.slot is not None and layer.version == self.version

    def _bind(self, layer, upcoming, phase="forward"):
        keep = {layer, *upcoming}
        if not self._valid(layer):
            if layer.slot is not None:
                self._drop(layer)
            if not self._load(layer, keep):
                busy = [l.index for l in self.layers if l.bound]
                raise RuntimeError(f"expert offload: no free slot for MoE layer {layer.index} "
                                   f"(K={self.k}, bound: {busy})")
        if layer.handle is not None:
            self._wait_copy(layer)
            layer.handle = None
        self._bind_slot(layer, phase)
        layer.bound = True
        self.clock += 1
        layer.last_bound = self.clock
        for nxt in upcoming:  # prefetch window: the next K-1 layers in execution order
            if not self._valid(nxt):
                if nxt.slot is not None:
                    self._drop(nxt)
                if not self._load(nxt, keep):
                    break

    # The steps below are separate methods so that the tests can leave each one out (monkeypatch)
    # and show that the run then breaks.
    def _wait_copy(self, layer):
        layer.handle.wait()  # exposed wait, counted by the link

    def _bind_slot(self, layer, phase):
        """The layer's parameters -> its device slot (``phase``: forward or backward)."""
        layer.bind(layer.slot_views)

    def _release_after_backward(self, layer):
        """The layer's last gradient is accumulated: its slot may be refilled."""
        self._unbind(layer)

    def _unbind(self, layer):
        if layer.on_host:
            self._renew_grad_hooks(layer)
        layer.bind(layer.poison)
        layer.bound = False

    def _bind_host(self, layer, tensors, carry_grads=False):
        """The layer's parameters -> host tensors: the host tier's copies for its step and for
        checkpoints, the ssd tier's cache entries. On CUDA a change of device: _unbind renews
        DDP's grad hooks afterwards (megatron_moe/compat/ddp.py)."""
        layer.bind(tensors, carry_grads)
        layer.on_host = True
        layer.bound = False

    def _renew_grad_hooks(self, layer):
        """Back from host tensors: autograd dropped each parameter's AccumulateGrad node, which
        carried megatron-core DDP's hook (the add of the grad into main_grad); without a new
        one the parameters' grads never reach DDP's buffer and the step sees zeros (the second
        GPU run: grad norm below resident's from iteration 2). The new node is made while the
        parameters are their shape-true device stand-ins (it records shape, dtype, device)."""
        layer.bind(layer.stand_ins)
        for p in layer.params:
            if p in self._ddp_nodes:
                ddp, node = self._ddp_nodes[p]
                new = ddp_compat.rehook(ddp, p, node)
                if new is not node:
                    self._ddp_nodes[p] = (ddp, new)
                    self.grad_hooks_renewed += 1
        layer.on_host = False

    def _bind_step_views(self):
        """Start of megatron-core's step: every offloaded parameter and master -> a shape-true
        stand-in on the compute device (zero bytes). megatron-core sets ``.grad`` from DDP's
        device buffer and clips there (it asserts CUDA grads; torch refuses a device grad on a
        host tensor: both seen on the first GPU run); the torch step's pre-hook then binds the
        host copies (host tier, _host_step_hook) or each layer's states (ssd tier)."""
        self.link.drain()  # no copy may read a master weight while the step writes it
        for layer in self.layers:
            self._unbind(layer)
            layer.bind(layer.stand_ins)
        for main, (_, stand_in) in self._masters.items():
            set_data(main, stand_in)

    def _bind_host_copies(self):
        """Host tier: every layer's .data -> its host copy (a layer still bound is updated there,
        not in its slot), every master -> its host storage."""
        self.link.drain()  # no copy in flight reads a host copy that the step or a load writes
        for layer in self.layers:
            self._bind_host(layer, layer.host_views, carry_grads=True)
        for main, (host, _) in self._masters.items():
            set_data_with_grad(main, host)

    def _host_step_hook(self, opt, args, kwargs):
        self._bind_host_copies()

    def _upcoming(self, layer, forward):
        n, i = len(self.layers), layer.index
        order = list(range(i + 1, n)) + list(range(n - 1, -1, -1)) if forward \
            else list(range(i - 1, -1, -1))
        out = []
        for j in order:
            if j != i and self.layers[j] not in out:
                out.append(self.layers[j])
            if len(out) >= self.k - 1:
                break
        return out

    # --- hooks -----------------------------------------------------------------------------------
    def _pre_hook(self, layer):
        def hook(module, args):
            self._bind(layer, self._upcoming(layer, forward=True))
        return hook

    def _post_hook(self, layer):
        def hook(module, args, output):
            out = output[0] if isinstance(output, (tuple, list)) else output
            if torch.is_grad_enabled() and torch.is_tensor(out) and out.requires_grad:
                out.register_hook(self._bwd_hook(layer))
            self._unbind(layer)
        return hook

    def _bwd_hook(self, layer):
        def hook(grad):
            self._bind(layer, self._upcoming(layer, forward=False), phase="backward")
            layer.bwd_left = sum(1 for p in layer.params if p.requires_grad)
            return None
        return hook

    def _acc_hook(self, layer):
        def hook(param):
            layer.bwd_left -= 1
            if layer.bwd_left == 0 and layer.bound:
                self._release_after_backward(layer)
        return hook

    # --- the optimizer step ----------------------------------------------------------------------
    @staticmethod
    def _grads_to_host(offloaded):
        def hook(opt, args, kwargs):
            for g in opt.param_groups:
                for p in g["params"]:
                    if p in offloaded and p.grad is not None and p.grad.device != p.device:
                        p.grad = p.grad.to(p.device)
        return hook

    def _whole_step(self, orig_step):
        def step(*args, **kwargs):
            self._bind_step_views()
            try:
                return orig_step(*args, **kwargs)
            finally:  # the masters' home is the host, also when the step was skipped (fp16)
                for main, (host, _) in self._masters.items():
                    main.grad = None
                    set_data(main, host)
                self._weights_changed()
                self.steps += 1
                self._interval["steps"] += 1
        return step

    def _weights_changed(self):
        """The step (or a checkpoint load) changed the master weights: every cached slot is
        stale, and every layer points at its poison until its next bind."""
        self.version += 1
        for layer in self.layers:
            self._unbind(layer)
            if layer.slot is not None:
                self._drop(layer)

    def _layerwise_step(self, opt, orig_step):
        """SSD tier: step one layer at a time with its master weights and moments pinned in the
        host cache (torch's Adam updates each parameter independently: same result as one step)."""
        def step(closure=None):
            groups = [list(g["params"]) for g in opt.param_groups]
            try:
                for layer in self.layers:
                    members = set(layer.params)
                    if not any(p in members for ps in groups for p in ps):
                        continue
                    w = self.cache.get((layer.index, "w"), pin=True)
                    m = self.cache.get((layer.index, "m"), pin=True)
                    try:
                        self._bind_states(layer, w, m)
                        for g, ps in zip(opt.param_groups, groups):
                            g["params"] = [p for p in ps if p in members]
                        orig_step()
                        self._absorb_states(opt, layer, w, m)
                    finally:
                        self._unbind_states(opt, layer)
                        self.cache.unpin((layer.index, "w"), dirty=True)
                        self.cache.unpin((layer.index, "m"), dirty=True)
                for g, ps in zip(opt.param_groups, groups):
                    g["params"] = [p for p in ps if p not in self._param_layer]
                if any(g["params"] for g in opt.param_groups):
                    orig_step()
            finally:
                for g, ps in zip(opt.param_groups, groups):
                    g["params"] = ps
        return step

    def _state_views(self, layer, m):
        n = layer.numel
        return layer.views(m[:n]), layer.views(m[n:])

    def _bind_states(self, layer, w, m):
        self._bind_host(layer, layer.views(w))
        avg, sq = self._state_views(layer, m)
        for opt in self.torch_opts:
            for p, a, s in zip(layer.params, avg, sq):
                st = opt.state.get(p)
                if st and "exp_avg" in st:
                    st["exp_avg"], st["exp_avg_sq"] = a, s

    def _absorb_states(self, opt, layer, w, m):
        """Adopt states the optimizer created (first step) or loaded (checkpoint) into the entry."""
        avg, sq = self._state_views(layer, m)
        for p, a, s in zip(layer.params, avg, sq):
            st = opt.state.get(p)
            if st and "exp_avg" in st:
                for key, view in (("exp_avg", a), ("exp_avg_sq", s)):
                    if st[key].data_ptr() != view.data_ptr():
                        view.copy_(st[key])
                        st[key] = view

    def _unbind_states(self, opt, layer):
        self._unbind(layer)
        for p, ph in zip(layer.params, layer.poison):
            st = opt.state.get(p)
            if st and "exp_avg" in st:
                st["exp_avg"] = st["exp_avg_sq"] = ph

    # --- checkpoints (ssd tier: real tensors while a checkpoint is written or read) ------------
    @contextlib.contextmanager
    def checkpoint_io(self, load: bool = False):
        if self.mode != "ssd":
            self._bind_host_copies()  # the host copy is what is saved, or loaded into
            try:
                yield
            finally:
                self._weights_changed()
            return
        for layer in self.layers:
            w = self.cache.get((layer.index, "w")).clone()
            m = self.cache.get((layer.index, "m")).clone()
            self._bind_states(layer, w, m)
        try:
            yield
        finally:
            for layer in self.layers:
                if load:  # the loaded values go to the store
                    w = self.cache.get((layer.index, "w"), pin=True)
                    m = self.cache.get((layer.index, "m"), pin=True)
                    for p, v in zip(layer.params, layer.views(w)):
                        v.copy_(p.data)
                    for opt in self.torch_opts:
                        self._absorb_states(opt, layer, w, m)
                    self.cache.unpin((layer.index, "w"), dirty=True)
                    self.cache.unpin((layer.index, "m"), dirty=True)
                for opt in self.torch_opts:
                    self._unbind_states(opt, layer)
                self._unbind(layer)
            if load:
                self._weights_changed()

    # --- reporting -------------------------------------------------------------------------------
    def _ssd_bytes(self):
        if self.cache is None:
            return 0
        return self.cache.ssd.bytes_read + self.cache.ssd.bytes_written

    def host_bytes(self) -> int:
        main_grads = sum(p.main_grad.numel() * p.main_grad.element_size() for l in self.layers
                         for p in l.params
                         if getattr(p, "main_grad", None) is not None and not p.main_grad.is_cuda)
        if self.mode == "ssd":
            return self.cache.bytes + main_grads
        states = 0
        for opt in self.torch_opts:
            for p in list(self._param_layer) + list(self._masters):
                st = opt.state.get(p) or {}
                states += sum(t.numel() * t.element_size() for k, t in st.items()
                              if torch.is_tensor(t) and t.dim() > 0)
        masters = sum(m.numel() * m.element_size() for m in self._masters)
        return sum(l.host.numel() * l.host.element_size() for l in self.layers) + main_grads \
            + states + masters

    def ssd_bytes(self) -> int:
        return self.cache.ssd.size if self.cache is not None else 0

    def device_peak_bytes(self) -> int:
        """The device storage the arena has held (read from its storages), plus on CUDA the
        storage of DDP's device buffer of the experts' main grads."""
        return self.arena.peak_bytes() + self._device_main_grad_bytes()

    def _device_main_grad_bytes(self) -> int:
        return storage_bytes(p.main_grad for l in self.layers for p in l.params
                             if getattr(p, "main_grad", None) is not None and p.main_grad.is_cuda)

    def stats(self) -> dict:
        link = {k: v + self.link.stats()[k] for k, v in self._totals.items()}
        link["hidden_fraction"] = 1.0 - min(1.0, link["wait_s"] / link["copy_s"]) \
            if link["copy_s"] > 0 else 1.0
        out = dict(device_peak=self.device_peak_bytes(), arena_peak=self.arena.peak_bytes(),
                   resident=self.resident_bytes + self._device_main_grad_bytes(),
                   expert_param_bytes=sum(l.nbytes for l in self.layers), slots=self.k,
                   layers=len(self.layers), host=self.host_bytes(), ssd=self.ssd_bytes(),
                   hidden=link["hidden_fraction"], copy_s=link["copy_s"], wait_s=link["wait_s"],
                   link_bytes=link["bytes"], steps=self.steps,
                   grad_hooks_renewed=self.grad_hooks_renewed)
        if self.cache is not None:
            out.update(cache_hit_rate=self.cache.hit_rate(), cache_peak=self.cache.peak_bytes,
                       ssd_read=self.cache.ssd.bytes_read, ssd_written=self.cache.ssd.bytes_written)
        return out

    def log_line(self) -> str:
        """One line per log interval; counters restart after it (peaks stay run-wide)."""
        s = self.stats()
        steps = max(1, self._interval["steps"])
        ssd_mb = (self._ssd_bytes() - self._interval["ssd_bytes"]) / 1e6 / steps
        line = (f" [offload] device expert bytes peak: {s['device_peak']} of {s['resident']} | "
                f"host: {s['host']} | ssd: {s['ssd']} | prefetch hidden: {100 * s['hidden']:.0f}% | "
                f"ssd MB/step: {ssd_mb:.1f}")
        for key in self._totals:
            self._totals[key] += self.link.stats()[key]
        self.link.reset_stats()
        self._interval = dict(steps=0, ssd_bytes=self._ssd_bytes())
        return line

    def close(self):
        for h in self._hooks:
            h.remove()
        self._hooks = []
        if self._optimizer is not None and "step" in vars(self._optimizer):
            del self._optimizer.step  # back to the class's step
        self.link.close()
        if self.cache is not None:
            self.cache.ssd.close()
