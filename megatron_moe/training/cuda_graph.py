"""Megatron-LM's full-iteration CUDA graph: one training iteration's forward and backward captured
once and replayed, megatron-core's ``FullCudaGraphWrapper`` around the schedule's
forward_backward function, as Megatron-LM's ``train`` and ``evaluate`` do.

Spelled as in Megatron-LM: ``--cuda-graph-impl full_iteration`` (core_v0.19) or
``--cuda-graph-impl local --cuda-graph-scope full_iteration`` (core_v0.16; core_v0.19 migrates
it); ``--cuda-graph-warmup-steps`` iterations run eagerly first (Megatron's default 3). On a GPU
a replay is one graph launch where an eager iteration launches thousands of kernels from Python:
the host time of a fine-grained MoE model (docs/gpu.md) is what it removes. torchtitan's training
step captures the same way (the perf section's torchtitan row).

A capture fails at the first host read of device data (a ``.item()``, a ``.tolist()``, an op
whose output size depends on the data) and a replay repeats the captured kernels only: nothing
that runs Python per iteration inside the region may change what the device does. Refused at parse
time with one line, what reads the host in the forward or backward or changes per iteration:

* megatron-core's NaN check of the loss (Megatron-LM's own rule: ``--no-check-for-nan-in-loss-and-grad``);
* expert or expert-tensor parallelism with dropless routing: megatron-core's all-to-all reads its
  split sizes on the host (the one per-layer read left, docs/gpu.md "Host syncs"); padded to a
  capacity (``--moe-expert-capacity-factor`` with ``--moe-pad-expert-input-to-capacity``, Megatron's
  way to fixed shapes) nothing is read and the graph is allowed;
* experts without ``--moe-grouped-gemm``: ``SequentialMLP`` splits the tokens by a host list;
* ``--moe-balance-policy`` / routing traces, ``--moe-a2a-overlap-degree``: their exchanges read
  count matrices on the host; ``--moe-expert-offload``: host copies on a thread;
* result validation's checks beyond the defaults (``--check-for-spiky-loss``,
  ``--check-for-large-grads``, ``--error-injection-rate``, ``--rerun-mode report_stats``): they act
  on results the region records in Python per micro-batch, which a replay does not; the default
  ``validate_results`` mode stays, idle (no check on);
* fp16 with a dynamic loss scale: megatron-core's scaler makes a new scale tensor when it changes,
  the graph keeps multiplying by the old one (``--loss-scale`` holds one tensor).

A capture without torch's ``set_override_stale_capture_stream`` (pytorch/pytorch#180090) also
fails when its backward reaches an AccumulateGrad node made before it (on the default stream):
under a full-iteration graph megatron-core DDP's hooks are moved to the parameters
(models/builder.py, compat/ddp.py ``hook_parameters``) and each MoE layer drops the graph its
dispatcher keeps (compat/dispatch.py ``drop_kept_graph``).

Which shapes qualify is proven on the CPU (tests/test_cuda_graph.py): the region of the GPU kit's
configurations reads nothing on the host after warm-up. The capture itself runs on CUDA only,
unverified here until a GPU run (the perf section's ``ours-graphed`` row).
"""

from __future__ import annotations

FLAG = "--cuda-graph-impl"
SCOPE_FLAG = "--cuda-graph-scope"
FULL = "full_iteration"


def add_arguments(parser):
    from megatron_moe.flags import add_megatron_argument

    g = parser.add_argument_group("full-iteration CUDA graph")
    # core_v0.16's spelling (dest cuda_graph_scope); core_v0.19 keeps it as a deprecated alias
    add_megatron_argument(g, SCOPE_FLAG, dest="cuda_graph_scope", type=str,
                          help="core_v0.16's spelling: full_iteration with --cuda-graph-impl local "
                               "captures a whole training iteration (megatron-core's "
                               "FullCudaGraphWrapper). Other scopes capture Transformer Engine "
                               "layers: refused here.")
    return parser


def full_iteration(args) -> bool:
    """Whether the run captures whole iterations (either release's spelling; the flags and
    megatron-core's config fields share their names)."""
    from megatron_moe.compat.cuda_graph import captures_whole_iterations

    return captures_whole_iterations(args)


