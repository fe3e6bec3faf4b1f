"""Execution of a placement inside one MoE layer: transient replicas, Trans and Agg.

``LayerBalance`` is a plain object (never an ``nn.Module``), so the replicas it holds are invisible
to ``model.parameters()``, the optimizer, DDP buffers, the grad norm and ``state_dict``.

* Trans: the owner sends expert e's flattened parameters to every rank of S_e \\ {owner}
  (point-to-point ``isend``/``irecv`` over the EP group, so any subset works without building
  communicators). A replica is a set of leaf tensors viewing the received flat buffer. Trans may be
  issued in pieces (a list of experts each, the scheduler's two-part split); every rank issues the
  same pieces in the same order, and ``wait_trans`` waits every piece before the replicas are used.
* Agg: every replica rank sends its flattened replica grads to the owner, which sums them and adds the
  sum into the owner parameters' ``main_grad`` (megatron DDP) or ``grad``.
* Byte counters check the note's accounting: Trans moves sum_e (|S_e|-1) * size(params) out of the
  owners, Agg the same into them.
"""

from __future__ import annotations

from typing import Dict, List, Optional

import numpy as np
import torch
import torch.distributed as dist

from megatron_moe.balance.policies.base import Placement

__all__ = ["LayerBalance"]


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
        named = list(self.template.named_parameters())
        self.names = [n for n, _ in named]
        self.shapes = [p.shape for _, p in named]
        self.numels = [p.numel() for _, p in named]
        self.numel = sum(self.numels)
        self.placement = Placement.plain(num_experts, self.D)
        self.scheduler = None
        self.log = log
        self.counts = torch.zeros(self.D, num_experts, dtype=torch.float64)   # summed over micro-batches
        self.bytes_trans_sent = 0
        self.bytes_trans_recv = 0
        self.bytes_agg_sent = 0
        self.bytes_agg_recv = 0
        self.a2a_rows_recv = 0
        self.a2a_rows_recv_replica = 0               # rows received for experts this rank does not own
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
        self._trans_keep: List[torch.Tensor] = []
        self._agg_work: List = []
        self._agg_bufs: Dict[int, List[torch.Tensor]] = {}
        self._agg_keep: List[torch.Tensor] = []
        self.replicas: Dict[int, List[torch.Tensor]] = {}    # expert -> leaf tensors (names order)
        self._hooks: List = []
        self._active_placement = self.placement

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
        return ((self.layer_number or 0) * self.num_experts + e) * 2 + kind

    def owner_params(self, e: int) -> List[torch.Tensor]:
        return list(self.experts.local_experts[e - self.rank * self.num_local].parameters())

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
        works = []
        for e in todo:
            self._trans_sent.add(e)
            s = self._active_placement.replica_sets[e]
            if self.rank not in s:
                continue
            o = self.owner(e)
            if o == self.rank:
                flat = torch.cat([p.detach().reshape(-1) for p in self.owner_params(e)])
                self._trans_keep.append(flat)
                for dst in s:
                    if dst != o:
                        works.append(dist.isend(flat, self._global(dst), self.ep_group, tag=self._tag(e, 0)))
                        self.bytes_trans_sent += flat.numel() * flat.element_size()
            else:
                p0 = self.template.weight if hasattr(self.template, "weight") else next(
                    self.template.parameters())
                buf = torch.empty(self.numel, dtype=p0.dtype, device=p0.device)
                self._trans_bufs[e] = buf
                works.append(dist.irecv(buf, self._global(o), self.ep_group, tag=self._tag(e, 0)))
                self.bytes_trans_recv += buf.numel() * buf.element_size()
        self._trans_pieces.append((part, todo, works))

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
        self.trans_done = True
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
        for e, s in enumerate(self._active_placement.replica_sets):
            if len(s) <= 1 or self.rank not in s:
                continue
            o = self.owner(e)
            if o == self.rank:
                bufs = []
                for src in s:
                    if src != o:
                        b = torch.empty(self.numel, dtype=self.owner_params(e)[0].dtype)
                        bufs.append(b)
                        self._agg_work.append(dist.irecv(b, self._global(src), self.ep_group,
                                                         tag=self._tag(e, 1)))
                        self.bytes_agg_recv += b.numel() * b.element_size()
                self._agg_bufs[e] = bufs
            else:
                leaves = self.replicas[e]
                flat = torch.cat([(t.grad if t.grad is not None else torch.zeros_like(t)).reshape(-1)
                                  for t in leaves])
                self._agg_keep.append(flat)
                self._agg_work.append(dist.isend(flat, self._global(o), self.ep_group, tag=self._tag(e, 1)))
                self.bytes_agg_sent += flat.numel() * flat.element_size()

    def wait_agg(self, iteration):
        if self.agg_done or not self.agg_issued:
            return
        for w in self._agg_work:
            w.wait()
        self._agg_work = []
        self._agg_keep = []
        for e, bufs in self._agg_bufs.items():
            if not bufs:
                continue
            total = bufs[0].clone()
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
