"""Pluggable all-to-all, compression and chunked comm/compute scheduling for MoE (issue 4).

Public API::

    all_to_all(input, output_split_sizes, input_split_sizes, group, algorithm="flat",
               ranks_per_node=None, compression="none") -> Tensor
    all_to_all_async(...same...) -> handle; handle.wait() -> Tensor (differentiable)
    all_gather_rows(t, group); isend(t, peer, group, tag); irecv(t, peer, group, tag)
    count_exchanges()  # Counter of (algorithm, compression) issued inside the block
    strict.enable() / strict.hot_path()  # device checks of every collective (tests), see strict.py
    link.configure(gbps) / link.stats()  # emulated expert-parallel link (--moe-ep-link-gbps), link.py
    register_algorithm(name, fn, supports_async=False); register_compression(name, obj)
    record_wire_bytes(intra, nbytes)  # byte accounting from inside a registered algorithm
    chunked_moe_exchange(tokens, input_splits, output_splits, expert_fn, group, degree,
                         order="schemoe", algorithm="flat", compression="none")
    wire_stats(algorithm, split_matrix, row_bytes, ranks_per_node); formula_wire_stats(...)
    add_arguments(parser)

See docs/comm.md.
"""

from megatron_moe.comm.alltoall import (all_to_all, all_to_all_async, available_algorithms,
                                        count_exchanges, count_wire_bytes, formula_wire_stats,
                                        get_algorithm, record_wire_bytes, register_algorithm,
                                        start_all_to_all, wire_stats)
from megatron_moe.comm import link, strict
from megatron_moe.comm.collectives import all_gather_rows, irecv, isend
from megatron_moe.comm.compress import (Compressor, available_compressions, get_compression,
                                        register_compression)
from megatron_moe.comm.schedule import chunked_moe_exchange

__all__ = ["all_to_all", "all_to_all_async", "count_exchanges", "all_gather_rows", "isend", "irecv",
           "register_algorithm", "available_algorithms", "get_algorithm",
           "start_all_to_all", "wire_stats", "record_wire_bytes", "formula_wire_stats", "count_wire_bytes",
           "Compressor", "register_compression", "get_compression", "available_compressions",
           "chunked_moe_exchange", "add_arguments", "validate_args"]


def add_arguments(parser):
    g = parser.add_argument_group("moe communication and topology")
    # no argparse choices: algorithms registered by the user's launch script are valid too
    g.add_argument("--moe-a2a-algorithm", default="flat",
                   help="Expert-parallel all-to-all: flat (all_to_all_single), hierarchical "
                        "(2D: intra-node then inter-node among same local rank), pipe (ScheMoE: "
                        "intra- and inter-node peers on two concurrent channels), or a name "
                        "registered with megatron_moe.comm.register_algorithm.")
    g.add_argument("--moe-a2a-compression", default="none",
                   help="Compression around the all-to-all, forward and backward: none, fp16, "
                        "bf16, int8 (per-row min/max), or a name registered with "
                        "megatron_moe.comm.register_compression. Lossy; see docs/comm.md.")
    g.add_argument("--moe-a2a-overlap-degree", type=int, default=1,
                   help="Chunks r for overlapping all-to-all with expert compute (1 = off). "
                        "With --moe-a2a-schedule fastermoe: the number of rank groups.")
    g.add_argument("--moe-a2a-schedule", default="schemoe", choices=["schemoe", "fastermoe"],
                   help="Chunk order: schemoe (OptSche) or fastermoe (group-wise ring exchange).")
    g.add_argument("--ranks-per-node", type=int, default=None,
                   help="Ranks per node (default: topology file, else LOCAL_WORLD_SIZE). "
                        "Smaller values emulate several nodes on one machine.")
    g.add_argument("--moe-ep-link-gbps", type=float, default=None,
                   help="Emulate an expert-parallel network link of this bandwidth (GB/s) for the MoE "
                        "data path (all-to-all, Trans/Agg, replica moves): each rank's transfers queue "
                        "on one link and wait, without using CPU, for bytes/bandwidth. For measuring "
                        "communication hiding on CPU machines (refused on a GPU); see docs/comm.md "
                        "(default: off).")
    g.add_argument("--topology-file", default=None,
                   help="JSON: ranks_per_node, intra/inter_bandwidth_gbps, intra/inter_latency_us.")
    g.add_argument("--moe-router-topology", default="none",
                   choices=["none", "node_limited", "congestion", "ta_loss"],
                   help="Topology-aware routing (changes the model): node_limited (experts of a "
                        "token on at most --moe-router-max-nodes nodes), congestion (FasterMoE cap "
                        "on tokens leaving the node), ta_loss (link-cost weighted aux loss).")
    g.add_argument("--moe-router-max-nodes", type=int, default=1,
                   help="node_limited: nodes a token's experts may span (M).")
    g.add_argument("--moe-topology-loss-coeff", type=float, default=1e-2,
                   help="ta_loss: coefficient of the topology-aware auxiliary loss.")
    return parser


def validate_args(args):
    """Checks that need no process group; raise ValueError naming the flag."""
    if getattr(args, "moe_a2a_overlap_degree", 1) < 1:
        raise ValueError(f"--moe-a2a-overlap-degree={args.moe_a2a_overlap_degree} must be >= 1")
    get_algorithm(getattr(args, "moe_a2a_algorithm", "flat"))
    get_compression(getattr(args, "moe_a2a_compression", "none"))
    gbps = getattr(args, "moe_ep_link_gbps", None)
    if gbps is not None and not gbps > 0:
        raise ValueError(f"--moe-ep-link-gbps={gbps} must be > 0")
    if gbps is not None:
        import torch

        if torch.cuda.is_available():
            # the link thread would issue NCCL sends off the compute stream's thread: untested
            raise ValueError("--moe-ep-link-gbps emulates a network on CPU (gloo) runs; on a GPU "
                             "the transfers are real: drop the flag")
    rpn = getattr(args, "ranks_per_node", None)
    if rpn is not None and rpn < 1:
        raise ValueError(f"--ranks-per-node={rpn} must be >= 1")
    world = getattr(args, "world_size", None)
    if rpn is not None and world and world % rpn:
        raise ValueError(f"--ranks-per-node={rpn} must divide the world size {world}")
    if getattr(args, "moe_router_max_nodes", 1) < 1:
        raise ValueError(f"--moe-router-max-nodes={args.moe_router_max_nodes} must be >= 1")
    _validate_router_topology(args)
    if getattr(args, "topology_file", None):
        from megatron_moe.runtime.topology import load_topology_file
        load_topology_file(args.topology_file)


def _validate_router_topology(args):
    """The --moe-router-topology checks that need only the flags, so they fail at parse time; the
    ones that need the node layout (max nodes, experts per node) run when the router is built."""
    mode = getattr(args, "moe_router_topology", "none")
    if mode == "none":
        return
    if not getattr(args, "num_experts", None):
        raise ValueError(f"--moe-router-topology {mode} needs an MoE model: set --num-experts")
    if mode == "congestion" and getattr(args, "moe_enable_routing_replay", False):
        raise ValueError("--moe-router-topology congestion cannot be combined with "
                         "--moe-enable-routing-replay (it selects the experts through the same "
                         "hook)")
    from megatron_moe.runtime.topology import check_topology_flags
    check_topology_flags(mode, num_groups=getattr(args, "moe_router_num_groups", None),
                         group_topk=getattr(args, "moe_router_group_topk", None),
                         fusion=getattr(args, "moe_router_fusion", False),
                         loss_coeff=getattr(args, "moe_topology_loss_coeff", 0.0))
