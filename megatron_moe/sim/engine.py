"""Discrete-event replay of routing traces through a balancing policy on a modelled cluster.

Every device has two resources, ``comp`` and ``comm``, each a FIFO whose next-free time is tracked
per device (numpy arrays over all ranks, so 1024 GPUs cost the same Python work as 8).  Operations
per MoE block and iteration (Pro-Prophet note 2.1 / Fig. 7):

  forward : [Plan] [Trans] A2A-dispatch  FEC  A2A-combine  FNEC
  backward: BNEC  A2A  BEC  A2A  [Agg | replica sync]
  end     : optimizer step waits for every device and every outstanding comm op

An all-to-all is a collective of the EP group: it starts when the last member's comm and comp are
ready and ends for all members together.  Trans/Agg (parameter broadcast / gradient reduce) and
FlexMoE's replica all-reduce occupy ``comm``; without overlap the compute waits for them, with
``overlap`` (Pro-Prophet's scheduler) Trans of block l is issued right after block l-1's dispatch
and Agg is left outstanding until the optimizer step.  FlexMoE's Expand/Migrate state transfers are
best effort: they fill idle comm time of the next iteration and only the excess is exposed.

Durations come from the ``Cluster`` constants (the cost model) and ``sim.alltoall`` formulas.
The planning time is the measured wall time of the real policy code (``plan_time="measured"``) or
a fixed number of seconds.
"""

from __future__ import annotations

import dataclasses

from typing import Callable, Dict, List, Optional

import numpy as np

from .alltoall import alltoall_time
from .cluster import Cluster

__all__ = ["Assignment", "IterationBreakdown", "simulate_iterations", "FIELDS"]

FIELDS = ("iter_s", "a2a_s", "expert_s", "trans_agg_s", "plan_s", "adjust_s", "comm_s",
          "exposed_comm_s", "hidden_comm_s", "max_load", "mean_load")


@dataclasses.dataclass
class Assignment:
    """Where every input of one layer is computed, for all EP groups at once.

    local[g, src, e]   inputs computed on their source rank (owner or local replica)
    traffic[g, src, dst] inputs sent by the all-to-all (src != dst)
    trans_s[g, rank]   Trans seconds on each rank's comm (parameter broadcast before FEC)
    agg_s[g, rank]     Agg / replica gradient sync seconds on each rank's comm (after BEC)
    plan_s[g]          planning seconds on the critical path (before dispatch)
    plan_hidden_s[g]   planning seconds that overlap the dispatch (Pro-Prophet plans j+1 during j)
    adjust_s[g, rank]  best-effort placement transfer seconds (FlexMoE Expand/Migrate)
    """
    local: np.ndarray
    traffic: np.ndarray
    trans_s: np.ndarray
    agg_s: np.ndarray
    plan_s: np.ndarray
    plan_hidden_s: np.ndarray
    adjust_s: np.ndarray

    def loads(self) -> np.ndarray:
        return self.local.sum(axis=2) + self.traffic.sum(axis=1)


@dataclasses.dataclass
class IterationBreakdown:
    values: Dict[str, np.ndarray]      # field -> [iterations]
    group_iter_s: Optional[np.ndarray] = None   # [iterations, EP groups]: when each group ends (the iteration waits for the last)

    def mean(self) -> Dict[str, float]:
        return {k: float(v.mean()) for k, v in self.values.items()}


def _gmax(x: np.ndarray) -> np.ndarray:
    """Collective start/end: the maximum over each EP group, broadcast back to its ranks."""
    return np.broadcast_to(x.max(axis=1, keepdims=True), x.shape).copy()


def _pipelined(a2a: np.ndarray, comp: np.ndarray, degree: int) -> np.ndarray:
    """Seconds of a dispatch + expert compute + combine segment split into ``degree`` = n equal steps on
    two streams, as FasterMoE's smart schedule runs it (paper Sec. 4; thu-pacman/FasterMoE
    ``smart_schedule.h``): the communication stream issues every send S_0..S_{n-1} (a/n each) and then
    every return R_0..R_{n-1} (a/n each), R_j after C_j; the compute stream runs C_0..C_{n-1} (comp/n
    each), C_j after S_j.  The makespan is ``max(2a, comp + 2a/n)``: compute-bound, the first S and
    the last R are exposed (the paper's "only the first S and the last R"); communication-bound, the
    comm stream runs end to end (its R_0 waits for S_{n-1} anyway).  n = 1 gives the synchronous
    2a + comp.  (The form max(2a, comp) + min(2a, comp)/n used before agrees when comp >= 2a and
    over-charges comp/n when communication dominates.)"""
    c2 = 2.0 * np.asarray(a2a, dtype=np.float64)
    return np.maximum(c2, comp + c2 / float(degree))


