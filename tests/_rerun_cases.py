"""Spawned-rank bodies for tests/test_result_validation.py: pretrain() with megatron-core's rerun
state machine, its log lines captured, and the status a SystemExit ended it with."""

from __future__ import annotations

import contextlib
import io
import logging

from tests._ckpt_cases import TINY

# EP=2 on 2 ranks; dropout on (the re-run must restore the RNG to reproduce the losses)
ARGV = TINY + ["--expert-model-parallel-size", "2", "--hidden-dropout", "0.1"]


class _Capture(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.messages = []

    def emit(self, record):
        self.messages.append(f"{record.levelname}:{record.name}:{record.getMessage()}")


def _skip_reruns():
    """Mutation: the loop never re-runs an iteration (megatron-core's verdict ignored)."""
    from megatron.core import rerun_state_machine as rsm

    real = rsm.RerunStateMachine.should_run_forward_backward

    def once(self, data_iterator):
        again = real(self, data_iterator)
        if again and self.state in (rsm.RerunState.RERUNNING_IN_PLACE,):
            self.state = rsm.RerunState.NOT_RUNNING_YET
            return False
        return again

    rsm.RerunStateMachine.should_run_forward_backward = once
    return lambda: setattr(rsm.RerunStateMachine, "should_run_forward_backward", real)


def _other_node():
    """Stand-in for the job resumed on another node: megatron-core's machine compares the node
    and device it re-runs on with those that reproduced the failure (one host here)."""
    import os

    from megatron.core import rerun_state_machine as rsm

    class OtherNode:
        def __getattr__(self, name):
            return getattr(os, name)

        @staticmethod
        def uname():
            here = list(os.uname())
            here[1] = "another-node"
            return tuple(here)

    rsm.os = OtherNode()
    return lambda: setattr(rsm, "os", os)


def _drop_rerun_state():
    """Mutation: a load ignores the machine state in the checkpoint."""
    from megatron_moe.training import result_validation

    real = result_validation.checkpoint_template
    result_validation.checkpoint_template = lambda common_state: None
    return lambda: setattr(result_validation, "checkpoint_template", real)


def _no_large_grads_check():
    """Mutation: the DDP config leaves --check-for-large-grads out (megatron-core's default)."""
    import dataclasses

    from megatron_moe.models import builder

    real = builder.DistributedDataParallelConfig

    def config(**kwargs):
        return real(**dict(kwargs, check_for_large_grads=False))

    assert dataclasses.is_dataclass(real)
    builder.DistributedDataParallelConfig = config
    return lambda: setattr(builder, "DistributedDataParallelConfig", real)


def _no_tracker_restore():
    """Mutation: the re-run does not restore the model-parallel RNG tracker's states (our
    state_restore_func); megatron-core still restores Python's, NumPy's and torch's."""
    from megatron.core import rerun_state_machine as rsm

    real = rsm.RerunStateMachine._restore_state

    def restore(self):
        func, self.state_restore_func = self.state_restore_func, None
        try:
            real(self)
        finally:
            self.state_restore_func = func

    rsm.RerunStateMachine._restore_state = restore
    return lambda: setattr(rsm.RerunStateMachine, "_restore_state", real)


def _skip_validation():
    """Mutation: the loop never makes the recorded losses' validate_result calls."""
    from megatron_moe.training import result_validation

    real = result_validation.validate_recorded
    result_validation.validate_recorded = lambda args: result_validation._recorded.clear()
    return lambda: setattr(result_validation, "validate_recorded", real)


MUTATIONS = {"skip_reruns": _skip_reruns, "skip_validation": _skip_validation, "other_node": _other_node,
             "drop_rerun_state": _drop_rerun_state, "no_large_grads_check": _no_large_grads_check,
             "no_tracker_restore": _no_tracker_restore}


def run_steps(rank, world_size, steps):
    """Each step: {argv, mutate}; returns per step {losses, exit, log (megatron-core's rerun
    log lines), fb_calls (forward-backward runs, evaluation's included), text (stdout)}."""
    import pretrain_gpt_moe
    from megatron.core.enums import ModelType

    from megatron_moe.training import loop
    from megatron_moe.training.loop import pretrain

    out = []
    for step in steps:
        capture = _Capture()
        logger = logging.getLogger("megatron.core.rerun_state_machine")
        logger.addHandler(capture)
        logger.setLevel(logging.INFO)   # report_stats logs its statistics at INFO
        calls = []

        undo = MUTATIONS[step["mutate"]]() if step.get("mutate") else None
        orig_init = loop.Trainer.__init__

        def init(self, *a, **k):
            orig_init(self, *a, **k)
            fb = self.forward_backward

            def counted(**kw):
                calls.append(1)
                return fb(**kw)
            self.forward_backward = counted

        loop.Trainer.__init__ = init
        result = {"losses": None, "exit": None}
        text = io.StringIO()
        try:
            with contextlib.redirect_stdout(text):
                r = pretrain(pretrain_gpt_moe.train_valid_test_datasets_provider,
                             pretrain_gpt_moe.model_provider, ModelType.encoder_or_decoder,
                             pretrain_gpt_moe.forward_step, argv=step["argv"])
            result["losses"] = r["history"]["lm_loss"]
        except SystemExit as exc:
            result["exit"] = exc.code
        finally:
            loop.Trainer.__init__ = orig_init
            logger.removeHandler(capture)
            if undo:
                undo()
        result.update(log=capture.messages, fb_calls=len(calls), text=text.getvalue())
        out.append(result)
    return out
