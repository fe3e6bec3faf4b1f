"""Megatron-LM's interleaved-schedule options, megatron-core ModelParallelConfig fields of the same
names (0.16 and 0.19 alike; ``models/builder.py`` copies every field-named arg into the config):

* ``--microbatch-group-size-per-virtual-pipeline-stage N``: micro-batches run in a row per virtual
  stage (default: the pipeline size, a depth-first schedule);
* ``--overlap-p2p-communication-warmup-flush``: overlap p2p with compute in the warmup and flush
  phases too (needs megatron-core's overlap_p2p_comm, on here with virtual stages).

Both only act in the interleaved schedule; megatron-core's own checks of them run at the first
step, so they are made here at parse time, with the flag's name. Seen on 2 gloo ranks (PP 2, 2
virtual stages) with megatron-core 0.16.1 and 0.19: training runs with both flags, but evaluation
(the forward-only interleaved schedule) with both stalls until the collective timeout when the
group is larger than the pipeline and divides the micro-batches (group 4 of 4, 3 of 6; not 4 of 6
or 2 of 4); each flag alone evaluates. The exact condition is megatron-core's and evaluation runs
its own micro-batch count: both flags with a group larger than the pipeline are refused at parse
time (a run that would hang at its first evaluation), each flag alone is kept.
"""

from __future__ import annotations

_VIRTUAL = "--virtual-pipeline-model-parallel-size / --num-layers-per-virtual-pipeline-stage"


def add_arguments(parser):
    from megatron_moe.flags import add_megatron_argument

    g = parser.add_argument_group("interleaved pipeline schedule (Megatron-LM's)")
    add_megatron_argument(g, "--microbatch-group-size-per-virtual-pipeline-stage",
                          help="Micro-batches run in a row per virtual pipeline stage "
                               "(default: --pipeline-model-parallel-size, depth first).")
    add_megatron_argument(g, "--overlap-p2p-communication-warmup-flush",
                          help="Overlap pipeline p2p with compute in the warmup and flush phases.")


def validate_args(args):
    group = args.microbatch_group_size_per_vp_stage
    vpp = getattr(args, "virtual_pipeline_model_parallel_size", None)
    if args.overlap_p2p_comm_warmup_flush:
        if not vpp:
            raise ValueError("--overlap-p2p-communication-warmup-flush needs virtual pipeline "
                             f"stages ({_VIRTUAL}): p2p overlap is on only in the interleaved "
                             "schedule (Megatron's rule)")
        if not getattr(args, "overlap_p2p_comm", True):
            raise ValueError("--overlap-p2p-communication-warmup-flush cannot be used with "
                             "--no-overlap-p2p-communication")
    if group is None:
        return
    pp = args.pipeline_model_parallel_size
    if not vpp:
        raise ValueError(f"--microbatch-group-size-per-virtual-pipeline-stage needs virtual "
                         f"pipeline stages ({_VIRTUAL})")
    m = args.num_microbatches
    # a ramp or step schedule changes the micro-batch count per iteration
    fixed_batch = args.rampup_batch_size is None and \
        getattr(args, "step_batch_size_schedule", None) is None
    if fixed_batch and not pp <= group <= m:
        raise ValueError(f"--microbatch-group-size-per-virtual-pipeline-stage {group} must be in "
                         f"[--pipeline-model-parallel-size {pp}, micro-batches per iteration {m}]")
    if args.overlap_p2p_comm_warmup_flush and group > pp:
        raise ValueError(f"--microbatch-group-size-per-virtual-pipeline-stage {group} (larger than "
                         f"--pipeline-model-parallel-size {pp}) with "
                         "--overlap-p2p-communication-warmup-flush: megatron-core's forward-only "
                         "interleaved schedule (evaluation) stalls with both; use one of them")
    if fixed_batch and 0 < m % group < pp:
        raise ValueError(f"--microbatch-group-size-per-virtual-pipeline-stage {group}: the "
                         f"micro-batches per iteration ({m}) leave a last group of {m % group}, "
                         f"fewer than --pipeline-model-parallel-size {pp} (megatron-core's rule)")
