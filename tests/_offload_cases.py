"""Spawned-rank body for tests/test_offload.py and bench/offload.py: the real pretrain() loop
with --moe-expert-offload; returns the loss history, the [offload] log lines and the manager's
counters (captured before close)."""

from __future__ import annotations


def run(rank, world, argv):
    import sys

    import pretrain_gpt_moe
    from megatron.core.enums import ModelType

    from megatron_moe import training as T

    lines, stats = [], {}

    class _Tee:
        def __init__(self, out):
            self.out = out

        def write(self, text):
            lines.extend(l.strip() for l in text.splitlines() if "[offload]" in l)
            return self.out.write(text)

        def __getattr__(self, name):
            return getattr(self.out, name)

    sys.stdout = _Tee(sys.stdout)
    orig_close = T.TrainingHooks.close

    def close(self):
        if self.offload is not None:
            stats.update(self.offload.stats())
        return orig_close(self)

    T.TrainingHooks.close = close
    try:
        result = T.pretrain(pretrain_gpt_moe.train_valid_test_datasets_provider,
                            pretrain_gpt_moe.model_provider, ModelType.encoder_or_decoder,
                            pretrain_gpt_moe.forward_step, argv=argv)
    finally:
        T.TrainingHooks.close = orig_close
        sys.stdout = sys.stdout.out
    return {"history": result["history"], "lines": lines, "stats": stats}
