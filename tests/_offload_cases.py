"""Spawned-rank body for tests/test_offload.py and bench/offload.py: the real pretrain() loop
with --moe-expert-offload; returns the loss history, the [offload] log lines and the manager's
counters (captured before close)."""

from __future__ import annotations


def run(rank, world, argv):
    import os
    import sys

    import pretrain_gpt_moe
    from megatron.core.enums import ModelType

    from megatron_moe.training import loop as T

    lines, stats, iter_ms = [], {}, []

    class _Tee:
        def __init__(self, out):
            self.out = out

        def write(self, text):
            for l in text.splitlines():
                if "[offload]" in l:
                    lines.append(l.strip())
                elif "elapsed time per iteration (ms):" in l:
                    iter_ms.append(float(l.split("elapsed time per iteration (ms):")[1].split("|")[0]))
            return self.out.write(text)

        def __getattr__(self, name):
            return getattr(self.out, name)

    sys.stdout = _Tee(sys.stdout)
    orig_close = T.TrainingHooks.close

    def close(self):
        if self.offload is not None:
            stats.update(self.offload.stats())
        with open("/proc/self/statm") as f:  # resident set size now (bench: RSS vs model bytes)
            stats["rss"] = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        return orig_close(self)

    T.TrainingHooks.close = close
    try:
        result = T.pretrain(pretrain_gpt_moe.train_valid_test_datasets_provider,
                            pretrain_gpt_moe.model_provider, ModelType.encoder_or_decoder,
                            pretrain_gpt_moe.forward_step, argv=argv)
    finally:
        T.TrainingHooks.close = orig_close
        sys.stdout = sys.stdout.out
    return {"history": result["history"], "lines": lines, "stats": stats, "iter_ms": iter_ms}


def _skip(cls, name, keep=None):
    """Patch ``cls.name`` to do nothing (when ``keep(*args)`` is true: run the original)."""
    orig = getattr(cls, name)

    def skipped(self, *args):
        if keep is not None and keep(*args):
            return orig(self, *args)
        return None
    return cls, name, skipped


def _mutation(name):
    """(class, attribute, replacement) that leaves one step of the offload tiers out: a forward
    bind, a copy wait, the re-bind in backward, a host-cache write-back, the host bind before the
    torch step; ``skip_unbind`` keeps every layer bound from its backward until the optimizer step
    (possible with K >= layers), which must lose no update."""
    from megatron_moe.offload.manager import ExpertOffload
    from megatron_moe.offload.store import HostCache

    return {
        "skip_bind": lambda: _skip(ExpertOffload, "_bind_slot", keep=lambda l, phase: phase != "forward"),
        "skip_rebind": lambda: _skip(ExpertOffload, "_bind_slot", keep=lambda l, phase: phase != "backward"),
        "skip_wait": lambda: _skip(ExpertOffload, "_wait_copy"),
        "skip_unbind": lambda: _skip(ExpertOffload, "_release_after_backward"),
        "skip_host_step_bind": lambda: _skip(ExpertOffload, "_host_step_hook"),
        "skip_writeback": lambda: _skip(HostCache, "_write_back"),
        "skip_renew_grad_hooks": lambda: _skip(ExpertOffload, "_renew_grad_hooks"),
    }[name]()


def run_many(rank, world, argvs, mutations=None):
    """Several pretrain() runs in one process pair (imports paid once). ``mutations[k]`` (a name
    of ``_mutation``) makes run k a mutation: the offload tiers leave that step out, and the run's
    SystemExit (e.g. a NaN loss) or error is returned, not raised."""
    out = []
    for k, argv in enumerate(argvs):
        mutation = (mutations or {}).get(k)
        if mutation is None:
            out.append(run(rank, world, argv))
            continue
        cls, name, replacement = _mutation(mutation)
        orig = cls.__dict__[name]
        setattr(cls, name, replacement)
        try:
            out.append(run(rank, world, argv))
        except SystemExit as exc:
            out.append({"exit": exc.code})
        except Exception as exc:  # e.g. a zero-element placeholder reached a matmul
            out.append({"error": f"{type(exc).__name__}: {exc}"[:300]})
        finally:
            setattr(cls, name, orig)
    return out


