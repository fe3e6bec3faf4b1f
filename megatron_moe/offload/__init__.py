"""MoESys hierarchical storage for training: experts' weights, grads and Adam moments between
uses on the host (``--moe-expert-offload host``) or in files behind an LFU host cache (``ssd``),
with the compute device holding only a K-layer arena filled by 2D prefetch. See docs/offload.md.

A feature (megatron_moe/features.py); the run calls::

    mgr = offload.run_hooks(args, model_chunks, optimizer)         # None when --moe-expert-offload none
    with mgr.checkpoint_io(load=True): load_checkpoint(...)        # and load=False around saves
    print(mgr.log_line())                                          # each log interval
    mgr.close()

The copy link and slot arena shared with ring-memory inference are in ``offload/link.py``.
"""

from __future__ import annotations

from megatron_moe.flags.exclusions import Exclusion, te_grouped_gemm

__all__ = ["add_arguments", "validate_args", "setting", "EXCLUDES", "run_hooks", "install"]


def add_arguments(parser):
    g = parser.add_argument_group("MoE expert offload (MoESys hierarchical storage)")
    g.add_argument("--moe-expert-offload", choices=["none", "host", "ssd"], default="none",
                   help="Where expert parameters, gradients and Adam moments live between uses: "
                        "none (device, as usual), host (host memory, pinned on CUDA), ssd (files "
                        "under --moe-offload-dir behind a host cache). The device keeps only "
                        "--moe-offload-cache-layers MoE layers' experts (docs/offload.md).")
    g.add_argument("--moe-offload-dir", type=str, default=None,
                   help="Directory of the ssd tier's state files (one per rank, pread/pwrite).")
    g.add_argument("--moe-offload-host-cache-gb", type=float, default=None,
                   help="Host cache in front of the ssd tier, GB (default 1.0).")
    g.add_argument("--moe-offload-cache-policy", choices=["lfu", "lru"], default=None,
                   help="Host cache eviction rule of the ssd tier (default lfu, MoESys's).")
    g.add_argument("--moe-offload-cache-layers", type=int, default=None,
                   help="K: MoE layers' experts held on the device at once (>= 2: the one "
                        "computing and the one prefetched; default 2).")
    g.add_argument("--moe-offload-link-gbps", type=float, default=None,
                   help="Throttle host<->device copies to this bandwidth (GB/s): an emulated link "
                        "to measure overlap without a GPU (default: unthrottled).")
    g.add_argument("--moe-offload-debug-nan-fill", action="store_true",
                   help="Debug: fill released device slots with NaN and jitter the link, so a "
                        "missing wait corrupts the loss instead of passing by luck.")
    return parser


_DEFAULTS = dict(moe_expert_offload="none", moe_offload_dir=None, moe_offload_host_cache_gb=None,
                 moe_offload_cache_policy=None, moe_offload_cache_layers=None,
                 moe_offload_link_gbps=None, moe_offload_debug_nan_fill=False)


def validate_args(args):
    """Refuse what cannot apply (ValueError naming the flag); fill defaults."""
    for k, v in _DEFAULTS.items():
        if not hasattr(args, k):
            setattr(args, k, v)
    mode = args.moe_expert_offload
    given = {"--moe-offload-dir": args.moe_offload_dir is not None,
             "--moe-offload-host-cache-gb": args.moe_offload_host_cache_gb is not None,
             "--moe-offload-cache-policy": args.moe_offload_cache_policy is not None,
             "--moe-offload-cache-layers": args.moe_offload_cache_layers is not None,
             "--moe-offload-link-gbps": args.moe_offload_link_gbps is not None,
             "--moe-offload-debug-nan-fill": bool(args.moe_offload_debug_nan_fill)}
    if mode == "none":
        for flag, is_given in given.items():
            if is_given:
                raise ValueError(f"{flag} needs --moe-expert-offload host or ssd")
        return
    if mode != "ssd":
        for flag in ("--moe-offload-dir", "--moe-offload-host-cache-gb", "--moe-offload-cache-policy"):
            if given[flag]:
                raise ValueError(f"{flag} applies to --moe-expert-offload ssd only (got {mode})")
    if not getattr(args, "num_experts", None):
        raise ValueError("--moe-expert-offload needs an MoE model (--num-experts)")
    if args.moe_offload_cache_layers is None:
        args.moe_offload_cache_layers = 2
    if args.moe_offload_cache_layers < 2:
        raise ValueError("--moe-offload-cache-layers must be >= 2 (the layer computing and the "
                         f"layer prefetched), got {args.moe_offload_cache_layers}")
    if args.moe_offload_link_gbps is not None and args.moe_offload_link_gbps <= 0:
        raise ValueError(f"--moe-offload-link-gbps must be > 0 (got {args.moe_offload_link_gbps})")
    if mode == "ssd":
        if not args.moe_offload_dir:
            raise ValueError("--moe-expert-offload ssd needs --moe-offload-dir")
        if getattr(args, "bf16", False) or getattr(args, "fp16", False):
            raise ValueError("--moe-expert-offload ssd: --bf16/--fp16 are not supported (the ssd "
                             "tier stores the fp32 parameters themselves as master weights)")
        if args.moe_offload_host_cache_gb is None:
            args.moe_offload_host_cache_gb = 1.0
        if args.moe_offload_host_cache_gb <= 0:
            raise ValueError("--moe-offload-host-cache-gb must be > 0 "
                             f"(got {args.moe_offload_host_cache_gb})")
        if args.moe_offload_cache_policy is None:
            args.moe_offload_cache_policy = "lfu"


def setting(args):
    """``--moe-expert-offload host|ssd`` when on (megatron_moe/features.py)."""
    mode = getattr(args, "moe_expert_offload", "none")
    return None if mode in (None, "none") else f"--moe-expert-offload {mode}"


EXCLUDES = (
    Exclusion("--pipeline-model-parallel-size", "1F1B interleaves micro-batches, the 2D prefetch "
              "assumes forward then backward", needs_one=True),
    Exclusion("--use-distributed-optimizer", "its parameter buffer owns param.data, which "
              "offload moves"),
    Exclusion("--moe-grouped-gemm", "on Transformer Engine, TEGroupedMLP fuses gradient "
              "accumulation into the device main_grad; --transformer-impl local runs grouped experts",
              is_set=te_grouped_gemm),
    Exclusion("--moe-balance-policy", "replicas would need their own tiering"),
)


def run_hooks(args, model, optimizer=None, tracker=None):
    """The feature's part of the training step: the ExpertOffload manager (checkpoint_io around
    saves and loads, a log line per interval, close), None when --moe-expert-offload none."""
    return install(args, model, optimizer)


def install(args, model_chunks, optimizer=None):
    """The ExpertOffload manager for this run, or None when --moe-expert-offload is none."""
    if getattr(args, "moe_expert_offload", "none") in (None, "none"):
        return None
    from megatron_moe.offload.manager import ExpertOffload

    return ExpertOffload(args, model_chunks, optimizer)
