"""Cluster model: nodes x devices per node, intra/inter-node bandwidth and latency.

Ranks are numbered node-major (``node = rank // ranks_per_node``), as torchrun and Slurm do.
``ranks_per_node`` comes from, in order: an explicit override (``--ranks-per-node``, so that one
CPU machine can emulate several nodes), a JSON topology file (``--topology-file``), the launcher's
``LOCAL_WORLD_SIZE``, else 1 node.

Topology file (JSON, every key optional except where noted)::

    {"ranks_per_node": 8,
     "intra_bandwidth_gbps": 300.0,   # GB/s per direction between two ranks of one node
     "inter_bandwidth_gbps": 25.0,    # GB/s per direction between ranks on different nodes
     "intra_latency_us": 5.0, "inter_latency_us": 10.0}

The process groups a 2D (hierarchical) all-to-all needs are made by :func:`hierarchy_groups`.
``torch.distributed.new_group`` must be entered by every rank of the world in the same order;
two ways are offered:

* :func:`init_hierarchy_groups` (recommended, at setup): a collective over the *world*; every
  rank passes its own parent group (e.g. its EP group), the parents are all-gathered and every
  rank creates every group in one deterministic order.
* lazily on first use (inside the dispatcher): only the members of the parent group enter, with
  ``use_local_synchronization=True`` so ranks outside need not call. This is safe when every rank
  builds its hierarchy at the same point of the program (the MoE dispatcher does: every rank runs
  the same layers), which is what the hashed group names of torch require.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Dict, Optional, Tuple

__all__ = ["Topology", "configure", "current", "load_topology_file", "hierarchy_groups",
           "ranks_per_node_in",
           "init_hierarchy_groups", "HierarchyGroups", "reset", "check_topology_flags"]


@dataclasses.dataclass(frozen=True)
class Topology:
    ranks_per_node: int = 1
    intra_bandwidth_gbps: float = 150.0   # NVLink-class, per direction (placeholder, see file)
    inter_bandwidth_gbps: float = 25.0    # 200 Gb/s NIC per rank
    intra_latency_us: float = 5.0
    inter_latency_us: float = 10.0
    source: str = "default"

    def __post_init__(self):
        if int(self.ranks_per_node) < 1:
            raise ValueError(f"topology ({self.source}): ranks_per_node={self.ranks_per_node} "
                             "must be >= 1")
        for f in ("intra_bandwidth_gbps", "inter_bandwidth_gbps"):
            if not getattr(self, f) > 0:
                raise ValueError(f"topology ({self.source}): {f}={getattr(self, f)} must be > 0")
        for f in ("intra_latency_us", "inter_latency_us"):
            if getattr(self, f) < 0:
                raise ValueError(f"topology ({self.source}): {f}={getattr(self, f)} must be >= 0")

    def node_of(self, rank: int) -> int:
        return int(rank) // self.ranks_per_node

    def local_rank_of(self, rank: int) -> int:
        return int(rank) % self.ranks_per_node

    def num_nodes(self, world_size: int) -> int:
        check_divisible(world_size, self.ranks_per_node)
        return world_size // self.ranks_per_node

    def same_node(self, a: int, b: int) -> bool:
        return self.node_of(a) == self.node_of(b)

    def link_cost(self, a: int, b: int) -> float:
        """Seconds per byte between two ranks (0 for a rank to itself)."""
        if a == b:
            return 0.0
        bw = self.intra_bandwidth_gbps if self.same_node(a, b) else self.inter_bandwidth_gbps
        return 1.0 / (bw * 1e9)

    @property
    def bandwidth_ratio(self) -> float:
        """inter / intra bandwidth (FasterMoE's W_net / W_local)."""
        return self.inter_bandwidth_gbps / self.intra_bandwidth_gbps


def check_divisible(world_size: int, ranks_per_node: int, what: str = "group size"):
    if ranks_per_node < 1 or world_size % ranks_per_node:
        raise ValueError(f"--ranks-per-node={ranks_per_node} must divide the {what} "
                         f"{world_size} (ranks are numbered node-major)")


def ranks_per_node_in(group=None, topo: Optional[Topology] = None) -> int:
    """Members of ``group`` per node under ``topo`` (default: the process-wide topology).

    The group must be node-major (its members on one node are consecutive in group order) and
    have the same number of members on every node it spans, which megatron-core's EP/TP/DP groups
    are for node-major rank numbering.
    """
    return members_per_node(_parent_ranks(group), topo or current())


def members_per_node(ranks, topo: Topology) -> int:
    """Pure part of :func:`ranks_per_node_in`: ``ranks`` are global ranks in group order."""
    nodes = [topo.node_of(r) for r in ranks]
    runs = [1]
    for a, b in zip(nodes, nodes[1:]):
        if a == b:
            runs[-1] += 1
        else:
            runs.append(1)
    if len(runs) != len(set(nodes)) or len(set(runs)) != 1:
        raise ValueError(f"process group {list(ranks)} is not node-major with equal members per "
                         f"node under ranks_per_node={topo.ranks_per_node} ({topo.source}); "
                         "hierarchical/pipe all-to-all need that layout")
    return runs[0]


_FILE_KEYS = {f.name for f in dataclasses.fields(Topology)} - {"source"}


def load_topology_file(path: str) -> Topology:
    try:
        with open(path) as f:
            raw = json.load(f)
    except OSError as e:
        raise ValueError(f"--topology-file {path}: cannot read: {e}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"--topology-file {path}: line {e.lineno}: invalid JSON: {e.msg}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"--topology-file {path}: expected a JSON object")
    unknown = set(raw) - _FILE_KEYS
    if unknown:
        raise ValueError(f"--topology-file {path}: unknown keys {sorted(unknown)}; "
                         f"known: {sorted(_FILE_KEYS)}")
    kw = {}
    for k, v in raw.items():
        if not isinstance(v, (int, float)) or isinstance(v, bool):
            raise ValueError(f"--topology-file {path}: {k}={v!r} must be a number")
        kw[k] = int(v) if k == "ranks_per_node" else float(v)
    return Topology(source=path, **kw)


_CURRENT: Optional[Topology] = None


def configure(ranks_per_node: Optional[int] = None, topology_file: Optional[str] = None,
              args=None) -> Topology:
    """Set the process-wide topology (from ``--ranks-per-node`` / ``--topology-file``)."""
    global _CURRENT
    if args is not None:
        ranks_per_node = ranks_per_node or getattr(args, "ranks_per_node", None)
        topology_file = topology_file or getattr(args, "topology_file", None)
    topo = load_topology_file(topology_file) if topology_file else None
    if topo is None:
        env = os.environ.get("LOCAL_WORLD_SIZE")
        rpn = int(env) if env and env.isdigit() and int(env) > 0 else 1
        topo = Topology(ranks_per_node=rpn, source="LOCAL_WORLD_SIZE" if env else "default")
    if ranks_per_node is not None:
        if int(ranks_per_node) < 1:
            raise ValueError(f"--ranks-per-node={ranks_per_node} must be >= 1")
        topo = dataclasses.replace(topo, ranks_per_node=int(ranks_per_node),
                                   source=topo.source + "+--ranks-per-node")
    _CURRENT = topo
    return topo


def current() -> Topology:
    return _CURRENT if _CURRENT is not None else configure()


def reset():
    global _CURRENT
    _CURRENT = None
    _GROUPS.clear()


# ---------------------------------------------------------------------------------------------
# process groups


@dataclasses.dataclass
class HierarchyGroups:
    """Groups of one parent group (ranks numbered node-major *within the parent*)."""
    parent_ranks: Tuple[int, ...]     # global ranks of the parent, in parent-rank order
    ranks_per_node: int
    intra: object                     # my node's ranks (same node, all local ranks)
    inter: object                     # same local rank on every node
    channel2: object                  # a second communicator over the parent ranks (pipe A2A)

    @property
    def nodes(self) -> int:
        return len(self.parent_ranks) // self.ranks_per_node


_GROUPS: Dict[Tuple[Tuple[int, ...], int], HierarchyGroups] = {}


def _layout(parent: Tuple[int, ...], rpn: int):
    check_divisible(len(parent), rpn)
    n = len(parent) // rpn
    intra = [list(parent[i * rpn:(i + 1) * rpn]) for i in range(n)]
    inter = [[parent[i * rpn + g] for i in range(n)] for g in range(rpn)]
    return intra, inter


def _parent_ranks(group) -> Tuple[int, ...]:
    import torch.distributed as dist

    if group is None or group is dist.group.WORLD:
        return tuple(range(dist.get_world_size()))
    return tuple(dist.get_process_group_ranks(group))


def init_hierarchy_groups(group=None, ranks_per_node: Optional[int] = None):
    """Collective over the WORLD: build the hierarchy groups of every rank's parent ``group``.

    Every rank of the world must call it (with its own parent group, e.g. its EP group), after
    which :func:`hierarchy_groups` on any of those parents is a cache hit.
    """
    import torch.distributed as dist

    rpn = int(ranks_per_node or ranks_per_node_in(group))
    mine = _parent_ranks(group)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (mine, rpn))
    my_rank = dist.get_rank()
    for parent, prpn in sorted(set(gathered)):
        if (parent, prpn) in _GROUPS and my_rank in parent:
            continue
        intra, inter = _layout(parent, prpn)
        made = {}
        # every rank enters every new_group, in this same order (torch requirement)
        for kind, lists in (("intra", intra), ("inter", inter)):
            for ranks in lists:
                pg = dist.new_group(ranks)
                if my_rank in ranks:
                    made[kind] = pg
        ch2 = dist.new_group(list(parent))
        if my_rank in parent:
            _GROUPS[(parent, prpn)] = HierarchyGroups(parent, prpn, made["intra"], made["inter"],
                                                      ch2)
    return hierarchy_groups(group, rpn)