def run_many_spying_masters(rank, world, argvs, mutations=None):
    """run_many, recording at each host-tier torch step (its pre-hook, right after megatron-core
    copied the grads and clipped them) whether every offloaded master and parameter was bound to
    its zero-stride device stand-in: on a GPU that is what lets megatron-core attach DDP's device
    grads and clip them on the device."""
    from megatron_moe.offload import manager

    seen = []
    orig = manager.ExpertOffload._host_step_hook

    def hook(self, opt, args, kwargs):
        stand = lambda t: t.numel() > 1 and all(st == 0 for st in t.stride())
        seen.append((len(self._masters),
                     all(stand(m.data) and m.grad is not None for m in self._masters),
                     all(stand(p.data) for l in self.layers for p in l.params)))
        return orig(self, opt, args, kwargs)

    manager.ExpertOffload._host_step_hook = hook
    try:
        return run_many(rank, world, argvs, mutations), seen
    finally:
        manager.ExpertOffload._host_step_hook = orig


def emulate_cuda_device_changes():
    """On CUDA, binding an expert parameter to host memory (``p.data = host tensor``) changes its
    device, and torch then drops the parameter's AccumulateGrad node (``VariableHooks::set_data``),
    the node megatron-core's DDP hooked to add grads into ``main_grad``. On the CPU the host copies
    and the device slots share one device, so nothing is dropped and the loss of DDP's hook cannot
    show. This patch of the manager's one ``.data`` seam (``manager.set_data``) makes the CPU do
    what CUDA does: each time a parameter moves between host-tier memory and device-tier memory
    (the arena's slots, the placeholders, the stand-ins: read from the manager's storages) it first
    passes through another dtype, the one change of ``.data`` that makes torch drop the node on
    the CPU. Returns (counters, undo)."""
    import torch

    from megatron_moe.offload import manager as M

    managers, tier, counts = [], {}, dict(drops=0)
    orig_set, orig_init = M.set_data, M.ExpertOffload.__init__

    def device_storages(mgr):
        out = set()
        for i in range(mgr.arena.slots):
            try:
                out |= {t.untyped_storage().data_ptr() for t in mgr.arena.slot(i).values()}
            except RuntimeError:  # never acquired: no storage yet
                pass
        for layer in mgr.layers:
            out |= {t.untyped_storage().data_ptr() for t in layer.poison + layer.stand_ins}
        return out

    def set_data(p, data):
        mgr = next((m for m in managers if p in m._param_layer), None)
        if mgr is not None:
            where = "device" if data.untyped_storage().data_ptr() in device_storages(mgr) else "host"
            if tier.get(p, "device") != where:
                other = torch.float64 if p.dtype != torch.float64 else torch.float32
                orig_set(p, torch.empty(0, dtype=other))  # torch drops the node, as on CUDA
                counts["drops"] += 1
            tier[p] = where
        orig_set(p, data)

    def init(self, *args, **kwargs):
        orig_init(self, *args, **kwargs)
        managers.append(self)

    M.set_data, M.ExpertOffload.__init__ = set_data, init

    def undo():
        M.set_data, M.ExpertOffload.__init__ = orig_set, orig_init
    return counts, undo


def run_many_on_emulated_cuda(rank, world, argvs, mutations=None):
    """run_many with emulate_cuda_device_changes() on; returns (runs, drops per run)."""
    out, drops = [], []
    for k, argv in enumerate(argvs):
        counts, undo = emulate_cuda_device_changes()
        try:
            out += run_many(rank, world, [argv], {0: mutations[k]} if k in (mutations or {}) else None)
        finally:
            undo()
        drops.append(counts["drops"])
    return out, drops
