"""Spawned-rank body for tests/test_offload.py and bench/offload.py: the real pretrain() loop
with --moe-expert-offload; returns the loss history, the [offload] log lines and the manager's
counters (captured before close)."""

from __future__ import annotations


def run(rank, world, argv):
    import os
    import sys

    import pretrain_gpt_moe
    from megatron.core.enums import ModelType

    from megatron_moe import training as T

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


def run_many(rank, world, argvs, skip_waits_last=False):
    """Several pretrain() runs in one process pair (imports paid once). With ``skip_waits_last``
    the last run is a mutation: the link's waits return at once, so compute reads slots whose copy
    has not landed (NaN-filled in debug mode); its SystemExit (NaN loss) is returned, not raised."""
    from megatron_moe.offload import link

    out = []
    for k, argv in enumerate(argvs):
        if skip_waits_last and k == len(argvs) - 1:
            link.CopyHandle.wait = lambda self: None
            try:
                out.append(run(rank, world, argv))
            except SystemExit as exc:
                out.append({"exit": exc.code})
        else:
            out.append(run(rank, world, argv))
    return out
