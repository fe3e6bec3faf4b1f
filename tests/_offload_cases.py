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


def run_many(rank, world, argvs, mutations=None):
    """Several pretrain() runs in one process pair (imports paid once). ``mutations[k]`` (a name
    of megatron_moe/offload/link.py MUTATIONS) makes run k a mutation: the offload tiers leave
    that step out, and the run's SystemExit (e.g. a NaN loss) or error is returned, not raised."""
    import os

    out = []
    for k, argv in enumerate(argvs):
        mutation = (mutations or {}).get(k)
        if mutation is None:
            out.append(run(rank, world, argv))
            continue
        os.environ["MEGATRON_MOE_TEST_MUTATE"] = mutation
        try:
            out.append(run(rank, world, argv))
        except SystemExit as exc:
            out.append({"exit": exc.code})
        except Exception as exc:  # e.g. a zero-element placeholder reached a matmul
            out.append({"error": f"{type(exc).__name__}: {exc}"[:300]})
        finally:
            del os.environ["MEGATRON_MOE_TEST_MUTATE"]
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