def simulate_iterations(cluster: Cluster, assign_fn: Callable[[int, int], Assignment],
                        iterations: int, layers: int, algorithm: str = "flat",
                        overlap: bool = False, degree: int = 1) -> IterationBreakdown:
    """Run ``iterations`` x ``layers``; ``assign_fn(it, layer)`` runs the policy and returns the
    layer's assignment (called in forward order, once per block and iteration).  ``degree`` > 1
    pipelines each all-to-all / expert-compute / all-to-all segment in that many chunks (FasterMoE's
    smart schedule, :func:`_pipelined`)."""
    out = {k: np.zeros(iterations) for k in FIELDS}
    group_end = None
    fwd = 1.0 / cluster.expert_tokens_per_s
    bpi = cluster.bytes_per_input
    for it in range(iterations):
        asg: List[Assignment] = [assign_fn(it, l) for l in range(layers)]
        shape = asg[0].local.shape[:2]
        comp = np.zeros(shape); comm = np.zeros(shape)
        comp_busy = np.zeros(shape); comm_busy = np.zeros(shape)
        a2a_tot = 0.0; plan_tot = 0.0
        expert_busy = np.zeros(shape); ta_busy = np.zeros(shape)
        a2a_t = []
        for l, a in enumerate(asg):
            a2a_t.append(alltoall_time(a.traffic * bpi, cluster, algorithm)[:, None])
        loads = [a.loads() for a in asg]
        trans_end = [None] * layers
        if overlap:                          # Trans of block 0 is exposed: issued at iteration start
            trans_end[0] = comm + asg[0].trans_s
            comm = trans_end[0].copy()
        # ---- forward
        for l, a in enumerate(asg):
            comp = comp + a.plan_s[:, None]
            plan_tot += float(a.plan_s.max() + 0.0)
            comp_busy += a.plan_s[:, None]
            if not overlap:
                st = np.maximum(comp, comm)
                trans_end[l] = st + a.trans_s
                comm = trans_end[l].copy()
                comp = np.maximum(comp, trans_end[l])       # synchronous broadcast before dispatch
            if degree > 1:
                # FasterMoE smart schedule: dispatch, FEC and combine pipelined in ``degree`` chunks
                fec = fwd * loads[l]
                start = _gmax(np.maximum.reduce([comp, comm, trans_end[l]]))
                seg_end = _gmax(start + _pipelined(a2a_t[l], fec, degree))   # the combine is collective
                comm = start + 2.0 * a2a_t[l]               # the comm FIFO is free for Trans meanwhile
                comm_busy += 2.0 * a2a_t[l]; a2a_tot += 2.0 * float(a2a_t[l].max())
                comp = np.maximum(comp, start) + a.plan_hidden_s[:, None]
                comp_busy += a.plan_hidden_s[:, None] + fec; expert_busy += fec
                if overlap and l + 1 < layers:
                    trans_end[l + 1] = comm + asg[l + 1].trans_s
                    comm = trans_end[l + 1].copy()
                comp = np.maximum(comp, seg_end)
                comm = np.maximum(comm, seg_end)
            else:
                start = _gmax(np.maximum(comp, comm))
                d_end = start + a2a_t[l]
                comm = d_end.copy()
                comm_busy += a2a_t[l]
                a2a_tot += float(a2a_t[l].max())
                # planning of the next iteration overlaps the dispatch on the compute resource
                comp = np.maximum(comp, start) + a.plan_hidden_s[:, None]
                comp_busy += a.plan_hidden_s[:, None]
                fec = fwd * loads[l]
                part_a = None
                if overlap and l + 1 < layers:
                    # Trans of the next block: part B under this block's FEC, part A (the rest) after
                    # the combine, under FNEC (Pro-Prophet's block-wise split, note 2.6)
                    part_b = np.minimum(asg[l + 1].trans_s, fec)
                    part_a = asg[l + 1].trans_s - part_b
                    trans_end[l + 1] = comm + part_b
                    comm = trans_end[l + 1].copy()
                comp = np.maximum.reduce([comp, d_end, trans_end[l]]) + fec
                comp_busy += fec; expert_busy += fec
                start = _gmax(np.maximum(comp, comm))
                comm = start + a2a_t[l]
                comm_busy += a2a_t[l]; a2a_tot += float(a2a_t[l].max())
                if part_a is not None:
                    trans_end[l + 1] = comm + part_a
                    comm = trans_end[l + 1].copy()
            comp = np.maximum(comp, comm) + cluster.t_fnec_s
            comp_busy += cluster.t_fnec_s
        # ---- backward
        agg_end = np.zeros(shape)
        agg_rest = None
        for l in reversed(range(layers)):
            a = asg[l]
            comp = comp + cluster.t_bnec_s
            comp_busy += cluster.t_bnec_s
            bec = 2.0 * fwd * loads[l]
            if degree > 1:
                start = _gmax(np.maximum(comp, comm))
                comp = _gmax(start + _pipelined(a2a_t[l], bec, degree))
                comm = comp.copy()
                comm_busy += 2.0 * a2a_t[l]; a2a_tot += 2.0 * float(a2a_t[l].max())
                if agg_rest is not None:
                    comm = comm + agg_rest
                    agg_rest = None
            else:
                start = _gmax(np.maximum(comp, comm))
                comm = start + a2a_t[l]
                comm_busy += a2a_t[l]; a2a_tot += float(a2a_t[l].max())
                if agg_rest is not None:                   # the later block's Agg part B under BEC
                    comm = comm + agg_rest
                    agg_rest = None
                comp = np.maximum(comp, start + a2a_t[l]) + bec
                start = _gmax(np.maximum(comp, comm))
                comm = start + a2a_t[l]
                comm_busy += a2a_t[l]; a2a_tot += float(a2a_t[l].max())
            comp_busy += bec; expert_busy += bec
            # Agg (replica grads -> owner) after BEC, queued behind the combine on the comm FIFO.
            st = np.maximum(comm, comp)
            if overlap and l > 0:
                # Pro-Prophet: part A under the next backward block's BNEC, the rest under its BEC
                part = np.minimum(a.agg_s, cluster.t_bnec_s)
                agg_end = st + part
                agg_rest = a.agg_s - part
            else:
                agg_end = st + a.agg_s
            comm = agg_end.copy()
            if not overlap:
                comp = np.maximum(comp, agg_end)
        ta = sum(a.trans_s + a.agg_s for a in asg)
        comm_busy += ta; ta_busy += ta
        end = np.maximum(comp, comm) + cluster.t_step_s
        comp_busy += cluster.t_step_s
        # best-effort placement transfers: fill idle comm time, excess is exposed
        adj = sum(a.adjust_s for a in asg)
        idle = end.max() - comm_busy
        exposed_adj = np.maximum(0.0, adj - idle)
        end = end + exposed_adj
        iter_s = float(end.max())
        if group_end is None:
            group_end = np.zeros((iterations, end.shape[0]))
        group_end[it] = end.max(axis=1)
        out["iter_s"][it] = iter_s
        out["a2a_s"][it] = a2a_tot
        out["expert_s"][it] = float(expert_busy.max())
        out["trans_agg_s"][it] = float(ta_busy.max())
        out["plan_s"][it] = plan_tot + float(sum(a.plan_hidden_s.max() for a in asg))
        out["adjust_s"][it] = float(adj.max()) if np.ndim(adj) else 0.0
        cb = comm_busy.max()
        out["comm_s"][it] = float(cb)
        exposed = max(0.0, iter_s - float(comp_busy.max()))
        out["exposed_comm_s"][it] = min(exposed, float(cb + np.max(adj)))
        out["hidden_comm_s"][it] = max(0.0, float(cb) - out["exposed_comm_s"][it])
        ld = np.stack(loads)
        out["max_load"][it] = float(ld.max(axis=2).mean())
        out["mean_load"][it] = float(ld.mean())
    return IterationBreakdown(out, group_end)
