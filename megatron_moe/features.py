"""The one way a feature plugs into a run.

A feature is a module of this package that provides any of these (all optional):

    add_arguments(parser)               its flags, with Megatron's spelling where Megatron has them
    validate_args(args)                 ranges and defaults of its own flags (ValueError names the flag)
    setting(args) -> str | None         the feature's flag as given when it is on, e.g.
                                        "--moe-balance-policy proprophet"; None when off
    EXCLUDES                            what it cannot run with: a tuple of flags.exclusions.Exclusion,
                                        refused here at parse time while ``setting`` is not None
    customize_spec(args, spec) -> spec  its edit of megatron-core's layer spec (models/builder.py)
    run_hooks(args, model, optimizer, tracker) -> hooks | None
                                        its part of the training step; ``hooks`` has any of the
                                        methods of :class:`RunHooks` below

``FEATURES`` lists them in the order their flags appear in ``--help``, they are validated and they
edit the spec. ``arguments.py`` (flags, validation), ``models/builder.py`` (spec) and
``training/loop.py`` (run hooks) read this list and nothing else: the training loop imports no
feature.
"""

from __future__ import annotations

import contextlib

from megatron_moe import balance, comm, offload
from megatron_moe.flags import exclusions
from megatron_moe.models import architecture, attention, embedding, gpt_oss, mla
from megatron_moe.moe import dispatcher, grouped_experts, topo_router
from megatron_moe.runtime import dist_signal_handler
from megatron_moe.training import (cuda_graph, manual_gc, megatron_fsdp, megatron_logging,
                                   pipeline_schedule, profiling, result_validation, wandb_writer)

FEATURES = (
    comm,                 # --moe-a2a-algorithm / compression / overlap, emulated link, topology
    embedding,            # --embedding-partition
    attention,            # local core attention: MLA's head dims; torch SDPA (--attention-backend flash)
    dispatcher,           # --moe-permute-fusion, chunked overlapped exchange
    topo_router,          # --moe-router-topology (its flags are comm's)
    balance,              # --moe-balance-policy: expert replication (Pro-Prophet, FasterMoE, FlexMoE)
    grouped_experts,      # --moe-grouped-gemm on the local path: torch grouped_mm experts
    offload,              # --moe-expert-offload host|ssd
    dist_signal_handler,  # --exit-signal, --exit-duration-in-mins
    wandb_writer,         # --wandb-project, --wandb-exp-name, ...
    megatron_logging,     # params norm, zeros in grad, timers, memory, validation ppl, log level
    pipeline_schedule,    # --microbatch-group-size-per-virtual-pipeline-stage, warmup/flush overlap
    profiling,            # --profile, --use-pytorch-profiler, --profile-step-start/-end/-ranks
    result_validation,    # --rerun-mode, --check-for-spiky-loss, --error-injection-*, ...
    cuda_graph,           # --cuda-graph-impl full_iteration: whole iterations captured (CUDA)
    manual_gc,            # --manual-gc, --manual-gc-interval, --no-manual-gc-eval
    megatron_fsdp,        # --use-megatron-fsdp, --data-parallel-sharding-strategy (ZeRO-1/2/3)
    mla,                  # MLA, YaRN, QK-norm, MTP (DeepSeek-V2/V3)
    gpt_oss,              # sinks, sliding windows, clamped GEGLU, YaRN (gpt-oss)
    architecture,         # activation, init, RoPE variants, q/k L2 norm, fp32 residual (Megatron-LM)
)


def name(feature) -> str:
    """A feature's key in checkpoints and logs: its module's last name (``balance``)."""
    return feature.__name__.rsplit(".", 1)[-1]


def add_arguments(parser, features=FEATURES):
    for feature in features:
        if hasattr(feature, "add_arguments"):
            feature.add_arguments(parser)
    return parser


def validate_args(args, features=FEATURES):
    """Every feature's own checks, then its declared exclusions (ValueError names the flags)."""
    for feature in features:
        if hasattr(feature, "validate_args"):
            feature.validate_args(args)
        if getattr(feature, "EXCLUDES", ()):
            exclusions.check(feature.setting(args), feature.EXCLUDES, args)


def customize_spec(args, spec, features=FEATURES):
    for feature in features:
        if hasattr(feature, "customize_spec"):
            spec = feature.customize_spec(args, spec)
    return spec


class RunHooks:
    """The features' parts of one training run, called by the training loop in this order:

    ``before_step(iteration)`` at the top of each loop pass; forward/backward of all micro-batches; ``before_finalize_grads`` / ``after_finalize_grads``
    around megatron-core's grad finalisation; ``after_optimizer_step(ok, grad_norm)`` before the
    learning rate moves; ``after_step(iteration)``; ``before_evaluate()`` / ``after_evaluate()``
    around each evaluation; ``metrics()`` and ``log_lines()`` each log interval;
    ``checkpoint_io(load)`` around every save and load; ``state_dict()`` into the
    checkpoint (one entry per feature, keyed by its name) and ``load_state_dict`` from it;
    ``close()`` at the end."""

    def __init__(self, args, model, optimizer=None, tracker=None, features=FEATURES):
        self.parts = {}
        for feature in features:
            if hasattr(feature, "run_hooks"):
                hooks = feature.run_hooks(args, model, optimizer, tracker)
                if hooks is not None:
                    self.parts[name(feature)] = hooks
        if any(hasattr(h, "before_finalize_grads") for h in self.parts.values()):
            self._wrap_finalize(model)

    def _wrap_finalize(self, model):
        """Replica gradients (balance's Agg) must reach their owners before megatron-core reduces
        and clips; the wrapped function is what megatron-core's schedule calls."""
        from megatron_moe.models.builder import unwrap

        config = unwrap(model[0]).config
        finalize = config.finalize_model_grads_func

        def finalize_with_features(*a, **k):
            self._call("before_finalize_grads")
            out = finalize(*a, **k)
            self._call("after_finalize_grads")
            return out

        config.finalize_model_grads_func = finalize_with_features

    def _call(self, method, *a):
        for hooks in self.parts.values():
            if hasattr(hooks, method):
                getattr(hooks, method)(*a)

    def get(self, feature_name):
        return self.parts.get(feature_name)

    def after_optimizer_step(self, update_successful, grad_norm):
        self._call("after_optimizer_step", update_successful, grad_norm)

    def before_step(self, iteration):
        self._call("before_step", iteration)

    def after_step(self, iteration):
        self._call("after_step", iteration)

    def before_evaluate(self):
        self._call("before_evaluate")

    def after_evaluate(self):
        self._call("after_evaluate")

    def metrics(self) -> dict:
        out = {}
        for hooks in self.parts.values():
            if hasattr(hooks, "metrics"):
                out.update(hooks.metrics())
        return out

    def log_lines(self) -> list:
        return [h.log_line() for h in self.parts.values() if hasattr(h, "log_line")]

    def checkpoint_io(self, load=False):
        stack = contextlib.ExitStack()
        for hooks in self.parts.values():
            if hasattr(hooks, "checkpoint_io"):
                stack.enter_context(hooks.checkpoint_io(load))
        return stack

    def state_dict(self) -> dict:
        return {key: h.state_dict() for key, h in self.parts.items() if hasattr(h, "state_dict")}

    def load_state_dict(self, state: dict):
        for key, hooks in self.parts.items():
            if state.get(key) and hasattr(hooks, "load_state_dict"):
                hooks.load_state_dict(state[key])

    def close(self):
        self._call("close")
