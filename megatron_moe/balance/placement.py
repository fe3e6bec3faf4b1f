"""Execution of a placement inside one MoE layer: transient or persistent replicas, Trans and Agg.

``LayerBalance`` is a plain object (never an ``nn.Module``), so the replicas it holds are invisible
to ``model.parameters()``, the optimizer, DDP buffers, the grad norm and ``state_dict``.

* Trans: the owner sends expert e's flattened parameters to every rank of S_e \\ {owner}
  (point-to-point ``isend``/``irecv`` over the EP group, so any subset works without building
  communicators), one message per (owner, replica rank) pair and piece carrying all of that pair's
  experts in one flat buffer. A replica is a set of leaf tensors viewing the received flat buffer.
  Trans may be issued in pieces (a list of experts each, the scheduler's two-part split); every rank
  issues the same pieces in the same order, and ``wait_trans`` waits every piece before the replicas
  are used.
* Agg: every replica rank sends its flattened replica grads to the owner (one message per pair, the
  Trans batches in reverse), which sums them and adds the sum into the owner parameters'
  ``main_grad`` (megatron DDP) or ``grad``.
* Byte counters check the note's accounting: Trans moves sum_e (|S_e|-1) * size(params) out of the
  owners, Agg the same into them.

Persistent replicas (FlexMoE vExperts, ``mode == "persistent"``, set by ``BalanceManager.set_optimizer``):

* a replica rank keeps the replica's weights (``_Replica.flat``) and its own optimizer state (a torch
  optimizer of the megatron-core inner optimizer's class, one param group per tensor mirroring the
  owner-equivalent local param group) across iterations; nothing is sent while its replica set
  is unchanged;
* ``held[e]`` = ranks holding a valid replica of e (identical on every rank: it only follows the
  placement sequence). At the first forward after a placement change the owner sends params + the
  optimizer state to every new member (Expand / the target of a Migrate); members that left drop
  their copy (Shrink / the source of a Migrate), with no communication. The source is always the
  owner: it holds the master copy that megatron-core steps;
* gradients: Agg (replicas -> owner, summed into the owner's ``main_grad``) before grad finalisation,
  then ``issue_sumback`` after it sends the owner's finalised gradient (DP-reduced and scaled by
  megatron-core exactly as the owner's) back to every replica: every member holds the same sum;
* ``step_replicas`` after ``optimizer.step()``: megatron-core's own ``clip_grad_by_total_norm_fp32``
  with the step's global grad norm and the owner's ``clip_grad``, then the replica optimizer's
  ``step()`` with the live hyperparameters (lr, wd, betas, eps) of the owner-equivalent group: the
  replica stays bit-identical to the owner without a per-iteration parameter transfer. The group is
  looked up at every step (a checkpoint load replaces megatron-core's group dicts).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Dict, List, Optional, Set, Tuple

import numpy as np
import torch
import torch.distributed as dist

from megatron_moe import comm
from megatron_moe.balance.policies.base import Placement

__all__ = ["LayerBalance"]

# message kinds in the point-to-point tag (one sender/receiver pair may exchange several per iteration)
_TRANS, _AGG, _MOVE, _SUMBACK, _STATE = 0, 1, 2, 3, 4     # _STATE + i: the i-th state dtype buffer
_KINDS = 8


@dataclasses.dataclass
class _Replica:
    """A persistent replica of one expert on this rank."""
    flat: torch.Tensor                  # the parameters, flattened (the leaves view it)
    leaves: List[torch.Tensor]          # names order, requires_grad leaves
    opt: torch.optim.Optimizer          # replica optimizer: one group per leaf
    stepped: int = 0                    # optimizer steps applied to this copy


def _grad_target(p: torch.Tensor) -> torch.Tensor:
    """Where an owner's gradient lives: megatron DDP's main_grad, else .grad (created if missing)."""
    if getattr(p, "main_grad", None) is not None:
        return p.main_grad
    if p.grad is None:
        p.grad = torch.zeros_like(p)
    return p.grad


class LayerBalance:
    def __init__(self, experts, layer_number: Optional[int], num_experts: int, ep_group, log=None):
        self.experts = experts                       # megatron-core SequentialMLP
        self.layer_number = layer_number
        self.num_experts = num_experts
        self.ep_group = ep_group
        self.D = dist.get_world_size(ep_group) if ep_group is not None else 1
        self.rank = dist.get_rank(ep_group) if ep_group is not None else 0
        self.num_local = num_experts // self.D
        self.template = experts.local_experts[0]
        named = list(zip(*self._expert_parameters(0)))
        self.names = [n for n, _ in named]
        self.shapes = [p.shape for _, p in named]
        self.numels = [p.numel() for _, p in named]
        self.numel = sum(self.numels)
        self.placement = Placement.plain(num_experts, self.D)
        self.scheduler = None
        self.plan = None   # the current forward's dispatch plan (balance/layer.py, preprocess -> postprocess)
        self.log = log
        self.counts = torch.zeros(self.D, num_experts, dtype=torch.float64)   # summed over micro-batches
        self.bytes_trans_sent = 0
        self.bytes_trans_recv = 0
        self.bytes_agg_sent = 0
        self.bytes_agg_recv = 0
        self.a2a_rows_recv = 0
        self.a2a_rows_recv_replica = 0               # rows received for experts this rank does not own
        self.a2a_skipped = 0                         # forwards whose dispatch/combine no pair crossed
        # persistent replicas (module doc); mode and optim_lookup are set by BalanceManager.set_optimizer
        self.mode = "transient"
        self.optim_lookup: Optional[Callable] = None  # param -> (torch optimizer, live group, clip_grad)
        self.persist: Dict[int, _Replica] = {}       # expert -> this rank's persistent replica
        self.held: Dict[int, Set[int]] = {}          # expert -> ranks holding a valid replica (all ranks)
        self.bytes_move_sent = 0                     # params + optimizer state for new replicas
        self.moves_from_replica = 0                  # of those, sent from a replica (cheapest link)
        self._rpn: Optional[int] = None              # EP-group members per node (topology)
        self.bytes_move_recv = 0
        self.msgs_move_sent = 0
        self.msgs_trans_sent = 0
        self.msgs_agg_sent = 0
        self.bytes_sumback_sent = 0
        self.bytes_sumback_recv = 0
        self.msgs_sumback_sent = 0
        self.replicas_added = 0                      # replica copies created on this rank (all time)
        self.replicas_dropped = 0
        self.replica_steps = 0                       # replica optimizer steps applied on this rank
        self._reset()

    # -- iteration state ------------------------------------------------------------------------
    def _reset(self):
        self.trans_issued = False          # some Trans piece of this iteration was issued
        self.trans_done = False
        self._trans_sent: set = set()        # experts whose Trans is issued
        self._trans_pieces: List = []        # (part, experts, work handles) in issue order
        self.train_forwards = 0              # training-mode forwards this iteration (micro-batches)
        self.plan_ahead = None               # (iteration, counts, Placement) planned under the a2a
        self.agg_issued = False
        self.agg_done = False
        self.forward_count = 0
        self.backward_count = 0
        self._grad_ready = 0
        self._trans_bufs: Dict[int, torch.Tensor] = {}
        self._trans_flat: Dict[Tuple[int, ...], torch.Tensor] = {}   # owner's send buffers until waited
        self._trans_keep: List[torch.Tensor] = []
        self._agg_work: List = []
        self._agg_bufs: Dict[int, List[Tuple[List[int], torch.Tensor]]] = {}   # source -> (experts, buf)
        self._agg_keep: List[torch.Tensor] = []
        self.replicas: Dict[int, List[torch.Tensor]] = {}    # expert -> leaf tensors (names order)
        self._hooks: List = []
        self._active_placement = self.placement
        self._move_recv: Dict[int, Tuple[torch.Tensor, List[torch.Tensor], list]] = {}
        self._dropped_checked = False
        self.sumback_issued = False
        self._sumback_work: List = []
        self._sumback_keep: List[torch.Tensor] = []
        self._sumback_bufs: Dict[int, torch.Tensor] = {}
        self.replicas_stepped = False

    def end_iteration(self):
        for h in self._hooks:
            h.remove()
        if self._trans_pieces and not self.trans_done:
            self.wait_trans(None)
        self._reset()

    def _log(self, op, iteration, **kw):
        if self.log is not None:
            self.log.record(op, self.layer_number, iteration, **kw)

    def owner(self, e: int) -> int:
        return e // self.num_local

    def _global(self, r: int) -> int:
        return dist.get_global_rank(self.ep_group, r)

    def _tag(self, e: int, kind: int) -> int:
        return ((self.layer_number or 0) * self.num_experts + e) * _KINDS + kind

    def owner_params(self, e: int) -> List[torch.Tensor]:
        return self._expert_parameters(e - self.rank * self.num_local)[1]

    def _expert_parameters(self, i: int):
        """(names, tensors) of local expert ``i``: its MLP's parameters, or with the grouped
        experts' single grouped weight the slices that stand for them (moe/grouped_experts.py)."""
        if hasattr(self.experts, "expert_parameters"):
            return self.experts.expert_parameter_names(), self.experts.expert_parameters(i)
        named = list(self.experts.local_experts[i].named_parameters())
        return [n for n, _ in named], [p for _, p in named]

    def my_replica_experts(self) -> List[int]:
        return [e for e, s in enumerate(self._active_placement.replica_sets)
                if len(s) > 1 and self.rank in s and self.owner(e) != self.rank]

    def begin_forward(self, iteration, training: bool = True):
        self._freeze_placement()
        self.forward_count += 1
        if training:
            self.train_forwards += 1

    def _freeze_placement(self):
        if self.forward_count == 0:
            self._active_placement = self.placement     # fixed for the whole iteration

    # -- Trans ----------------------------------------------------------------------------------
    def trans_experts(self) -> List[int]:
        """Experts replicated in this iteration's placement (identical on every rank), by id."""
        self._freeze_placement()
        return self._active_placement.replicated()

    def trans_pending(self) -> List[int]:
        return [e for e in self.trans_experts() if e not in self._trans_sent]

    def issue_trans(self, iteration, experts: Optional[List[int]] = None, part: str = "all"):
        """Issue the Trans of ``experts`` (default: every replicated expert not issued yet)."""
        todo = [e for e in (self.trans_pending() if experts is None else experts) if e not in self._trans_sent]
        self.trans_issued = True
        self._log("trans_issue", iteration, part=part, experts=list(todo))
        self._trans_sent.update(todo)
        if self.mode == "persistent":
            self._trans_pieces.append((part, todo, self._issue_moves(todo)))
            return
        works = []
        # one message per (owner, replica rank) pair and piece: the piece's experts of that owner that
        # the replica rank computes, flattened in expert order into one buffer (every rank derives the
        # same lists from the placement; the tag of the first expert is unique since pieces are disjoint)
        for src, dst, experts in self._pair_batches(todo):
            if src == self.rank:
                key = tuple(experts)
                flat = self._trans_flat.get(key)
                if flat is None:       # one flattened copy per expert list, reused for every receiver
                    flat = torch.cat([p.detach().reshape(-1) for e in experts for p in self.owner_params(e)])
                    self._trans_flat[key] = flat
                works.append(comm.isend(flat, dst, self.ep_group, tag=self._tag(experts[0], _TRANS)))
                self.bytes_trans_sent += flat.numel() * flat.element_size()
                self.msgs_trans_sent += 1
            elif dst == self.rank:
                p0 = self._ref_params()[0]
                buf = torch.empty(self.numel * len(experts), dtype=p0.dtype, device=p0.device)
                for i, e in enumerate(experts):
                    self._trans_bufs[e] = buf[i * self.numel:(i + 1) * self.numel]
                works.append(comm.irecv(buf, src, self.ep_group, tag=self._tag(experts[0], _TRANS)))
                self.bytes_trans_recv += buf.numel() * buf.element_size()
        self._trans_pieces.append((part, todo, works))

    def _pair_batches(self, experts) -> List[Tuple[int, int, List[int]]]:
        """One message each: (owner, replica rank, the given replicated experts of that owner the
        replica rank computes, in expert order); the same list on every rank (it reads only the
        placement)."""
        out: Dict[Tuple[int, int], List[int]] = {}
        for e in experts:
            o = self.owner(e)
            for d in self._active_placement.replica_sets[e]:
                if d != o:
                    out.setdefault((o, d), []).append(e)
        return [(o, d, ex) for (o, d), ex in out.items()]

    def wait_trans(self, iteration):
        if not self.trans_issued or (self.trans_pending() and not self.trans_done):
            self.issue_trans(iteration, part="rest" if self.trans_issued else "all")
        if self.trans_done:
            return
        for part, experts, works in self._trans_pieces:    # every piece, in issue order
            for w in works:
                w.wait()
            self._log("trans_wait", iteration, part=part, experts=list(experts))
        self._trans_pieces = []
        self._trans_keep = []
        self._trans_flat = {}
        self.trans_done = True
        if self.mode == "persistent":
            self._finish_moves()
            return
        for e, buf in self._trans_bufs.items():
            leaves, off = [], 0
            for shape, k in zip(self.shapes, self.numels):
                t = buf[off:off + k].view(shape)       # a leaf: buf does not require grad
                t.requires_grad_(True)
                leaves.append(t)
                off += k
            self.replicas[e] = leaves
            for t in leaves:
                self._hooks.append(t.register_post_accumulate_grad_hook(self._on_grad))
        self._trans_bufs = {}

    def replica_params(self, e: int) -> Dict[str, torch.Tensor]:
        return dict(zip(self.names, self.replicas[e]))

    def _on_grad(self, _t):
        self._grad_ready += 1
        n = sum(len(v) for v in self.replicas.values())
        if n and self._grad_ready % n == 0:
            self.backward_count += 1
            if self.scheduler is not None:
                self.scheduler.on_replica_grads_ready(self)

    # -- Agg ------------------------------------------------------------------------------------
    def issue_agg(self, iteration):
        self.agg_issued = True
        if not self.trans_issued:          # layer never ran forward this iteration (eval, other stage)
            return
        self.wait_trans(iteration)
        self._log("agg_issue", iteration)
        # one message per (replica rank, owner) pair: the replica grads of that owner's experts,
        # flattened in expert order (the Trans batches in reverse)
        for o, d, experts in self._pair_batches(self._active_placement.replicated()):
            if o == self.rank:
                p0 = self._ref_params()[0]            # on the data's device (NCCL)
                buf = torch.empty(self.numel * len(experts), dtype=p0.dtype, device=p0.device)
                self._agg_bufs.setdefault(d, []).append((experts, buf))
                self._agg_work.append(comm.irecv(buf, d, self.ep_group, tag=self._tag(experts[0], _AGG)))
                self.bytes_agg_recv += buf.numel() * buf.element_size()
            elif d == self.rank:
                flat = torch.cat([(t.grad if t.grad is not None else torch.zeros_like(t)).reshape(-1)
                                  for e in experts for t in self.replicas[e]])
                self._agg_keep.append(flat)
                self._agg_work.append(comm.isend(flat, o, self.ep_group, tag=self._tag(experts[0], _AGG)))
                self.bytes_agg_sent += flat.numel() * flat.element_size()
                self.msgs_agg_sent += 1

    def wait_agg(self, iteration):
        if self.agg_done or not self.agg_issued:
            return
        for w in self._agg_work:
            w.wait()
        self._agg_work = []
        self._agg_keep = []
        parts: Dict[int, List[torch.Tensor]] = {}     # expert -> its replica grads, by source rank
        for d in sorted(self._agg_bufs):
            for experts, buf in self._agg_bufs[d]:
                for i, e in enumerate(experts):
                    parts.setdefault(e, []).append(buf[i * self.numel:(i + 1) * self.numel])
        for e in sorted(parts):
            bufs = parts[e]
            total = bufs[0]
            if len(bufs) > 1:                  # summed in source-rank order, then into the owner
                total = total.clone()
                for b in bufs[1:]:
                    total += b
            off = 0
            for p, k in zip(self.owner_params(e), self.numels):
                g = _grad_target(p)
                g.add_(total[off:off + k].view_as(g).to(g.dtype))
                off += k
        self._agg_bufs = {}
        self.agg_done = True
        if self.trans_issued:
            self._log("agg_wait", iteration)

    # -- persistent replicas (module doc) -------------------------------------------------------
    def _ref_params(self) -> List[torch.Tensor]:
        """This rank's owner-equivalent params (local expert 0, names order): same layer, same names,
        so the same megatron-core param group (lr, wd, betas, eps) and optimizer-state layout."""
        return self._expert_parameters(0)[1]

    def _state_layout(self) -> List[Tuple[int, str, tuple, torch.dtype]]:
        """(param index, key, shape, dtype) of the optimizer state a replica needs. Read from the local
        reference params: every rank steps in lockstep, so owner and receiver derive the same layout
        (empty before the first step: the replica optimizer then initialises lazily, as the owner's)."""
        out = []
        for i, st in enumerate(self._opt_states(self._ref_params())):
            for k in sorted(st):
                v = st[k]
                if not torch.is_tensor(v):
                    raise ValueError(f"persistent replicas: optimizer state {k!r} is not a tensor ({type(v)})")
                out.append((i, k, tuple(v.shape), v.dtype))
        return out

    @staticmethod
    def _dtype_groups(layout) -> List[Tuple[torch.dtype, List]]:
        dtypes = sorted({d for *_, d in layout}, key=str)
        return [(d, [x for x in layout if x[3] == d]) for d in dtypes]

    def _opt_states(self, params: List[torch.Tensor], opt=None) -> List[dict]:
        """Per param, its optimizer state: from ``opt`` (a replica's own optimizer) or, for owner
        params, megatron-core's (empty before ``set_optimizer``)."""
        if opt is None and self.optim_lookup is None:
            return [{} for _ in params]
        return [(opt if opt is not None else self.optim_lookup(p)[0]).state.get(p, {}) for p in params]

    def _flat_state(self, states: List[dict], layout) -> List[torch.Tensor]:
        """One flat buffer per state dtype, in layout order, of ``states`` (``_opt_states``)."""
        out, dev = [], self._ref_params()[0].device
        for _, entries in self._dtype_groups(layout):
            parts = []
            for i, k, shape, _ in entries:
                st = states[i]
                if sorted(st) != sorted(kk for ii, kk, *_ in layout if ii == i):
                    raise RuntimeError(f"persistent replicas: layer {self.layer_number} state keys "
                                       f"{sorted(st)} differ from the reference layout")
                # on the data's device: torch keeps Adam's step on the host (NCCL needs device tensors)
                parts.append(st[k].detach().reshape(-1).to(dev))
            out.append(torch.cat(parts))
        return out

    def _drop(self, e: int, ranks) -> None:
        if self.rank in ranks and self.persist.pop(e, None) is not None:
            self.replicas_dropped += 1

    def invalidate_replicas(self) -> None:
        """Forget every persistent replica (all ranks call it together): rebuilt from the owners at
        the next forward (resume, a missed replica update)."""
        for e in list(self.persist):
            self._drop(e, {self.rank})
        self.held = {}

    def _issue_moves(self, todo: List[int]) -> List:
        """Persistent Trans: only members that joined e's replica set since the last forward get a copy
        (params + optimizer state, from the owner); members that left drop theirs."""
        act = self._active_placement
        if not self._dropped_checked:
            self._dropped_checked = True
            for e in sorted(self.held):
                if len(act.replica_sets[e]) <= 1:             # no longer replicated anywhere
                    self._drop(e, self.held.pop(e))
        works, layout = [], None
        for e in todo:
            o = self.owner(e)
            members = set(act.replica_sets[e]) - {o}
            old = self.held.get(e, set())
            self._drop(e, old - members)
            new = sorted(members - old)
            holders = {o} | (old & members)              # copies that stay valid this iteration
            self.held[e] = members
            if self.rank in members and self.rank not in new and e not in self.persist:
                raise RuntimeError(f"persistent replicas: layer {self.layer_number} expert {e} is held "
                                   f"by rank {self.rank} per the placement history but has no copy")
            if not new:
                continue
            src = {dst: self._move_source(o, dst, holders) for dst in new}
            if self.rank not in new and self.rank not in src.values():
                continue
            layout = self._state_layout() if layout is None else layout
            to_send = [dst for dst in new if src[dst] == self.rank]
            if to_send:
                if self.rank == o:
                    bufs = [torch.cat([p.detach().reshape(-1) for p in self.owner_params(e)])]
                    bufs += self._flat_state(self._opt_states(self.owner_params(e)), layout)
                else:                                     # an existing replica, bit-equal to the owner's
                    rep = self.persist[e]
                    bufs = [rep.flat.detach().clone()] + self._flat_state(
                        self._opt_states(rep.leaves, rep.opt), layout)
                    self.moves_from_replica += len(to_send)
                self._trans_keep.extend(bufs)
                for dst in to_send:
                    for j, b in enumerate(bufs):
                        works.append(comm.isend(b, dst, self.ep_group,
                                                tag=self._tag(e, _MOVE if j == 0 else _STATE + j - 1)))
                        self.bytes_move_sent += b.numel() * b.element_size()
                        self.msgs_move_sent += 1
            if self.rank in new:
                p0 = self._ref_params()[0]
                buf = torch.empty(self.numel, dtype=p0.dtype, device=p0.device)
                sbufs = [torch.empty(sum(int(np.prod(s, dtype=np.int64)) for _, _, s, _ in ent), dtype=d,
                                     device=p0.device) for d, ent in self._dtype_groups(layout)]
                for j, b in enumerate([buf] + sbufs):
                    works.append(comm.irecv(b, src[self.rank], self.ep_group,
                                            tag=self._tag(e, _MOVE if j == 0 else _STATE + j - 1)))
                    self.bytes_move_recv += b.numel() * b.element_size()
                self._move_recv[e] = (buf, sbufs, layout)
        return works

    def _move_source(self, owner: int, dst: int, holders: Set[int]) -> int:
        """Where a new member copies expert state from. Every holder's copy is bit-identical to the
        owner's (params and optimizer state; tests/test_flexmoe_persistent.py), so, as FlexMoE does,
        take the cheapest link: a holder on dst's node, the owner among them first, then the lowest
        rank; with none on dst's node, the owner. Same answer on every rank (no communication)."""
        from megatron_moe.runtime import topology

        if self._rpn is None:
            self._rpn = topology.ranks_per_node_in(self.ep_group) if self.ep_group is not None else 1
        near = sorted(h for h in holders if h // self._rpn == dst // self._rpn)
        if not near or owner in near:
            return owner
        return near[0]

    def _new_replica(self, buf: torch.Tensor, sbufs: List[torch.Tensor], layout) -> _Replica:
        leaves, off = [], 0
        for shape, k in zip(self.shapes, self.numels):
            leaves.append(buf[off:off + k].view(shape).requires_grad_(True))
            off += k
        groups, cls = [], None
        for leaf, rp in zip(leaves, self._ref_params()):
            opt, group, _ = self.optim_lookup(rp)
            if cls is not None and type(opt) is not cls:
                raise ValueError("persistent replicas: one expert's params are in optimizers of different "
                                 f"classes ({cls.__name__}, {type(opt).__name__})")
            cls = type(opt)
            groups.append(dict({k: v for k, v in group.items() if k != "params"}, params=[leaf]))
        ropt = cls(groups)                  # the megatron-core inner optimizer's own class
        ref_states = self._opt_states(self._ref_params())
        for (_, entries), sb in zip(self._dtype_groups(layout), sbufs):
            off = 0
            for i, k, shape, _ in entries:
                n = int(np.prod(shape, dtype=np.int64))
                ref = ref_states[i].get(k)          # back where the optimizer keeps it (step: host)
                v = sb[off:off + n].view(shape)
                ropt.state[leaves[i]][k] = v.to(ref.device, copy=True) if ref is not None else v.clone()
                off += n
        return _Replica(buf, leaves, ropt)

    def _finish_moves(self) -> None:
        for e, (buf, sbufs, layout) in self._move_recv.items():
            self.persist[e] = self._new_replica(buf, sbufs, layout)
            self.replicas_added += 1
        self._move_recv = {}
        for e in self.my_replica_experts():
            leaves = self.persist[e].leaves
            for t in leaves:
                t.grad = None
                self._hooks.append(t.register_post_accumulate_grad_hook(self._on_grad))
            self.replicas[e] = leaves

    def _grad_dtype(self) -> torch.dtype:
        p = self._ref_params()[0]
        g = getattr(p, "main_grad", None)
        return g.dtype if g is not None else p.dtype

    def issue_sumback(self, iteration) -> None:
        """After grad finalisation: the owner's finalised gradient (its own + the Agg'd replica grads,
        DP-reduced and scaled by megatron-core) goes to every replica."""
        if self.mode != "persistent" or self.sumback_issued or not self.trans_issued:
            return
        self.sumback_issued = True
        self._log("sumback_issue", iteration)
        for e in self._active_placement.replicated():
            s = self._active_placement.replica_sets[e]
            if self.rank not in s:
                continue
            o = self.owner(e)
            if o == self.rank:
                flat = torch.cat([_grad_target(p).detach().reshape(-1) for p in self.owner_params(e)])
                self._sumback_keep.append(flat)
                for dst in s:
                    if dst != o:
                        self._sumback_work.append(comm.isend(flat, dst, self.ep_group,
                                                             tag=self._tag(e, _SUMBACK)))
                        self.bytes_sumback_sent += flat.numel() * flat.element_size()
                        self.msgs_sumback_sent += 1
            else:
                buf = torch.empty(self.numel, dtype=self._grad_dtype(), device=self._ref_params()[0].device)
                self._sumback_work.append(comm.irecv(buf, o, self.ep_group,
                                                     tag=self._tag(e, _SUMBACK)))
                self.bytes_sumback_recv += buf.numel() * buf.element_size()
                self._sumback_bufs[e] = buf

    def wait_sumback(self) -> None:
        for w in self._sumback_work:
            w.wait()
        self._sumback_work, self._sumback_keep = [], []
        for e, buf in self._sumback_bufs.items():
            off = 0
            for t, k in zip(self.persist[e].leaves, self.numels):
                t.grad = buf[off:off + k].view(t.shape).to(t.dtype)
                off += k

    def step_replicas(self, update_successful: bool, grad_norm) -> None:
        """After megatron-core's optimizer.step(): the identical update on every replica of this rank
        (same clipping function, coefficient and hyperparameters; its own optimizer state)."""
        if self.mode != "persistent" or not self.sumback_issued or self.replicas_stepped:
            return
        self.wait_sumback()
        self.replicas_stepped = True
        bufs, self._sumback_bufs = self._sumback_bufs, {}
        if update_successful:
            from megatron.core.optimizer import optimizer as mopt     # the function the step used

            for e in sorted(bufs):
                rep = self.persist[e]
                by_clip: Dict[float, List[torch.Tensor]] = {}
                for t, rp in zip(rep.leaves, self._ref_params()):
                    by_clip.setdefault(float(self.optim_lookup(rp)[2] or 0.0), []).append(t)
                for clip, leaves in by_clip.items():
                    if clip > 0.0 and grad_norm is not None:
                        mopt.clip_grad_by_total_norm_fp32(leaves, max_norm=clip, total_norm=grad_norm)
                for g, rp in zip(rep.opt.param_groups, self._ref_params()):   # live lr / wd
                    g.update({k: v for k, v in self.optim_lookup(rp)[1].items() if k != "params"})
                rep.opt.step()
                rep.stepped += 1
                self.replica_steps += 1
        for e in bufs:
            for t in self.persist[e].leaves:
                t.grad = None

    # -- inspection (tests, tools) ----------------------------------------------------------------
    def _snapshot(self, flat: torch.Tensor, states: List[dict]) -> Dict[str, torch.Tensor]:
        out = {"params": flat.detach().clone()}
        for i, st in enumerate(states):
            for k, v in st.items():
                out[f"{self.names[i]}.{k}"] = v.detach().clone() if torch.is_tensor(v) else torch.tensor(v)
        return out

    def replica_snapshot(self) -> Dict[int, Dict[str, torch.Tensor]]:
        """expert -> params and optimizer state of this rank's persistent replicas."""
        return {e: self._snapshot(rep.flat, self._opt_states(rep.leaves, rep.opt))
                for e, rep in sorted(self.persist.items())}

    def owner_snapshot(self) -> Dict[int, Dict[str, torch.Tensor]]:
        """expert -> params and optimizer state of the experts this rank owns."""
        return {e: self._snapshot(torch.cat([p.detach().reshape(-1) for p in self.owner_params(e)]),
                                  self._opt_states(self.owner_params(e)))
                for e in range(self.rank * self.num_local, (self.rank + 1) * self.num_local)}
