"""Block-wise scheduling of Trans and Agg (design note 2.6) and the event log its tests read.

* Trans of MoE layer i+1 is issued (async point-to-point, gloo work handles / NCCL on its own stream)
  when layer i's forward starts, so it runs under layer i's routing, all-to-all, expert compute and
  the following attention; layer i+1 waits for it right before its expert compute. Without overlap
  every layer issues its own Trans and waits at once.
* Agg of layer i is issued as soon as the last replica gradient of layer i has been accumulated in
  the last micro-batch's backward (a post-accumulate-grad hook), so it runs under the backward of
  the earlier layers; ``finish_agg`` waits for all of them before gradient finalisation. Without
  overlap all Aggs are issued and waited in ``finish_agg``.
* Trans and Agg never cross an iteration boundary: ``end_iteration`` drops the replicas.
"""

from __future__ import annotations

import itertools
import threading
from typing import Dict, List, Optional

__all__ = ["EventLog", "BalanceScheduler"]


class EventLog:
    """Ordered (seq, op, layer, iteration) records; ops: trans_issue, trans_wait, fec_start, bec_done,
    agg_issue, agg_wait, finalize, step, plan."""

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
    def __init__(self, overlap: bool = False, log: Optional[EventLog] = None):
        self.overlap = overlap
        self.log = log if log is not None else EventLog()
        self.layers: List = []          # LayerBalance states in forward order (by layer number)
        self.iteration = 0
        self.num_microbatches = 1
        self.training = True

    def register(self, state) -> None:
        if state not in self.layers:
            self.layers.append(state)
            self.layers.sort(key=lambda s: s.layer_number or 0)
        state.scheduler = self

    def _next(self, state):
        i = self.layers.index(state)
        return self.layers[i + 1] if i + 1 < len(self.layers) else None

    # -- forward -------------------------------------------------------------------------------
    def on_layer_forward(self, state) -> None:
        """At the start of a layer's forward: make sure its Trans is issued, prefetch the next."""
        state.begin_forward(self.iteration)
        if not state.trans_issued:
            state.issue_trans(self.iteration)
        if self.overlap:
            nxt = self._next(state)
            if nxt is not None and not nxt.trans_issued:
                nxt.issue_trans(self.iteration)

    def before_expert_compute(self, state) -> None:
        state.wait_trans(self.iteration)
        self.log.record("fec_start", state.layer_number, self.iteration)

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
