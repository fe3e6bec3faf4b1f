"""MoESys ring-memory offloading for inference (moesys.md 2.10): N layers, K device slots.

The weights of every transformer layer (attention, norms, router and all local experts) live in
host memory. K device slots, preallocated once (no fragmentation), hold the layers being computed
and prefetched. A forward pre-hook on layer i waits for the copy that fills its slot and binds
the layer's parameters to views into that slot; a forward post-hook releases the slot and queues
the copy of layer (i + K) mod N into it, so the ring wraps into the next decode step. Device
memory for layer weights is K/N of resident (embeddings and the output layer stay resident).

Copies go through the training offload's ``CopyLink`` and slots live in its ``SlotArena``
(megatron_moe/offload/link.py): a CUDA side stream, or on CPU a copy thread that can emulate a
link bandwidth (the data lands at the end of its transfer window) so overlap and exposed waits are
measurable without a GPU; in debug mode a released slot is NaN-filled and copies are jittered, so
a compute that did not wait for its copy yields NaN instead of passing by luck.

Timing model (moesys.md 2.10; priced by the project's one cost model,
``balance.cost_model.RingMemoryCost``): the copy into the slot freed after layer i has K-1 layers
of compute before layer i+K needs it, and one copy engine moves one layer at a time, so a layer
takes max(t_compute, t_copy, (t_compute + t_copy) / K).

The hooks sit on the model's layers, not on an engine: they work under megatron-core's static
engine, a plain forward, or evaluation alike.
"""

from __future__ import annotations

import re
import time
from collections import defaultdict

import torch


def transformer_layers(model) -> list:
    """This rank's transformer layers (GPTModel / BertModel inside Float16Module or DDP)."""
    from megatron_moe.models.builder import unwrap

    inner = unwrap(model)
    decoder = getattr(inner, "decoder", None) or getattr(inner, "encoder", None)
    if decoder is None or not hasattr(decoder, "layers"):
        raise ValueError(f"ring memory: {type(inner).__name__} has no decoder.layers")
    return list(decoder.layers)


# Debug mode: each copy is delayed by up to this much more, so a missing wait shows (as training).
DEBUG_JITTER_S = 0.002

_EXPERT = re.compile(r"(?:^|\.)mlp\.experts\.local_experts\.(\d+)\.")


class _LayerLayout:
    """Where each parameter of one layer sits in its flat per-dtype buffers.

    Non-expert parameters come first, then each local expert's parameters together, so one
    expert is one contiguous range per dtype (the "active experts only" mode copies just those).
    """

    def __init__(self, layer):
        named = list(layer.named_parameters())
        expert_of = {}
        for name, p in named:
            m = _EXPERT.search(name)
            expert_of[id(p)] = int(m.group(1)) if m else None
        order = sorted(named, key=lambda np_: (expert_of[id(np_[1])] is not None,
                                               expert_of[id(np_[1])] or 0))
        self.numel = defaultdict(int)  # dtype -> elements
        self.entries = []  # (param, dtype, offset, shape)
        self.ranges = defaultdict(lambda: defaultdict(list))  # expert|None -> dtype -> [(a, b)]
        for _, p in order:
            d, start = p.dtype, self.numel[p.dtype]
            self.entries.append((p, d, start, tuple(p.shape)))
            self.numel[d] += p.numel()
            spans = self.ranges[expert_of[id(p)]][d]
            if spans and spans[-1][1] == start:
                spans[-1] = (spans[-1][0], start + p.numel())
            else:
                spans.append((start, start + p.numel()))
        self.experts = sorted(e for e in self.ranges if e is not None)

    @property
    def nbytes(self) -> int:
        return sum(n * _itemsize(d) for d, n in self.numel.items())

    def spans(self, experts=None):
        """(dtype, start, end) ranges holding the non-expert weights and ``experts`` (all if
        None)."""
        if experts is None:
            return [(d, 0, n) for d, n in self.numel.items()]
        out = []
        for key in [None] + sorted(experts):
            for d, spans in self.ranges.get(key, {}).items():
                out.extend((d, a, b) for a, b in spans)
        return out

    def views(self, flat: dict) -> list:
        return [flat[d][o:o + int(torch.Size(s).numel())].view(s) for _, d, o, s in self.entries]

    def bind(self, views):
        for (p, _, _, _), v in zip(self.entries, views):
            p.data = v


