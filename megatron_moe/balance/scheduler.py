"""Block-wise scheduling of Plan, Trans and Agg (design note 2.6) and the event log its tests read.

* Plan ahead: in the last micro-batch's forward of MoE layer i in iteration j, once the count matrix
  of the iteration is complete, the layer issues its dispatch all-to-all asynchronously and the
  planner for iteration j+1 (``planner`` callback, the BalanceManager) runs on the host before the
  all-to-all is waited. The plan is the sequential one: same counts, same deterministic policy on
  every rank; ``BalanceManager.after_step`` applies it only if the final counts equal the ones it
  was planned from (otherwise it plans again, as without the scheduler).
* Trans of MoE layer i+1 is split in two pieces issued during layer i's forward (async
  point-to-point, gloo work handles / NCCL on its own stream):
    - part B, issued when layer i starts its expert compute (after its dispatch all-to-all, so it
      never competes with it), hides under T_FEC of layer i;
    - part A, issued when layer i's forward returns (after its combine all-to-all), hides under the
      non-MoE forward that follows (T_FNEC: the next attention block).
  Sizing rule (note 2.6, offline and static): part A = the longest prefix (expert-id order) of layer
  i+1's replicated experts whose summed transfer time ``|S_e| * size(params) / (D * B_x)`` (Eq. 4 per
  expert) fits in the calibrated ``t_fnec``; part B = the rest. Without a calibrated ``t_fnec`` (0)
  everything goes in part B. Layer i+1 waits both pieces right before its own expert compute. The
  first layer (nothing before it to hide under) and the no-overlap mode issue one piece at the
  layer's forward start.
* Agg of layer i is issued as soon as the last replica gradient of layer i has been accumulated in
  the last micro-batch's backward (a post-accumulate-grad hook), so it runs under the backward of
  the earlier layers; ``finish_agg`` waits for all of them before gradient finalisation. Without
  overlap all Aggs are issued and waited in ``finish_agg``.
* Trans and Agg never cross an iteration boundary: ``end_iteration`` drops the replicas.
"""

from __future__ import annotations

import itertools
import threading
from typing import Callable, Dict, List, Optional, Tuple

__all__ = ["EventLog", "BalanceScheduler"]


class EventLog:
    """Ordered (seq, op, layer, iteration, **detail) records; ops: trans_issue / trans_wait (detail:
    part, experts), a2a_issue, plan_start, plan, a2a_wait, fec_start, fwd_end, bec_done, agg_issue,
    agg_wait, finalize, plan_apply, step."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self.events: List[Dict] = []
        self._seq = itertools.count()
        self._lock = threading.Lock()

    def record(self, op: str, layer: Optional[int] = None, iteration: Optional[int] = None, **kw):
        if not self.enabled:
            return
        with self._lock:
            self.events.append(dict(seq=next(self._seq), op=op, layer=layer, iteration=iteration, **kw))

    def clear(self):
        self.events.clear()


class BalanceScheduler:
    def __init__(self, overlap: bool = False, log: Optional[EventLog] = None, cost=None):
        self.overlap = overlap
        self.log = log if log is not None else EventLog()
        self.layers: List = []          # LayerBalance states in forward order (by layer number)
        self.iteration = 0
        self.num_microbatches = 1
        self.training = True
        self.cost = cost                # CostModel: trans bandwidth and the static t_fnec (split rule)
        self.planner: Optional[Callable] = None   # plan-ahead callback(state), set by the manager

    def register(self, state) -> None:
        if state not in self.layers:
            self.layers.append(state)
            self.layers.sort(key=lambda s: s.layer_number or 0)
        state.scheduler = self

    def _next(self, state):
        i = self.layers.index(state)
        return self.layers[i + 1] if i + 1 < len(self.layers) else None

    # -- forward -------------------------------------------------------------------------------
    def split_trans(self, state) -> Tuple[List[int], List[int]]:
        """(part A under T_FNEC, part B under T_FEC) of ``state``'s replicated experts (rule above)."""
        experts = state.trans_experts()
        if self.cost is None or not self.cost.t_fnec > 0:
            return [], experts
        sets = state._active_placement.replica_sets
        budget, k = self.cost.t_fnec, 0
        for e in experts:
            t_x = self.cost.t_trans(1, state.D - len(sets[e]), state.D)      # Eq. 4, one expert
            if t_x > budget:
                break
            budget -= t_x
            k += 1
        return experts[:k], experts[k:]

    def on_layer_forward(self, state, training: bool = True) -> None:
        """At the start of a layer's forward: its Trans is issued (whole, unless the previous layer
        already issued it in two pieces)."""
        state.begin_forward(self.iteration, training)
        if not state.trans_issued:
            state.issue_trans(self.iteration, part="all")

    def during_dispatch(self, state) -> None:
        """The layer's dispatch all-to-all is in flight: plan the next iteration (plan ahead)."""
        if self.planner is not None:
            self.planner(state)

    def before_expert_compute(self, state) -> None:
        state.wait_trans(self.iteration)
        if self.overlap:
            nxt = self._next(state)
            if nxt is not None and not nxt.trans_issued:
                part_a, part_b = self.split_trans(nxt)
                nxt.issue_trans(self.iteration, part_b, part="B")   # hides under this FEC
        self.log.record("fec_start", state.layer_number, self.iteration)

    def after_layer_forward(self, state) -> None:
        """The layer's combine all-to-all is done; the non-MoE forward (next attention) follows."""
        self.log.record("fwd_end", state.layer_number, self.iteration)
        if self.overlap:
            nxt = self._next(state)
            if nxt is not None and nxt.trans_issued and not nxt.trans_done and nxt.trans_pending():
                nxt.issue_trans(self.iteration, nxt.trans_pending(), part="A")   # hides under FNEC

    # -- backward ------------------------------------------------------------------------------
    def on_replica_grads_ready(self, state) -> None:
        """All replica grads of ``state`` for this micro-batch are accumulated."""
        self.log.record("bec_done", state.layer_number, self.iteration)
        if self.overlap and state.backward_count >= self.num_microbatches and not state.agg_issued:
            state.issue_agg(self.iteration)

    def finish_agg(self) -> None:
        """Before gradient finalisation: every Agg issued and waited, replica grads in the owners."""
        for s in reversed(self.layers):      # backward order, as the hooks issue them
            if not s.agg_issued:
                s.issue_agg(self.iteration)
        for s in self.layers:
            s.wait_agg(self.iteration)
        self.log.record("finalize", None, self.iteration)

    def end_iteration(self) -> None:
        self.log.record("step", None, self.iteration)
        for s in self.layers:
            s.end_iteration()
        self.iteration += 1