def hierarchy_groups(group=None, ranks_per_node: Optional[int] = None) -> HierarchyGroups:
    """The cached intra/inter/channel-2 groups of ``group`` (created on first use, see module doc)."""
    import torch.distributed as dist

    rpn = int(ranks_per_node or ranks_per_node_in(group))
    parent = _parent_ranks(group)
    key = (parent, rpn)
    if key in _GROUPS:
        return _GROUPS[key]
    intra, inter = _layout(parent, rpn)
    me = dist.get_rank()
    pos = parent.index(me)
    # only members enter; local synchronization so ranks outside the parent need not call
    kw = {} if len(parent) == dist.get_world_size() else {"use_local_synchronization": True}
    if kw:
        pg_intra = dist.new_group(intra[pos // rpn], **kw)
        pg_inter = dist.new_group(inter[pos % rpn], **kw)
    else:  # whole world: the ordinary path, every rank enters every group in the same order
        pg_intra = pg_inter = None
        for ranks in intra:
            pg = dist.new_group(ranks)
            pg_intra = pg if me in ranks else pg_intra
        for ranks in inter:
            pg = dist.new_group(ranks)
            pg_inter = pg if me in ranks else pg_inter
    ch2 = dist.new_group(list(parent), **kw)
    hg = HierarchyGroups(parent, rpn, pg_intra, pg_inter, ch2)
    _GROUPS[key] = hg
    return hg


def check_topology_flags(mode: str, *, num_groups=None, group_topk=None, fusion: bool = False,
                         loss_coeff: float = 0.0) -> None:
    """The --moe-router-topology checks that need only flag values (no node layout): run at parse
    time by ``comm.validate_args`` and again by the routers (moe/topo_router.py), which can be built
    directly. Here, below both, so that comm/ never imports moe/."""
    if mode == "node_limited" and (group_topk or num_groups):
        raise ValueError("--moe-router-topology node_limited sets the expert groups itself "
                         "(groups = nodes, --moe-router-max-nodes per token); drop "
                         "--moe-router-num-groups / --moe-router-group-topk")
    if mode == "congestion" and fusion:
        raise ValueError("--moe-router-topology congestion needs the unfused router: drop "
                         "--moe-router-fusion")
    if mode == "ta_loss" and loss_coeff < 0:
        raise ValueError(f"--moe-topology-loss-coeff={loss_coeff} must be >= 0")