def _itemsize(dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


class RingMemory:
    """Stream ``model``'s transformer layers through ``slots`` device slots (see module doc).

    ``experts="active"``: copy a MoE layer's non-expert weights and only the local experts its
    router picked at the previous forward; an expert that receives tokens without having been
    copied is fetched before the experts run (a miss, counted). Experts that receive no token run
    on empty inputs, so their slot contents never matter.
    """

    def __init__(self, model, slots: int, link_gbps: float | None = None, debug: bool = False,
                 experts: str = "all", device=None):
        from megatron_moe.offload.link import CopyLink, SlotArena, storage_bytes

        if experts not in ("all", "active"):
            raise ValueError(f"ring memory experts must be 'all' or 'active' (got {experts!r})")
        self.layers = transformer_layers(model)
        n = len(self.layers)
        if slots < 1:
            raise ValueError(f"ring memory needs >= 1 slot (got {slots})")
        self.n, self.k = n, min(slots, n)
        self.debug = debug
        self.active_only = experts == "active"
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) \
                if torch.cuda.is_available() else torch.device("cpu")
        self.device = device
        self.layouts = [_LayerLayout(layer) for layer in self.layers]
        if self.active_only and not any(layout.experts for layout in self.layouts):
            raise ValueError("ring memory 'active experts only' needs per-expert modules "
                             "(SequentialMLP); this model has none")
        slot_numel = defaultdict(int)
        for layout in self.layouts:
            for dtype, numel in layout.numel.items():
                slot_numel[dtype] = max(slot_numel[dtype], numel)
        # Host tier: one flat buffer per layer and dtype (pinned on CUDA for async copies).
        pin = device.type == "cuda"
        self.host = []
        for layout in self.layouts:
            flat = {d: torch.empty(numel, dtype=d, pin_memory=pin) for d, numel in layout.numel.items()}
            for (p, _, _, _), view in zip(layout.entries, layout.views(flat)):
                view.copy_(p.detach())
            self.host.append(flat)
        self.host_views = [layout.views(flat) for layout, flat in zip(self.layouts, self.host)]
        # resident layer weights, read from their storages (as the arena's peak is) before they go
        self.resident_bytes = storage_bytes(p.data for l in self.layouts for p, *_ in l.entries)
        # Between uses a layer's parameters point at poison, never at the host copy (a missed
        # bind would pass silently on CPU): NaN of the right shape in debug mode, else
        # zero-element tensors (a missed bind fails on the shape)
        self.poison = [[torch.full((), float("nan"), dtype=d, device=device).expand(shape) if debug
                        else torch.empty(0, dtype=d, device=device) for _, d, _, shape in l.entries]
                       for l in self.layouts]
        for layout, poison in zip(self.layouts, self.poison):
            layout.bind(poison)  # the device copies of the weights are freed here
        self.link = CopyLink(gbps=link_gbps, device=device, jitter_s=DEBUG_JITTER_S if debug else 0.0)
        self.arena = SlotArena(dict(slot_numel), self.k, device=device, nan_fill=debug)
        self.slot_bytes = self.arena.slot_bytes
        self.slot_of = {}  # layer -> slot holding (or receiving) it
        self.pending = {}  # layer -> the link's handle of its copy
        self.loaded_experts = {}  # layer -> experts copied into its slot (None: all)
        self.last_active = {}  # layer -> experts that received tokens at its last forward
        self.counters = dict(copies=0, bytes_copied=0, expert_misses=0, miss_bytes=0)
        for i in range(self.k):  # the first K layers fill the K slots (allocated here)
            slot = self.arena.acquire()  # on CUDA its first copy waits for the compute stream
            self._load(i, slot, after=self.arena.ready_event(slot))
        # parameter views into each slot, made once (not inside the engine's inference mode)
        self._views = {(i, s): layout.views(self.arena.slot(s))
                       for i, layout in enumerate(self.layouts) for s in range(self.k)}
        self._hooks = []
        if self.k < self.n:
            for i, layer in enumerate(self.layers):
                self._hooks.append(layer.register_forward_pre_hook(self._pre_hook(i)))
                self._hooks.append(layer.register_forward_hook(self._post_hook(i)))
        else:  # K == N: every layer has its own slot; bind once, nothing streams
            for i in range(self.n):
                self._wait_and_bind(i)
        if self.active_only:
            for i, layer in enumerate(self.layers):
                experts_module = getattr(getattr(layer, "mlp", None), "experts", None)
                if experts_module is not None and self.layouts[i].experts:
                    self._hooks.append(experts_module.register_forward_pre_hook(
                        self._experts_hook(i)))

    @classmethod
    def from_args(cls, model, args):
        return cls(model, slots=args.ring_memory_slots, link_gbps=args.ring_memory_link_gbps,
                   debug=args.ring_memory_debug, experts=args.ring_memory_experts)

    # --- the ring --------------------------------------------------------------------------------
    def _copy(self, layer: int, slot: int, experts=None, after=None):
        dst, src = self.arena.slot(slot), self.host[layer]
        spans = self.layouts[layer].spans(experts)
        nbytes = sum((b - a) * _itemsize(d) for d, a, b in spans)
        self.counters["copies"] += 1
        self.counters["bytes_copied"] += nbytes
        pairs = [(dst[d][a:b], src[d][a:b]) for d, a, b in spans]
        return self.link.copy(pairs, after=after), nbytes

    def _load(self, layer: int, slot: int, after=None):
        """Queue the host -> slot copy of ``layer``'s weights (its predicted experts only, in
        the active mode once a forward has shown which ones it uses)."""
        self.slot_of[layer] = slot
        experts = self.last_active.get(layer) if self.active_only else None
        self.loaded_experts[layer] = None if experts is None else set(experts)
        self.pending[layer], _ = self._copy(layer, slot, experts, after=after)

    # _wait and _bind_slot are separate methods so that the tests can leave either out
    # (monkeypatch) and show that the output then breaks.
    def _wait(self, handle):
        handle.wait()  # the link counts the exposed (blocked) time

    def _bind_slot(self, layer: int):
        self.layouts[layer].bind(self._views[(layer, self.slot_of[layer])])

    def _wait_and_bind(self, layer: int):
        handle = self.pending.pop(layer, None)
        if handle is not None:
            self._wait(handle)
        self._bind_slot(layer)

    def _pre_hook(self, i):
        def hook(module, args):
            self._wait_and_bind(i)
        return hook

    def _post_hook(self, i):
        def hook(module, args, output):
            self.layouts[i].bind(self.poison[i])  # nothing may read the slot from now on
            self.arena.release(self.slot_of.pop(i))  # NaN-filled in debug mode
            # on CUDA the refill waits for the layer's kernels and the NaN fill (compute stream)
            self._load((i + self.k) % self.n, self.arena.acquire(), after=_compute_done(self.device))
        return hook

    def _experts_hook(self, i):
        def hook(module, args):
            tokens_per_expert = args[1]
            counts = tokens_per_expert.tolist() if torch.is_tensor(tokens_per_expert) \
                else list(tokens_per_expert)
            used = {e for e, c in enumerate(counts) if c > 0}
            self.last_active[i] = used
            loaded = self.loaded_experts.get(i)
            missing = set() if loaded is None else used - loaded
            if missing and i in self.slot_of:
                handle, nbytes = self._copy(i, self.slot_of[i], missing)
                self.counters["expert_misses"] += len(missing)
                self.counters["miss_bytes"] += nbytes
                self._wait(handle)
                loaded |= missing
        return hook

    # --- reporting and teardown ------------------------------------------------------------------
    def stats(self) -> dict:
        link = self.link.stats()
        return dict(
            slots=self.k, layers=self.n, slot_bytes=self.slot_bytes,
            streamed_bytes=sum(l.nbytes for l in self.layouts), resident_bytes=self.resident_bytes,
            min_layer_bytes=min(l.nbytes for l in self.layouts),
            peak_device_bytes=self.arena.peak_bytes(), copy_s=link["copy_s"],
            wait_s=link["wait_s"], waits=link["waits"], blocked_waits=link["blocked_waits"],
            hidden_fraction=link["hidden_fraction"], **self.counters)

    def summary(self) -> str:
        s = self.stats()
        line = (f" [ring memory] K={s['slots']} of N={s['layers']} layers | device layer bytes "
                f"peak: {s['peak_device_bytes']} of {s['resident_bytes']} "
                f"({s['peak_device_bytes'] / max(1, s['resident_bytes']):.2f}) | copies: "
                f"{s['copies']} ({s['bytes_copied'] / 2**20:.1f} MiB) | exposed wait: "
                f"{s['wait_s'] * 1e3:.1f} ms of {s['copy_s'] * 1e3:.1f} ms copying | hidden: "
                f"{100 * s['hidden_fraction']:.0f}% |")
        if self.active_only:
            line += f" expert misses: {s['expert_misses']} |"
        return line

    def close(self):
        """Drain the ring and make every layer resident again (fresh device tensors)."""
        self.link.drain()
        self.pending.clear()
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        for layout, views in zip(self.layouts, self.host_views):
            layout.bind([v.to(self.device, copy=True) for v in views])
        self.link.close()
        self._views.clear()


def _compute_done(device):
    """An event after the layer's kernels on the compute stream (None on CPU: already done)."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record()
    return event
