"""Megatron-LM's manual garbage collection (``--manual-gc``, ``--manual-gc-interval``,
``--no-manual-gc-eval``; ``megatron/training/training.py`` ``train`` and ``evaluate``,
core_v0.19.0).

Python's collector runs whenever its allocation counters say so, at a different moment on every
rank. A full collection in a training step of a large model takes tens to hundreds of
milliseconds of host time, and in a synchronous data-parallel step every other rank waits for the
slowest one: one rank's collection stalls all of them. With ``--manual-gc`` the automatic collector
is off for the run and a collection runs on every rank at the same iteration: after every
``--manual-gc-interval`` iterations (0: never), and around each evaluation (a full collection
before it, a young-generation one after it) unless ``--no-manual-gc-eval``. The collector is
switched back on when the run ends (Megatron-LM's process exits instead; a run here may be one
call in a longer process).
"""

from __future__ import annotations

import gc


def add_arguments(parser):
    from megatron_moe.flags import add_megatron_argument

    g = parser.add_argument_group("manual garbage collection (Megatron-LM's)")
    add_megatron_argument(g, "--manual-gc",
                          help="Automatic Python garbage collection off; collect on every rank at "
                               "the same iterations instead.")
    add_megatron_argument(g, "--manual-gc-interval",
                          help="With --manual-gc: collect every N iterations (0: only around "
                               "evaluations).")
    add_megatron_argument(g, "--no-manual-gc-eval",
                          help="With --manual-gc: no collection around evaluations.")
    return parser


def validate_args(args):
    if args.manual_gc and args.manual_gc_interval < 0:
        raise ValueError(f"--manual-gc-interval {args.manual_gc_interval}: must be 0 or more "
                         "(Megatron-LM's rule)")


def run_hooks(args, model, optimizer, tracker):
    return ManualGC(args) if args.manual_gc else None


class ManualGC:
    def __init__(self, args):
        self.interval = args.manual_gc_interval
        self.around_eval = args.manual_gc_eval
        self.was_enabled = gc.isenabled()
        gc.disable()
        gc.collect()

    def after_step(self, iteration):
        if self.interval and iteration % self.interval == 0:
            gc.collect()

    def before_evaluate(self):
        if self.around_eval:
            gc.collect()

    def after_evaluate(self):
        if self.around_eval:
            gc.collect(generation=0)

    def close(self):
        if self.was_enabled:
            gc.enable()
