"""Megatron-LM's result validation on megatron-core's own ``RerunStateMachine``.

A NaN/Inf loss or gradient-bucket norm (megatron-core's DDP checks the gradients, as Megatron-LM
has it: models/builder.py), with --check-for-spiky-loss a spiky loss, with --check-for-large-grads
a large bucket norm, makes the machine re-run the iteration in place to tell a transient fault
from a reproducible result. NaN/Inf are fatal, as in Megatron-LM's train loop: a transient fault
exits 17; a reproducible result is written to a checkpoint (the iteration before) and the job
exits 16, to be resumed, preferably on other GPUs, where the iteration runs a third time (and the
job exits 17 with the diagnosis). Spikes and large grads are not fatal: training continues.
--rerun-mode disabled: no re-runs; the training loop's own NaN check stops the run (what it did
before this module). report_stats: every iteration runs twice and megatron-core logs how much the
validated results vary between the two runs.

One difference in *when*, not in what: Megatron-LM's loss function calls ``validate_result`` on
every micro-batch, and megatron-core reads each rejection test on the host (``if torch.isnan(loss)``:
two device syncs per micro-batch). Here the loss function only records its loss on the device
(:func:`record_loss`); after the iteration's forward-backward, :func:`validate_recorded` brings all
of them to the host in one copy and makes the same ``validate_result`` calls, in the same order and
with the same messages, on host copies (the machine counts calls per message, so its bookkeeping
is the same). The machine acts on the results only once the forward-backward is over
(``should_run_forward_backward``), so the outcome is the same, at one host read per iteration
instead of two per micro-batch (plus megatron-core's own all-reduce of the verdict). With
--check-for-large-grads, megatron-core's gradient validation runs inside the backward, so here it
comes before the loss validations (after them in Megatron-LM): when a loss and a gradient are both
rejected in one iteration, the gradient is the result the re-run checks (the first rejected one).
"""

from __future__ import annotations

import contextlib
import os
from functools import partial

import torch

# Megatron-LM's pretrain_gpt.py: a spiky loss is 10x the largest loss seen in the first 100
SPIKY_LOSS_FACTOR = 10

# --rerun-mode's values (Megatron-LM's choices) -> megatron-core's RerunMode values. Megatron-LM
# passes the flag's value to RerunMode() as is, which has no "report_stats" member (its value is
# "report_determinism_stats"): the flag's meaning, the determinism statistics, is what runs here.
_MODES = {"disabled": "disabled", "validate_results": "validate_results",
          "report_stats": "report_determinism_stats"}

_recorded: list = []   # this iteration's (loss on the device) per micro-batch, in call order
_validates_loss = False   # a loss check is on (NaN/Inf or --check-for-spiky-loss): else nothing
                          # is recorded, nor read on the host
# initialize() ran (pretrain()): tools that save checkpoints or evaluate without pretrain() have no
# machine of their own, and store or restore no machine state (megatron-core would create a
# disabled one on first use, with a warning)
_initialized = False


def add_arguments(parser):
    from megatron_moe.flags import add_megatron_argument as add

    g = parser.add_argument_group("result validation (megatron-core's rerun state machine)")
    add(g, "--rerun-mode",
        help="validate_results (default): re-run an iteration whose loss is NaN/Inf (or spiky, "
             "or whose grads are large) to tell a transient fault from a reproducible result; "
             "report_stats: run every iteration twice and log the variability; disabled: none.")
    add(g, "--check-for-spiky-loss",
        help="Validate the loss against 10x the largest of the first 100 (non-fatal: a "
             "reproducible spike continues training).")
    add(g, "--check-for-large-grads",
        help="Validate each gradient bucket's norm against 10x the largest of the first 100 "
             "(megatron-core DDP's check_for_large_grads; non-fatal).")
    add(g, "--error-injection-rate",
        help="Inject a validation failure once every N validations (0: never; megatron-core's "
             "RerunErrorInjector, to test the machinery).")
    add(g, "--error-injection-type", help="What the injected failure behaves like.")
    add(g, "--result-rejected-tracker-filename",
        help="Append one line per rejected result (rank, iteration, status, value) to this file.")


def validate_args(args):
    if args.error_injection_rate < 0:
        raise ValueError(f"--error-injection-rate must be >= 0 (got {args.error_injection_rate})")
    path = args.result_rejected_tracker_filename
    if path is not None:
        folder = os.path.dirname(os.path.abspath(path))
        writable = os.access(path, os.W_OK) if os.path.exists(path) else os.access(folder, os.W_OK)
        if os.path.isdir(path) or not writable:
            raise ValueError(f"--result-rejected-tracker-filename {path}: cannot append to it "
                             f"(a writable file, in an existing writable folder)")


