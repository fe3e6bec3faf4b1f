"""The global batch per iteration (--global-batch-size, --rampup-batch-size,
--step-batch-size-schedule, --decrease-batch-size-if-needed): megatron-core's num-microbatches
calculator, set up as Megatron-LM's set_global_variables does.

megatron-core 0.16 ramps the batch itself (``RampupBatchsizeNumMicroBatchesCalculator``). From 0.19
``init_num_microbatches_calculator`` ignores ``rampup_batch_size`` (deprecated in favour of
``step_batch_size_schedule``); there the ramp is given to megatron-core's step schedule as the
thresholds at which the 0.16 rule changes the batch, so both releases run the same batches.
``--step-batch-size-schedule`` is that 0.19 calculator given directly (refused on 0.16).
"""

from __future__ import annotations


def _has_rampup_calculator() -> bool:
    from megatron.core import num_microbatches_calculator as nmc

    return hasattr(nmc, "RampupBatchsizeNumMicroBatchesCalculator")


def rampup_batch(consumed_samples: int, rampup_batch_size, global_batch_size: int) -> int:
    """The global batch at ``consumed_samples``: megatron-core 0.16's RampupBatchsize rule
    (written here only to hand 0.19 its thresholds; the same float expression, so the same
    integers)."""
    start, increment, ramp_samples = (int(v) for v in rampup_batch_size)
    if consumed_samples > ramp_samples:
        return global_batch_size
    per_increment = ramp_samples / ((global_batch_size - start) // increment)
    return start + int(consumed_samples / per_increment) * increment


def rampup_step_schedule(rampup_batch_size, global_batch_size: int) -> str:
    """The ramp as megatron-core 0.19's ``step_batch_size_schedule`` ("SAMPLES:BATCH ...")."""
    start, increment, ramp_samples = (int(v) for v in rampup_batch_size)
    entries = {0: start}
    increments = (global_batch_size - start) // increment
    for k in range(1, increments + 1):
        # the first sample count whose batch reaches start + k * increment
        first = min(-(-k * ramp_samples // increments), ramp_samples + 1)
        while first > 0 and rampup_batch(first - 1, rampup_batch_size, global_batch_size) >= \
                start + k * increment:
            first -= 1
        while rampup_batch(first, rampup_batch_size, global_batch_size) < start + k * increment:
            first += 1
        entries[first] = rampup_batch(first, rampup_batch_size, global_batch_size)
    return " ".join(f"{at}:{batch}" for at, batch in sorted(entries.items()))


def init_microbatch_calculator(args) -> None:
    """megatron-core's global calculator for this run (replacing any earlier run's)."""
    from megatron.core import num_microbatches_calculator as nmc

    nmc.destroy_num_microbatches_calculator()
    kwargs = dict(rank=getattr(args, "rank", 0), global_batch_size=args.global_batch_size,
                  micro_batch_size=args.micro_batch_size,
                  data_parallel_size=args.data_parallel_size,
                  decrease_batch_size_if_needed=args.decrease_batch_size_if_needed)
    rampup = args.rampup_batch_size
    schedule = getattr(args, "step_batch_size_schedule", None)
    if schedule is not None:   # Megatron-LM's set_global_variables: thresholds in tokens
        nmc.init_num_microbatches_calculator(step_batch_size_schedule=schedule,
                                             seq_length=args.seq_length, **kwargs)
    elif rampup is None:
        nmc.init_num_microbatches_calculator(rampup_batch_size=None, **kwargs)
    elif _has_rampup_calculator():
        nmc.init_num_microbatches_calculator(rampup_batch_size=list(rampup), **kwargs)
    else:
        nmc.init_num_microbatches_calculator(
            step_batch_size_schedule=rampup_step_schedule(rampup, args.global_batch_size), **kwargs)


def check_rampup_with_decrease() -> None:
    """megatron-core 0.19's step schedule refuses decrease_batch_size_if_needed (0.16's ramp-up
    calculator rounds each batch down): ValueError on 0.19."""
    if not _has_rampup_calculator():
        from megatron_moe.compat.versions import megatron_core_version

        raise ValueError(f"--decrease-batch-size-if-needed with --rampup-batch-size needs "
                         f"megatron-core's ramp-up calculator (0.16; this is "
                         f"{megatron_core_version()}, whose batch schedules refuse it)")


def rampup_train_iters(args) -> int:
    """Iterations of a --train-samples run with --rampup-batch-size: Megatron-LM's
    update_train_iters (ramp iterations counted with the calculator, then whole global batches;
    a partial last batch is dropped)."""
    from megatron.core.num_microbatches_calculator import (get_current_global_batch_size,
                                                           update_num_microbatches)

    init_microbatch_calculator(args)
    iterations, consumed = 0, 0
    while consumed <= int(args.rampup_batch_size[2]) and consumed <= args.train_samples:
        update_num_microbatches(consumed, consistency_check=False)
        consumed += get_current_global_batch_size()
        iterations += 1
    update_num_microbatches(0, consistency_check=False)
    if args.train_samples > consumed:
        iterations += (args.train_samples - consumed) // args.global_batch_size
    return iterations


def step_schedule_batches(schedule: str, seq_length: int, micro_batch_size: int,
                          data_parallel_size: int):
    """The global batches of a --step-batch-size-schedule, parsed and checked by megatron-core's
    own calculator (thresholds in tokens, as Megatron-LM builds it); its error as a string when
    the schedule is malformed."""
    from megatron.core.num_microbatches_calculator import StepBatchsizeNumMicroBatchesCalculator

    try:   # rank 1: megatron-core logs the schedule on rank 0 only (the run logs it once)
        calculator = StepBatchsizeNumMicroBatchesCalculator(
            micro_batch_size, data_parallel_size, False, rank=1, schedule=schedule,
            seq_length=seq_length)
    except (ValueError, AssertionError) as exc:
        return str(exc) or "malformed"
    return [batch for _, batch in calculator.schedule]


def step_schedule_train_iters(args) -> int:
    """Iterations of a --train-samples run with --step-batch-size-schedule: Megatron-LM's
    update_train_iters (iterations until the consumed samples reach --train-samples; the last
    batch may overshoot)."""
    from megatron.core.num_microbatches_calculator import (get_current_global_batch_size,
                                                           update_num_microbatches)

    init_microbatch_calculator(args)
    iterations, consumed = 0, 0
    while consumed < args.train_samples:
        update_num_microbatches(consumed, consistency_check=False)
        consumed += get_current_global_batch_size()
        iterations += 1
    update_num_microbatches(0, consistency_check=False)
    return iterations
