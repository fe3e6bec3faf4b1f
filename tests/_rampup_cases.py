"""Rank functions for tests/test_rampup_decoupled_lr.py: pretrain() runs with a wrapped
train_step that records, per iteration, what the step ran (micro-batches, consumed samples, the
param groups' learning rates). Mutations are installed here, in the ranks, by name."""

import contextlib
import io


def _calculator_built_with(**changed):
    """megatron-core's calculator built from the run's args with ``changed`` fields (a flag the
    calculator ignores); returns the undo."""
    import copy

    from megatron_moe.compat import batch_schedule

    real = batch_schedule.init_microbatch_calculator

    def init(args):
        built = copy.copy(args)
        for name, value in changed.items():
            setattr(built, name, value)
        return real(built)

    batch_schedule.init_microbatch_calculator = init
    return lambda: setattr(batch_schedule, "init_microbatch_calculator", real)


def _install(mutation):
    """Monkeypatch one known fault into this rank; returns its undo."""
    if mutation is None:
        return lambda: None
    if mutation == "no_rampup":   # the calculator built as if --rampup-batch-size were not given
        return _calculator_built_with(rampup_batch_size=None)
    if mutation == "consumed_from_iteration":   # resume counting samples as iterations x batch
        from megatron_moe.training import checkpointing

        real = checkpointing.load_checkpoint

        def load(model, optimizer, scheduler, args):
            iteration, _, valid, extra = real(model, optimizer, scheduler, args)
            return iteration, iteration * args.global_batch_size, valid, extra

        checkpointing.load_checkpoint = load
        return lambda: setattr(checkpointing, "load_checkpoint", real)
    if mutation == "no_decoupled_lr":   # the optimizer config without --decoupled-lr
        from megatron_moe.training import loop

        real = loop._optimizer_config

        def config(args, config_class):
            out = real(args, config_class)
            out.decoupled_lr = out.decoupled_min_lr = None
            return out

        loop._optimizer_config = config
        return lambda: setattr(loop, "_optimizer_config", real)
    if mutation == "loaded_bounds_to_all_groups":   # a resume giving every group --lr's bounds
        from megatron_moe.compat import checkpoint as compat_checkpoint

        real = compat_checkpoint.align_loaded_param_group_bounds

        def align(state, max_lr, min_lr):
            real(state, max_lr, min_lr)

            def walk(node):
                if isinstance(node, dict):
                    for group in node.get("param_groups") or ():
                        if isinstance(group, dict) and "max_lr" in group:
                            group["max_lr"], group["min_lr"] = max_lr, min_lr
                    for child in node.values():
                        walk(child)
                elif isinstance(node, (list, tuple)):
                    for child in node:
                        walk(child)

            walk(state)

        compat_checkpoint.align_loaded_param_group_bounds = align
        return lambda: setattr(compat_checkpoint, "align_loaded_param_group_bounds", real)
    if mutation == "unmarked_decoupled_groups":   # megatron-core's groups as it builds them
        from megatron_moe.compat import optimizer as compat_optimizer

        real = compat_optimizer.mark_decoupled_lr_groups
        compat_optimizer.mark_decoupled_lr_groups = lambda optimizer, lr: 0
        return lambda: setattr(compat_optimizer, "mark_decoupled_lr_groups", real)
    if mutation == "no_step_schedule":   # the calculator built without --step-batch-size-schedule
        return _calculator_built_with(step_batch_size_schedule=None)
    if mutation == "no_decrease":   # the calculator without --decrease-batch-size-if-needed
        return _calculator_built_with(decrease_batch_size_if_needed=False)
    if mutation == "skipped_not_resumed":   # a resume that forgets the skipped samples
        from megatron_moe.training import checkpointing

        real = checkpointing.load_checkpoint

        def load(model, optimizer, scheduler, args):
            iteration, consumed, valid, extra = real(model, optimizer, scheduler, args)
            return iteration, consumed, valid, {k: v for k, v in extra.items()
                                                if k != "skipped_train_samples"}

        checkpointing.load_checkpoint = load
        return lambda: setattr(checkpointing, "load_checkpoint", real)
    if mutation == "no_decoupled_check":   # the load without the decoupled-LR comparison
        from megatron_moe.training import checkpointing

        real = checkpointing._decoupled_lr_change
        checkpointing._decoupled_lr_change = lambda state, args: ""
        return lambda: setattr(checkpointing, "_decoupled_lr_change", real)
    raise ValueError(mutation)


def _recording_step(records):
    """wrap(train_step): per iteration, the micro-batches its forward ran, the consumed samples
    before it, and (embedding/output?, lr) of every non-empty param group after it."""
    def wrap(step):
        def recorded(self, data_iterator):
            calls = []
            forward = self.forward_step_func

            def counting(*a, **k):
                calls.append(1)
                return forward(*a, **k)

            self.forward_step_func = counting
            consumed = self.args.consumed_train_samples
            try:
                out = step(self, data_iterator)
            finally:
                self.forward_step_func = forward
            groups = []
            for group in self.optimizer.param_groups:
                if group["params"]:
                    marked = [bool(getattr(p, "is_embedding_or_output_parameter", False))
                              for p in group["params"]]
                    groups.append((any(marked), all(marked), float(group["lr"]),
                                   bool(group.get("is_decoupled_lr"))))
            records.append({"microbatches": len(calls), "consumed_before": consumed,
                            "groups": groups, "loss": out[0]})
            return out
        return recorded
    return wrap


def run_recorded(rank, world_size, argvs, mutations=None):
    """pretrain() runs one after the other in these ranks; per run: its records, history, printed
    text and, if it failed, the error (mutations[i]: the fault installed for run i)."""
    from megatron.core import parallel_state

    from tests._train_cases import pretrain_with_step

    out = []
    for i, argv in enumerate(argvs):
        parallel_state.destroy_model_parallel()
        undo = _install((mutations or [None] * len(argvs))[i])
        records, buf, error, result = [], io.StringIO(), None, None
        try:
            with contextlib.redirect_stdout(buf):
                result = pretrain_with_step(argv, _recording_step(records))
        except (Exception, SystemExit) as exc:   # a mutation may break the run: reported
            error = f"{type(exc).__name__}: {exc}"
        finally:
            undo()
        for r in records:   # losses stay on the device until the log line; read them here
            r["loss"] = {k: float(v) for k, v in r["loss"].items()}
        out.append({"records": records, "history": result["history"] if result else None,
                    "text": buf.getvalue(), "error": error})
    return out
