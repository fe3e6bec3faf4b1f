"""Flags of ring-memory offloading for the inference tools (argparse only: imported by --help)."""

from __future__ import annotations


def add_ring_memory_args(parser):
    g = parser.add_argument_group("ring-memory offloading (MoESys)")
    g.add_argument("--ring-memory-slots", type=int, default=0, metavar="K",
                   help="Keep every transformer layer's weights (experts included) in host memory "
                        "and compute through K device slots, refilled in a ring: after layer i "
                        "ran, its slot receives layer (i+K) mod N. 0 (default): all resident.")
    g.add_argument("--ring-memory-link-gbps", type=float, default=None, metavar="GBPS",
                   help="Emulate a host-to-device link of this bandwidth (GB/s) for the slot "
                        "copies (CPU machines: measure overlap without a GPU). Default: unthrottled.")
    g.add_argument("--ring-memory-debug", action="store_true",
                   help="Fill a released slot with NaN and jitter the copy latency, so a compute "
                        "that does not wait for its copy produces NaN instead of passing by luck.")
    g.add_argument("--ring-memory-experts", default="all", choices=["all", "active"],
                   help="all: stream every local expert of a layer. active: stream the non-expert "
                        "weights and only the experts the router picked at the layer's previous "
                        "forward; an expert that then receives tokens unexpectedly is fetched "
                        "before the experts run (fewer bytes per decode step, for latency).")
    return parser


def validate_ring_memory_args(args):
    k = args.ring_memory_slots
    if k < 0:
        raise ValueError(f"--ring-memory-slots must be >= 0 (got {k})")
    if k == 0 and (args.ring_memory_link_gbps is not None or args.ring_memory_debug
                   or args.ring_memory_experts != "all"):
        raise ValueError("--ring-memory-link-gbps / --ring-memory-debug / --ring-memory-experts "
                         "need --ring-memory-slots > 0")
    if args.ring_memory_experts == "active" and not args.num_experts:
        raise ValueError("--ring-memory-experts active needs an MoE model (--num-experts)")
    if k and (getattr(args, "moe_single_grouped_weight", False)
              or getattr(args, "moe_single_grouped_bias", False)):
        raise ValueError("--ring-memory-slots streams each expert's own weights; "
                         "--moe-single-grouped-weight / --moe-single-grouped-bias hold all of a "
                         "layer's experts in one tensor (the checkpoint is the same without them)")
    if args.ring_memory_experts == "active" and args.moe_grouped_gemm and \
            getattr(args, "transformer_impl", None) == "transformer_engine":
        raise ValueError("--ring-memory-experts active needs per-expert weights; --moe-grouped-gemm "
                         "on Transformer Engine (TEGroupedMLP) packs all experts into one tensor "
                         "(the local path's grouped experts keep SequentialMLP's)")
    if args.ring_memory_link_gbps is not None and args.ring_memory_link_gbps <= 0:
        raise ValueError(f"--ring-memory-link-gbps must be > 0 (got {args.ring_memory_link_gbps})")
    if k > 0:
        from megatron_moe.models.pipeline_split import layers_per_stage

        layers = min(layers_per_stage(args))   # the split megatron-core builds (may be uneven)
        if k > layers:
            raise ValueError(f"--ring-memory-slots {k} exceeds the {layers} transformer layers of "
                             f"a pipeline stage (K <= N; K = N streams nothing)")


def attach_ring_memory(model, args):
    """A RingMemory over the model's transformer layers when --ring-memory-slots > 0, else None."""
    if not getattr(args, "ring_memory_slots", 0):
        return None
    from megatron_moe.inference.ring_memory import RingMemory

    return RingMemory.from_args(model, args)
