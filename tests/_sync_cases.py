"""Spawned-rank body for tests/test_host_syncs.py: the real pretrain() under the host-read counter
(tests/_sync_counter.py), each read labelled by the iteration it happens in (from one train_step's
start to the next), with optional mutations that bring back a per-step host read."""

from __future__ import annotations


def _mutate_telemetry_item(counter):
    """The router hook reads its counts on the host every call (what it did before: a per-layer,
    per-micro-batch device-to-host copy)."""
    from megatron_moe.moe import telemetry

    orig = telemetry.ExpertLoadTracker._hook

    def hook(self, router, inputs, outputs):
        orig(self, router, inputs, outputs)
        self.counts.sum().item()

    counter.stand_ins.add(hook.__code__)
    telemetry.ExpertLoadTracker._hook = hook
    return lambda: setattr(telemetry.ExpertLoadTracker, "_hook", orig)


def _mutate_loss_per_step(counter):
    """The step's reduced losses come back as host floats (what the loop did before: one read per
    loss per iteration)."""
    from megatron_moe.training import loop

    orig = loop.reduce_losses

    def reduce_losses(losses_reduced):
        out = {}
        for k, v in orig(losses_reduced).items():   # no comprehension: its frame is its own code
            out[k] = float(v)
        return out

    counter.stand_ins.add(reduce_losses.__code__)
    loop.reduce_losses = reduce_losses
    return lambda: setattr(loop, "reduce_losses", orig)


def _mutate_chunked_two_reads(counter):
    """The chunked layer reads its send and receive counts in two host reads (what it did before)."""
    import torch

    from megatron_moe.moe import chunked

    orig = chunked.split_counts

    def split_counts(td, routing_map):
        ep, local = td.ep_size, td.num_local_experts
        send = routing_map.sum(dim=0).reshape(ep, local).tolist()
        got = td.num_global_tokens_per_local_expert if local > 1 else td.output_splits
        return send, torch.as_tensor(got).reshape(ep, local).tolist()

    counter.stand_ins.add(split_counts.__code__)
    chunked.split_counts = split_counts
    return lambda: setattr(chunked, "split_counts", orig)


def _mutate_mcore_permute(counter):
    """The layer leaves megatron-core 0.16's permute bound (its masked_select per layer)."""
    from megatron_moe.compat import dispatch

    orig = dispatch.argsort_permute
    dispatch.argsort_permute = lambda: None
    return lambda: setattr(dispatch, "argsort_permute", orig)


def _mutate_validate_inline(counter):
    """The loss function validates as Megatron-LM's loss_func does: megatron-core's
    validate_result on every micro-batch's device loss (NaN, then Inf), not once per iteration."""
    import torch

    import pretrain_gpt_moe
    from megatron.core.rerun_state_machine import get_rerun_state_machine

    orig = pretrain_gpt_moe.record_loss

    def record_loss(loss):
        rsm = get_rerun_state_machine()
        for test, what in ((torch.isnan, "NaN"), (torch.isinf, "Inf")):
            rsm.validate_result(result=loss.detach(), rejection_func=test, tolerance=0.0,
                                message=f"found {what} in local forward loss calculation")

    counter.stand_ins.add(record_loss.__code__)
    pretrain_gpt_moe.record_loss = record_loss
    return lambda: setattr(pretrain_gpt_moe, "record_loss", orig)


def _l2_norm_impl():
    from megatron.core.optimizer import clip_grads

    return getattr(clip_grads.l2_norm_impl, "__name__", str(clip_grads.l2_norm_impl))


MUTATIONS = {"telemetry_item": _mutate_telemetry_item, "loss_per_step": _mutate_loss_per_step,
             "chunked_two_reads": _mutate_chunked_two_reads, "mcore_permute": _mutate_mcore_permute,
             "validate_inline": _mutate_validate_inline}


def run_counted(rank, world, runs):
    """``runs``: [(argv, mutation name or None)]. Per run: {owner: {iteration: [read, ...]}}
    (iteration None: setup and teardown outside any step) and the training history."""
    from megatron_moe.moe.grouped_experts import GroupedSequentialMLP
    from tests._sync_counter import HostReadCounter
    from tests._train_cases import pretrain_with_step

    out = []
    for argv, mutation in runs:
        counter = HostReadCounter()
        state = {"iteration": 0}

        def counted_steps(step):
            def counted_step(self, data_iterator):
                state["iteration"] += 1
                counter.phase = state["iteration"]
                return step(self, data_iterator)
            return counted_step

        undo = MUTATIONS[mutation](counter) if mutation else None
        grouped_before = GroupedSequentialMLP.grouped_calls
        try:
            with counter:
                result = pretrain_with_step(argv, counted_steps)
        finally:
            if undo is not None:
                undo()
        out.append({"reads": {owner: dict(counter.by_phase(owner))
                              for owner in ("ours", "megatron-core", "other")},
                    "history": result["history"],
                    "grouped_calls": GroupedSequentialMLP.grouped_calls - grouped_before,
                    # the gradient norm megatron-core's optimizer ran (compat/multi_tensor.py)
                    "l2_norm_impl": _l2_norm_impl()})
    return out