def validate_args(args):
    """The refusals listed in the module docstring (ValueError names the flag)."""
    scope = getattr(args, "cuda_graph_scope", None) or []
    if scope and scope != [FULL]:
        raise ValueError(f"{SCOPE_FLAG} {' '.join(scope)}: only {FULL} here (per-layer scopes "
                         f"capture Transformer Engine layers; a dropless MoE layer's shapes change "
                         f"with every batch)")
    if scope and args.cuda_graph_impl != "local":
        raise ValueError(f"{SCOPE_FLAG} {FULL} needs {FLAG} local (Megatron-LM's rule; "
                         f"{FLAG} {FULL} is the newer spelling)")
    if not full_iteration(args):
        return
    # on a CPU arguments.py's GPU-only check has refused --cuda-graph-impl already
    spelling = f"{FLAG} {args.cuda_graph_impl}" + (f" {SCOPE_FLAG} {FULL}" if scope else "")
    why = _refusal(args)
    if why:
        raise ValueError(f"{spelling} cannot capture {why}")


_READS = "it reads counts or copies on the host in the forward or backward"
# result validation acts on what the region records in Python per micro-batch (the losses,
# megatron-core's gradient-bucket checks): a replay records nothing
_RECORDS = "result validation records each micro-batch's results in Python"
# (flag, dest, its off value, why a capture cannot take it)
_REFUSED_FEATURES = (("--moe-balance-policy", "moe_balance_policy", "none", _READS),
                     ("--moe-routing-trace-dir", "moe_routing_trace_dir", None, _READS),
                     ("--moe-a2a-overlap-degree", "moe_a2a_overlap_degree", 1, _READS),
                     ("--moe-expert-offload", "moe_expert_offload", "none", _READS),
                     ("--check-for-spiky-loss", "check_for_spiky_loss", False, _RECORDS),
                     ("--check-for-large-grads", "check_for_large_grads", False, _RECORDS),
                     ("--error-injection-rate", "error_injection_rate", 0, _RECORDS))


def _refusal(args) -> str | None:
    from megatron_moe.moe import grouped_experts

    if getattr(args, "check_for_nan_in_loss", True):
        return ("megatron-core's NaN check of the loss: add --no-check-for-nan-in-loss-and-grad "
                "(Megatron-LM's rule)")
    etp = getattr(args, "expert_tensor_parallel_size", None) or args.tensor_model_parallel_size
    padded = (getattr(args, "moe_expert_capacity_factor", None) is not None
              and getattr(args, "moe_pad_expert_input_to_capacity", False))
    if (getattr(args, "expert_model_parallel_size", 1) > 1 or etp > 1) and not padded:
        return ("expert or expert-tensor parallelism with dropless routing: megatron-core's "
                "all-to-all reads its split sizes on the host (fixed shapes: "
                "--moe-expert-capacity-factor with --moe-pad-expert-input-to-capacity)")
    if getattr(args, "num_experts", None) and not (grouped_experts.local_grouped(args) or
                                                   args.transformer_impl == "transformer_engine"):
        return ("megatron-core's expert loop (SequentialMLP splits the tokens by a host list): "
                "add --moe-grouped-gemm")
    for flag, dest, off, why in _REFUSED_FEATURES:
        if getattr(args, dest, off) not in (off, None):
            return f"{flag}: {why}"
    if getattr(args, "rerun_mode", "disabled") == "report_stats":
        return ("--rerun-mode report_stats: it compares two runs of each iteration's recorded "
                "results (a replay records none)")
    if getattr(args, "fp16", False) and getattr(args, "loss_scale", None) is None:
        return ("fp16's dynamic loss scale (a new scale tensor when it changes, the graph keeps "
                "the old one): give --loss-scale")
    return None


def config_fields(args) -> dict:
    """The TransformerConfig fields that say "full iteration" to megatron-core (its schedules then
    build no per-layer graphs); none when the run does not capture whole iterations."""
    from megatron_moe.compat.cuda_graph import full_iteration_config_fields

    return full_iteration_config_fields() if full_iteration(args) else {}


def wrap(forward_backward, args, config):
    """megatron-core's FullCudaGraphWrapper around ``forward_backward`` when the run captures whole
    iterations (``forward_backward`` itself otherwise). One wrapper serves training and
    evaluation: it keeps a graph for each (``forward_only``)."""
    if not full_iteration(args):
        return forward_backward
    from megatron_moe.compat.cuda_graph import full_cuda_graph_wrapper

    return full_cuda_graph_wrapper(forward_backward, args.cuda_graph_warmup_steps,
                                   getattr(config, "cuda_graph_use_single_mempool", False))