def initialize(args):
    """Megatron-LM's initialize_rerun_state_machine: the mode, the error injector, the tracker
    file, and the model-parallel RNG tracker's states saved and restored around a re-run (the
    machine itself takes care of Python's, NumPy's and torch's generators)."""
    global _initialized
    from megatron.core import tensor_parallel
    from megatron.core.rerun_state_machine import (RerunDiagnostic, RerunErrorInjector, RerunMode,
                                                   destroy_rerun_state_machine,
                                                   initialize_rerun_state_machine)

    def state_save_func():
        return {"rng_tracker_states": tensor_parallel.get_cuda_rng_tracker().get_states()}

    def state_restore_func(state_dict):
        if state_dict["rng_tracker_states"]:
            tensor_parallel.get_cuda_rng_tracker().set_states(state_dict["rng_tracker_states"])

    from megatron_moe.compat.rerun import fix_report_stats_caller

    fix_report_stats_caller()   # megatron-core 0.16's statistics report (compat/rerun.py)
    global _validates_loss
    destroy_rerun_state_machine()   # a second pretrain() in one process (tests, tools)
    _recorded.clear()
    _initialized = True
    _validates_loss = bool(args.check_for_nan_in_loss or args.check_for_spiky_loss)
    initialize_rerun_state_machine(
        state_save_func=state_save_func, state_restore_func=state_restore_func,
        mode=RerunMode(_MODES[args.rerun_mode]),
        error_injector=RerunErrorInjector(
            error_injection_rate=args.error_injection_rate,
            error_injection_type=RerunDiagnostic(args.error_injection_type)),
        result_rejected_tracker_filename=args.result_rejected_tracker_filename)


def machine():
    from megatron.core.rerun_state_machine import get_rerun_state_machine

    return get_rerun_state_machine()


def enabled() -> bool:
    from megatron.core.rerun_state_machine import RerunMode

    return _initialized and machine().get_mode() != RerunMode.DISABLED


def record_loss(loss):
    """Called by the loss functions with the micro-batch's loss (what Megatron-LM's loss_func
    validates): kept on the device until :func:`validate_recorded`. Nothing while disabled (and
    during evaluation, which runs with the machine disabled, as in Megatron-LM; nor when no loss
    check is on)."""
    if _validates_loss and enabled():
        _recorded.append(loss.detach().reshape(()))


def validate_recorded(args):
    """Megatron-LM's loss_func validations for every micro-batch of the forward-backward just run
    (module doc): NaN and Inf (fatal), then with --check-for-spiky-loss the spike (non-fatal)."""
    if not _recorded:
        return
    rsm = machine()
    losses = torch.stack(_recorded).float().tolist()   # the one device-to-host copy
    _recorded.clear()
    for value in losses:
        loss = torch.tensor(value)   # a host copy: the machine's tests and comparisons cost nothing
        if args.check_for_nan_in_loss:
            rsm.validate_result(result=loss, rejection_func=torch.isnan,
                                message="found NaN in local forward loss calculation",
                                tolerance=0.0, fatal=True)   # forward calculations are deterministic
            rsm.validate_result(result=loss, rejection_func=torch.isinf,
                                message="found Inf in local forward loss calculation",
                                tolerance=0.0, fatal=True)
        if args.check_for_spiky_loss:
            rsm.validate_result(
                result=loss, rejection_func=partial(rsm.is_unexpectedly_large,
                                                    threshold=SPIKY_LOSS_FACTOR, context="loss"),
                message="Spiky loss", tolerance=0.0, fatal=False)


def wrap_iterator(data_iterator):
    """Megatron-LM's RerunDataIterator around a training reader: an iteration that is re-run reads
    the same micro-batches again (a list: one per virtual pipeline stage)."""
    from megatron.core.rerun_state_machine import RerunDataIterator

    if data_iterator is None:
        return None
    if isinstance(data_iterator, list):
        return [wrap_iterator(d) for d in data_iterator]
    return RerunDataIterator(data_iterator)


@contextlib.contextmanager
def disabled_during_evaluation():
    """Megatron-LM's evaluate(): no result validation while evaluating."""
    from megatron.core.rerun_state_machine import RerunMode

    if not enabled():
        yield
        return
    rsm = machine()
    mode = rsm.get_mode()
    rsm.set_mode(RerunMode.DISABLED)
    try:
        yield
    finally:
        rsm.set_mode(mode)


def checkpoint_state(train_data_iterator):
    """What Megatron-LM stores under ``rerun_state_machine`` in a checkpoint (None: nothing)."""
    if not _initialized:
        return None
    return machine().state_dict(data_iterator=train_data_iterator, ckpt_format="torch_dist")


def checkpoint_template(common_state):
    """The sharded template to load the checkpoint's machine state into, or None when the
    checkpoint holds no state worth loading (no re-run pending): Megatron-LM's load_checkpoint."""
    if not _initialized or not common_state:
        return None
    rsm = machine()
    if not rsm.validate_state_dict(common_state):
        return None
    return rsm.state_dict(data_iterator=None, ckpt_format="torch_dist", force=True)
