"""Spawned-rank body for tests/test_flexmoe_persistent.py: the real pretrain() loop (megatron-core
FP32 optimizer, DDP, the finalize wrapper) with FlexMoE persistent replicas, under a router made
skewed on purpose (a logit bias on one expert that moves every ``period`` iterations), checked after
every step: replica params and optimizer state equal to the owner's, bit for bit."""

from __future__ import annotations

_IT = {"it": 0}


def _patch_router(strength: float, period: int) -> None:
    """Add ``strength`` to the logits of expert (iteration // period) % E: a hot expert that moves,
    so the FlexMoE planner expands it and later shrinks/migrates it away. A constant added to the
    logits changes no gradient formula; plain EP gets the same patch."""
    import torch
    from megatron.core.transformer.moe import router as R

    orig = R.Router.gating

    def gating(self, input):
        logits = orig(self, input)
        bias = torch.zeros(logits.shape[-1], dtype=logits.dtype, device=logits.device)
        bias[(_IT["it"] // period) % logits.shape[-1]] = strength
        return logits + bias

    R.Router.gating = gating


def _equal(a, b) -> bool:
    import torch

    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def run(rank, world, argv, strength=4.0, period=2):
    import sys

    import torch
    import torch.distributed as dist

    import pretrain_gpt_moe
    from megatron.core.enums import ModelType

    from megatron_moe.training import loop as T

    _patch_router(strength, period)
    logs = []

    class _Tee:                    # keep what the balance module prints (the fallback line)
        def __init__(self, out):
            self.out = out

        def write(self, text):
            logs.extend(line for line in text.splitlines() if line.startswith("> balance:"))
            return self.out.write(text)

        def __getattr__(self, name):
            return getattr(self.out, name)

    sys.stdout = _Tee(sys.stdout)
    per_iter, captured = [], {}

    orig_step = T.Trainer.train_step

    def train_step(self, data_iterator):
        _IT["it"] = int(self.args.iteration)          # the iteration being trained (0-based)
        captured["trainer"] = self
        return orig_step(self, data_iterator)

    orig_after = T.TrainingHooks.after_step

    def after_step(self, iteration):
        mgr = self.balance
        # before after_step: the placement this iteration ran and the replicas it updated
        rec = {"iteration": int(iteration)}
        if mgr is not None and mgr.layers:
            rec["placements"] = [m.balance._active_placement.to_dict() for m in mgr.layers]
            rec["mode"] = [m.balance.mode for m in mgr.layers]
            mine = {(m.balance.layer_number, e): s for m in mgr.layers
                    for e, s in m.balance.replica_snapshot().items()}
            owned = {(m.balance.layer_number, e): s for m in mgr.layers
                     for e, s in m.balance.owner_snapshot().items()}
            every = [None] * world
            dist.all_gather_object(every, owned)
            owners = {k: v for d in every for k, v in d.items()}
            rec["replicas"] = len(mine)
            rec["replica_mismatch"] = [list(k) + [(n, float((s[n] - owners[k][n]).abs().max()))
                                                  for n in s if not torch.equal(s[n], owners[k][n])]
                                       for k, s in mine.items() if not _equal(s, owners[k])]
            rec["replica_state_keys"] = sorted({k for s in mine.values() for k in s})
        orig_after(self, iteration)
        if mgr is not None:
            rec["metrics"] = mgr.metrics()
            rec["ops"] = dict(mgr.op_counts)
            rec["replica_mode"] = mgr.replica_mode
        per_iter.append(rec)

    T.Trainer.train_step = train_step
    T.TrainingHooks.after_step = after_step
    result = T.pretrain(pretrain_gpt_moe.train_valid_test_datasets_provider, pretrain_gpt_moe.model_provider,
                        ModelType.encoder_or_decoder, pretrain_gpt_moe.forward_step, argv=argv)
    tr = captured.get("trainer")
    params = {}
    if tr is not None:
        params = {n: p.detach().numpy().copy() for n, p in tr.model[0].named_parameters()}
    return {"history": result["history"], "iters": per_iter, "params": params, "logs": logs}
