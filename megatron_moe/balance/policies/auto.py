"""``--moe-balance-policy auto``: per layer and per re-plan, pick no replication, transient replicas
(Pro-Prophet) or persistent replicas (FlexMoE) by the cost model's predicted iteration time.

At every ``plan(counts)`` each candidate planner (the registered ``none``, ``proprophet`` and
``flexmoe`` policies; nothing of their logic is repeated here) plans from the predicted counts, and
the ONE cost model (``balance/cost_model.py``; its ``PlannerCost`` built from the calibration
profile in training, from the cluster in the simulator) prices each plan on them, per rank, and
takes the slowest rank:

* every candidate: ``rank_time_s``: 3 x forward compute of the inputs the rank processes + 4 x the
  all-to-all time (a collective: the slowest rank's send or receive time over its links; FlexMoE's
  loads by its real-number router ``route_real``);
* transient (Pro-Prophet): + one parameter broadcast (Trans) and one gradient reduce (Agg) of every
  replicated expert on each of its member ranks (with ``eq8``: only what exceeds the forward /
  backward compute and the non-MoE time, Eq. 8);
* persistent (FlexMoE): + the per-iteration replica-group gradient sync (``sync_s_vec``) + the
  state moves of its Expand/Migrate ops (``PlannerCost.state_move_s``) divided by the re-plan
  ``interval``; with ``moves_overlap`` (FlexMoE's best-effort transfers, as the simulator runs them)
  only the part of the moves exceeding the rank's idle link time is charged; a plan whose extra
  replicas need more than ``memory_left_bytes`` on some rank is not eligible.
  With ``persistent=False`` (training runs FlexMoE's placement with transient replicas under auto)
  FlexMoE is priced with Trans + Agg like Pro-Prophet.

The choice (:func:`choose`) is made per layer over all EP groups together (their iteration ends
with the slowest group): each group picks its cheapest stateless candidate (none / Pro-Prophet),
or every group runs FlexMoE. Switching into FlexMoE builds every non-owner replica at once, each
expert's state down a chain of its new hosts (:meth:`AutoPolicy.build_moves`; its exposed part is
priced by the same best-effort rule); it is done when the advantage FlexMoE would have had, summed
since it last was not positive, reaches that build (ski rental) and this re-plan's advantage
exceeds how far FlexMoE's prices have been missing (``margin``), and FlexMoE is left when its
smoothed advantage turns negative. In the simulator, with several layers and several
EP groups, one regime is chosen for all layers at once (:func:`plan_layers`): the iteration ends
with the slowest group's sum over layers, which the layers' own slowest groups overstate. The
regime starts persistent (all tables are plain before the first plan, so nothing needs building:
FlexMoE's first ops move during the plain iteration, as FlexMoE's own do) and the first re-plan
keeps it if FlexMoE is predicted faster.

Drift: every candidate's previous plan was priced on the counts it was planned from; at the next
re-plan the same plan is priced on the counts that really came. The ratio (EMA) is that candidate's
drift factor; it scales the part of its next prediction that the counts decide (the slowest rank's
compute and all-to-alls, :meth:`AutoPolicy.scaled`; not Trans/Agg or the replica sync), so a
placement that decays fast under drifting routing is charged for it. The observed drift
||C_j - C_{j-1}||_1 / ||C_{j-1}||_1 is recorded too.

The FlexMoE candidate is stateful: its slot table is stepped at every re-plan even while another
candidate is chosen (a shadow table), so switching to it starts from a table adapted to the load.
"""

from __future__ import annotations

import copy
import itertools
from typing import Dict, List, Optional, Sequence

import numpy as np

from megatron_moe.balance.cost_model import CostModel, PlannerCost, as_planner_cost, rank_time_s
from megatron_moe.balance.policies.base import (BalancePolicy, NoBalancePolicy, Placement, default_owner, loads,
                                                make_policy, register_policy)
from megatron_moe.balance.policies.flexmoe import _Priced, _route_hosts, _sync_hosts, route_real, spill_traffic

__all__ = ["AutoPolicy", "CANDIDATES", "choose", "plan_groups", "plan_layers"]

CANDIDATES = ("none", "proprophet", "flexmoe")


def _counts(p: Placement):
    """``p.vexperts``, or FlexMoE's count array while its lists are unbuilt (flexmoe._TablePlacement)."""
    a = p.vexperts_array() if hasattr(p, "vexperts_array") else None
    return p.vexperts if a is None else a


class AutoPolicy(BalancePolicy):
    name = "auto"

    def __init__(self, num_experts: int, num_ranks: int, cost: Optional[CostModel] = None,
                 planner_cost: Optional[PlannerCost] = None, alpha: float = 1.0, n: int = 0,
                 eq8: bool = False, interval: int = 1, persistent: bool = True,
                 memory_left_bytes: Optional[float] = None, candidates=CANDIDATES,
                 drift_ema: float = 0.2, force: Optional[str] = None, max_stay: float = 20.0,
                 moves_overlap: bool = True, flexmoe_kwargs: Optional[Dict] = None, coordinate: bool = True,
                 lookahead: bool = True, amortised: bool = True, hysteresis: bool = True,
                 horizon: bool = True, joint_layers: bool = True, factor_on_base: bool = True,
                 chain_build: bool = True, margin: bool = True, spread_prior: bool = True, **_ignored):
        super().__init__(num_experts, num_ranks)
        self.cost = cost if cost is not None else CostModel.from_profile(None)
        self.pc = planner_cost if planner_cost is not None else as_planner_cost(self.cost, num_ranks)
        self.eq8, self.interval, self.persistent = bool(eq8), max(1, int(interval)), bool(persistent)
        self.memory_left_bytes = memory_left_bytes
        self.drift_ema, self.max_stay = float(drift_ema), float(max_stay)
        # re-plans left in the run that a plan made now serves (None: unknown). The simulator sets
        # it before each plan: a build the rest of the run cannot pay back is not made
        self.remaining: Optional[float] = None
        self.moves_overlap = bool(moves_overlap)
        self.force = force                       # tests' mutation: always this candidate
        self.coordinate = bool(coordinate)       # tests' mutation (False): every EP group chooses alone
        self.lookahead = bool(lookahead)         # tests' mutation (False): first re-plan on the one-step table
        self.amortised = bool(amortised)         # tests' mutation (False): enter FlexMoE by ski rental only
        self.hysteresis = bool(hysteresis)       # tests' mutation (False): leave FlexMoE when the EMA dips
        self.horizon = bool(horizon)             # tests' mutation (False): ignore the run's end (remaining)
        self.joint_layers = bool(joint_layers)   # tests' mutation (False): the simulator plans layer by layer
        self.factor_on_base = bool(factor_on_base)   # tests' mutation (False): drift factors scale whole prices
        self.chain_build = bool(chain_build)         # tests' mutation (False): a build sends every copy from the owner
        self.margin = bool(margin)                   # tests' mutation (False): enter on any predicted advantage
        self.spread_prior = bool(spread_prior)       # tests' mutation (False): the spread's EMA starts from 0
        self.owner = default_owner(num_experts, num_ranks)
        self._to_owner = np.zeros((num_experts, num_ranks))
        self._to_owner[np.arange(num_experts), self.owner] = 1.0
        self.cands: Dict[str, BalancePolicy] = {}
        for c in candidates:
            if c == "none":
                self.cands[c] = NoBalancePolicy(num_experts, num_ranks)
            elif c == "proprophet":
                self.cands[c] = make_policy(c, num_experts, num_ranks, cost=self.cost, alpha=alpha, n=n, eq8=eq8)
            elif c == "flexmoe":
                self.cands[c] = make_policy(c, num_experts, num_ranks, cost=self.pc, **(flexmoe_kwargs or {}))
            else:
                raise ValueError(f"--moe-balance-policy auto: unknown candidate {c!r}; choose from {CANDIDATES}")
        # before the first plan every placement is plain, so the persistent regime's table (plain)
        # is in sync: it starts there and grows by FlexMoE's own ops (paid as FlexMoE pays them)
        self.choice = "flexmoe" if "flexmoe" in self.cands and self.persistent else "none"
        self.factor = {c: 1.0 for c in self.cands}     # drift factors (realised / predicted)
        self._prev: Dict[str, tuple] = {}              # candidate -> (placement, predicted base time)
        self._prev_counts: Optional[np.ndarray] = None
        self.drift = 0.0
        self.last_times: Dict[str, float] = {}
        self.last_ops: List = []
        self.choices: Dict[str, int] = {c: 0 for c in self.cands}
        self._memo: Optional[Dict] = None      # during propose(): per-placement arrays and prices
        self._kept: Dict = {}                  # the arrays of the plans in _prev, for the next propose()
        self._shared = None                    # (counts, FlexMoE's pricing of them on its table): run_priced
        self._flex_last = None                 # during propose(): the last FlexMoE router result (_flex_router)
        self._plain: Optional[Placement] = None    # the none candidate's placement (NoBalancePolicy's, reused)

    # -- speed: per-placement arrays and prices computed once per propose() ------------------------
    # (a pure cache: every value is what the uncached call returns; tests/test_auto_speed.py)
    def _cached(self, key, objs, fn):
        """``fn()``, remembered under ``key`` while :meth:`propose` runs (the placements and counts
        it prices are not changed meanwhile, nor the plans it keeps in ``_prev`` afterwards;
        ``objs`` are kept alive so their ids stay theirs)."""
        if self._memo is None:
            return fn()
        hit = self._memo.get(key)
        if hit is None:
            hit = self._memo[key] = (objs, fn())
        return hit[1]

    def _vx(self, p: Placement) -> np.ndarray:
        """FlexMoE vExpert counts of ``p`` as a float [E, D] array."""
        return self._cached(("vx", id(p)), p, lambda: np.asarray(_counts(p), dtype=np.float64))

    def _mask(self, p: Placement) -> np.ndarray:
        return self._cached(("mask", id(p)), p, p.mask)

    def _content(self, p: Placement) -> bytes:
        """What ``_ranks`` reads of ``p``: its vExperts (as the positions and values of the nonzero
        counts: the E x G array's bytes cost more to copy and hash), else its locality mask (the
        owners are fixed), as bytes: equal plans of different objects (this plan and the last)
        price once."""
        def content():
            key = p._array_key() if getattr(p, "_lazy", lambda: False)() else None
            if key is not None:             # FlexMoE's table: its slot-table key (hosts, counts there)
                return "t", key
            if p.has_vexperts:
                n = self._vx(p).ravel()
                nz = np.flatnonzero(n)
                return "v", nz.tobytes(), n[nz].tobytes()
            return "m", self._mask(p).tobytes()
        return self._cached(("content", id(p)), p, content)

    def run_priced(self, counts: np.ndarray, p: Placement):
        """FlexMoE's pricing (``_Priced``) of counts on the vExpert placement ``p`` that runs now,
        for the simulator's router. When ``p`` is the shadow table's last plan (FlexMoE chosen),
        it is that table's own ``price(counts)``, and the next :meth:`propose` of the same
        ``counts`` array steps the table from it (as the flexmoe policy shares it with its step)."""
        fx = self.cands.get("flexmoe")
        last = self._prev.get("flexmoe")
        if fx is not None and last is not None and last[0] is p:
            n = fx.table.counts()
            a = p.vexperts_array() if hasattr(p, "vexperts_array") else None   # (ints compare faster)
            if np.array_equal(n, a if a is not None else self.vexperts_array(p)):
                pr = fx.price(counts, n)
                self._shared = (counts, pr)
                return pr
        return _Priced(counts, self.vexperts_array(p), self.pc)

    def vexperts_array(self, p: Placement) -> np.ndarray:
        """``np.asarray(p.vexperts, float64)``; free for the plans this policy proposed last (the
        simulator runs them)."""
        hit = self._kept.get(("vx", id(p)))
        return hit[1] if hit is not None and hit[0] is p else np.asarray(_counts(p), dtype=np.float64)

    # -- the cost model's price of one placement ------------------------------------------------
    def _ranks(self, counts: np.ndarray, p: Placement, priced: Optional[_Priced] = None):
        """Per-rank (compute + 4 all-to-alls) seconds of ``p`` on ``counts`` (``rank_time_s``)
        and per-rank forward compute seconds. FlexMoE placements route by the real-number router
        (``priced``: FlexMoE's pricing of these counts on ``p``'s table, when at hand: its router
        entries, and the traffic its ``dispatch`` gave the simulator)."""
        return self._cached(("ranks", id(counts), self._content(p)), counts,
                            lambda: self._ranks_now(counts, p, priced))

    def _ranks_now(self, counts: np.ndarray, p: Placement, priced: Optional[_Priced] = None):
        if p.has_vexperts:
            n = self._vx(p)
            got = self._flex_router(counts, n, priced)
            if got is not None:
                traffic, keep = got
                H = keep + traffic.sum(axis=0)
                return rank_time_s(self.pc, H, traffic), self.pc.fwd_s_per_input * H
            keep, spill, frac = route_real(counts, n)
            traffic = spill.T @ frac                     # [src, dst]; a source never spills to itself
            H = keep.sum(axis=0) + traffic.sum(axis=0)
        else:
            m = self._mask(p)
            traffic = np.where(m, 0.0, counts)             # [src, expert] -> [src, owner]
            H = loads(counts, p, m, traffic)[0]
            # (an owner of one or two contiguous experts: the one-hot matmul's sum is this one exactly;
            # of one expert: it is the [src, expert] matrix itself)
            k = self.num_experts // self.num_ranks
            if k == 2:
                traffic = traffic.reshape(self.num_ranks, self.num_ranks, k).sum(axis=2)
            elif k > 2:
                traffic = traffic @ self._to_owner
        return rank_time_s(self.pc, H, traffic), self.pc.fwd_s_per_input * H

    def _flex_router(self, counts: np.ndarray, n: np.ndarray, priced: Optional[_Priced] = None):
        """(traffic[src, dst], per-rank inputs kept at their source) of the real-number router on
        vExperts ``n``, from its entries at the hosts only (frac is 0 elsewhere: traffic is
        spill.T @ frac summed over the at most S experts a rank hosts, no E x G x G matmul; keep's
        column sums in expert order). ``priced``: FlexMoE's pricing of these counts on ``n`` (its
        router entries, and the traffic its ``dispatch`` gave the simulator). A table that differs
        from the last one priced on the same counts in a few experts (the next FlexMoE step) is
        that one's traffic with those experts' entries taken out and their new ones added (equal
        to pricing it whole up to rounding). None for counts the router does not take."""
        last = self._flex_last
        if priced is None and last is not None and last[0] is counts and last[1].shape == n.shape:
            rows = np.flatnonzero((n != last[1]).any(axis=1))
            if len(rows) <= n.shape[0] // 4:
                _, _, r0, traffic0, keep0 = last
                traffic, keep = traffic0.copy(), keep0.copy()
                changed = np.zeros(n.shape[0], dtype=bool)
                changed[rows] = True
                in_rows = changed[r0["he"]]                  # (np.isin's answer, by lookup)
                i = np.flatnonzero(in_rows & (r0["frac_h"] > 0))
                np.subtract.at(traffic.T, r0["hg"][i], r0["spill"][r0["he"][i]] * r0["frac_h"][i, None])
                i = np.flatnonzero(in_rows)
                np.subtract.at(keep, r0["hg"][i], r0["keep_h"][i])
                if len(rows):
                    nr = n[rows]
                    r1 = _route_hosts(counts.T[rows], nr, nr.sum(axis=1))
                    if r1 is None:
                        return None
                    i = np.flatnonzero(r1["frac_h"] > 0)
                    np.add.at(traffic.T, r1["hg"][i], r1["spill"][r1["he"][i]] * r1["frac_h"][i, None])
                    np.add.at(keep, r1["hg"], r1["keep_h"])
                return traffic, keep
        r = priced.route if priced is not None else _route_hosts(counts.T, n, n.sum(axis=1))
        if r is None:
            return None
        traffic = getattr(priced, "dispatched", None)                # [src, dst]
        if traffic is None:                 # as dispatch fills the simulator's array
            traffic = np.empty((self.num_ranks, self.num_ranks))
            spill_traffic(r, traffic.T)
        keep = np.bincount(r["hg"], weights=r["keep_h"], minlength=self.num_ranks)
        self._flex_last = (counts, n, r, traffic, keep)
        return traffic, keep

    def _base(self, counts: np.ndarray, p: Placement, priced: Optional[_Priced] = None) -> float:
        return float(self._ranks(counts, p, priced)[0].max())

    def _member_collectives_s(self, p: Placement) -> np.ndarray:
        """Per rank: one broadcast of every replicated expert it is a member of (once per plan:
        the price and the link-busy time both read it)."""
        def members():
            t = np.zeros(self.num_ranks)
            rep = [p.replica_sets[e] for e in p.replicated()]
            if rep:     # one addition per (expert, member) in expert order, as a loop over experts would
                np.add.at(t, np.fromiter(itertools.chain.from_iterable(rep), dtype=np.int64),
                          self.pc.param_collective_s)
            return t
        return self._cached(("members", id(p)), p, members)

    def _transient_s(self, p: Placement, fec: np.ndarray) -> np.ndarray:
        """Per rank: Trans + Agg (one broadcast and one reduce of each expert it holds a replica of
        or owns; Eq. 8's exposed parts with ``eq8``)."""
        t = self._member_collectives_s(p)
        if self.eq8:
            return np.maximum(0.0, t - fec - self.cost.t_fnec) + np.maximum(0.0, t - 2 * fec - self.cost.t_bnec)
        return 2.0 * t

    def _persistent_s(self, p: Placement, ops, switching: bool):
        """Per rank: (replica-group gradient sync per iteration, state-move seconds of this re-plan);
        None if the extra replicas do not fit the memory left. ``switching``: FlexMoE's replicas are
        built now from their owners (every non-owner replica moves), else only its ops move."""
        n = self._vx(p)
        e, g = self._cached(("hosts", id(p)), p, lambda: np.divmod(np.flatnonzero(n > 0), self.num_ranks))
        if self.memory_left_bytes is not None:
            extra = np.bincount(g, minlength=self.num_ranks) - np.bincount(self.owner, n[np.arange(self.num_experts),
                                                                                         self.owner] > 0, self.num_ranks)
            if extra.max() * self.pc.state_bytes > self.memory_left_bytes:
                return None
        # per rank the sync of every expert it hosts, added in expert order (the dense column sum's
        # additions; _sync_hosts is sync_s_vec row by row)
        sync = self._cached(("sync", id(p)), p, lambda: np.bincount(
            g, _sync_hosts(self.pc, n, e, g, np.bincount(e, minlength=self.num_experts))[e], self.num_ranks))
        if switching:                                    # switching in: every non-owner replica is new
            a, b = self._build_pairs(e, g)
        else:
            ab = [(a, b) for a, b, nb in self.cands["flexmoe"].adjustment_bytes(ops) if nb > 0]
            a, b = (np.array(v, dtype=np.int64).reshape(-1) for v in (zip(*ab) if ab else ((), ())))
        return sync, self._move_s(a, b)

    def build_moves(self, p: Placement):
        """(src, dst) rank arrays of the state copies that build ``p``'s replicas when FlexMoE is
        entered (every non-owner vExpert host is new; the state is at the owner). The simulator
        asks it for the plan just committed, whose array ``vexperts_array`` keeps."""
        e, g = np.divmod(np.flatnonzero(self.vexperts_array(p) > 0), self.num_ranks)
        return self._build_pairs(e, g)

    def _build_pairs(self, e: np.ndarray, g: np.ndarray):
        """Copies for new hosts ``g[i]`` of experts ``e[i]``: each expert's state goes down a chain
        owner -> h1 -> h2 -> ... (hosts on the owner's node first, then node by node), sent in
        chunks as a pipelined broadcast (NCCL's ring), so every rank sends and receives it at most
        once. Sent from the owner to each host in turn (``chain_build=False``), the owner of a hot
        expert with k new hosts carried k copies, the busiest link of the iteration (its
        all-to-all's hot receiver): a 60 ms exposed build at 32 GPUs, s 1.6, d 0.25."""
        new = g != self.owner[e]
        e, g = e[new], g[new]
        if not self.chain_build or len(e) == 0:
            return self.owner[e], g
        node = self.pc.node if self.pc.node is not None else np.zeros(self.num_ranks, dtype=np.int64)
        far = node[g] != node[self.owner[e]]
        order = np.lexsort((g, node[g], far, e))        # by expert, then owner's node first
        e, g = e[order], g[order]
        a = np.empty_like(g)
        a[1:] = g[:-1]
        first = np.r_[True, e[1:] != e[:-1]]
        a[first] = self.owner[e[first]]
        return a, g

    def _move_s(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        """Per rank: state-move seconds of the moves a[i] -> b[i] (``PlannerCost.state_move_s``
        each, added to both ends in move order, as a loop over the moves would)."""
        move = np.zeros(self.num_ranks)
        if len(a) and self.pc.link_s_per_byte is not None:
            t = np.where(a == b, 0.0, self.pc.state_bytes * self.pc.link_s_per_byte[a, b] + self.pc.lat)
            np.add.at(move, np.stack([a, b], axis=1).ravel(), np.repeat(t, 2))
        return move

    def expected_stay(self) -> float:
        """Re-plans a persistent placement is expected to stay useful: 1 / observed drift, capped."""
        return float(min(self.max_stay, 1.0 / max(self.drift, 1.0 / self.max_stay)))

    def _flex_parts(self, counts: np.ndarray, p: Placement, ops, switching: bool):
        """FlexMoE's plan per rank: (steady seconds = compute + all-to-alls + replica sync, seconds
        its links are busy with them, state-move seconds); None if it does not fit the memory left."""
        base, fec = self._ranks(counts, p)
        parts = self._persistent_s(p, ops, switching)
        if parts is None:
            return None
        sync, move = parts
        busy = base - self.pc.compute_s(fec / self.pc.fwd_s_per_input) + sync
        return base + sync, busy, move

    def _link_busy(self, name: str, counts: np.ndarray, p: Placement) -> np.ndarray:
        """Per rank: seconds its links are busy in one iteration of a stateless candidate's plan
        (4 all-to-alls, + Trans and Agg for transient replicas): a FlexMoE build issued during that
        iteration only has the rest."""
        base, fec = self._ranks(counts, p)
        busy = base - self.pc.compute_s(fec / self.pc.fwd_s_per_input)
        if name == "none" or p.is_plain():
            return busy
        return busy + 2.0 * self._member_collectives_s(p)

    def exposed_moves_s(self, busy: np.ndarray, move: np.ndarray, iteration_s: float, blocks: int = 1) -> float:
        """Best effort (FlexMoE, as the simulator runs it): the state moves fill each rank's idle
        link time of an iteration lasting ``iteration_s`` (the MoE time of ``blocks`` layers, whose
        busy link seconds and moves ``busy`` and ``move`` sum); the slowest rank's excess is
        exposed. Without ``moves_overlap`` every move is exposed."""
        if not self.moves_overlap:
            return float(move.max())
        # the blocks' non-MoE forward and backward have no all-to-all: idle link time too
        idle = iteration_s + blocks * (self.cost.t_fnec + self.cost.t_bnec) - busy
        return float(np.maximum(0.0, move - idle).max())

    def price(self, name: str, counts: np.ndarray, p: Placement, ops=(), switching: Optional[bool] = None):
        """Predicted seconds of one layer iteration of this EP group alone under candidate ``name``'s
        placement ``p`` (``switching``: FlexMoE's replicas are built now; default: unless FlexMoE is
        the current choice). Moves of a re-plan are paid once per interval; building the replicas
        when switching in once per expected stay (~1/drift re-plans)."""
        base, fec = self._ranks(counts, p)
        if name == "none" or p.is_plain():
            return float(base.max())
        if name == "flexmoe" and self.persistent:
            switching = self.choice != "flexmoe" if switching is None else switching
            parts = self._flex_parts(counts, p, ops, switching)
            if parts is None:
                return None
            steady, busy, move = parts
            return self._flex_time(steady, busy, move, switching)
        return float((base + self._transient_s(p, fec)).max())

    def _flex_time(self, steady: np.ndarray, busy: np.ndarray, move: np.ndarray, switching: bool) -> float:
        """FlexMoE's layer seconds: the slowest rank's steady time plus the exposed part of the
        re-plan's moves, paid once per interval (a build when switching in: once per expected stay)."""
        spread = self.interval * (self.expected_stay() if switching else 1.0)
        return float(steady.max() + self.exposed_moves_s(busy, move, steady.max()) / spread)

    # -- the policy -----------------------------------------------------------------------------
    def propose(self, counts) -> Dict[str, float]:
        """Step every candidate planner on ``counts`` and price its plan (this group alone); the
        choice is made by :func:`choose` (over all EP groups of the layer) and :meth:`commit`."""
        self._memo = dict(self._kept)
        try:
            return self._propose(counts)
        finally:
            kept = {id(p) for p, _ in self._prev.values()}
            self._kept = {k: v for k, v in self._memo.items() if k[0] in ("vx", "mask", "content", "sync", "hosts") and k[1] in kept}
            self._memo = self._flex_last = None

    def _propose(self, counts) -> Dict[str, float]:
        C = np.asarray(counts, dtype=np.float64)
        first = self._prev_counts is None
        # drift: how each candidate's previous plan priced on the counts that really came
        self._checked = {}                 # candidate -> (previous plan priced on the counts that came, as predicted)
        # FlexMoE's table priced on these counts already (run_priced: the running table, which is
        # its last plan): its router entries serve that plan's price below, its step starts from it
        sh, self._shared = self._shared, None
        shared = sh[1] if sh is not None and sh[0].dtype == C.dtype and np.array_equal(sh[0], C) else None
        if self._prev_counts is not None:
            self.drift = float(np.abs(C - self._prev_counts).sum() / max(1.0, self._prev_counts.sum()))
            for c, (p, predicted) in self._prev.items():
                if predicted > 0:
                    real = self._base(C, p, shared if c == "flexmoe" else None)
                    self._checked[c] = (real, predicted)
                    self.factor[c] = (1 - self.drift_ema) * self.factor[c] + self.drift_ema * real / predicted
        self._prev_counts = C.copy()
        prop, times, raw = {}, {}, {}
        for c, pol in self.cands.items():
            if c == "flexmoe":             # its table priced on these counts already (run_priced)
                p = pol.plan(C, None, shared)
            elif c == "none" and type(pol) is NoBalancePolicy:    # one plain placement, its prices cached
                p = self._plain = self._plain or pol.plan(C, None)
            else:
                p = pol.plan(C, None)      # flexmoe: its own (shadow) table, stepped every re-plan
            if p.has_vexperts and hasattr(pol, "table"):    # the counts p was made from
                self._cached(("vx", id(p)), p, lambda: np.asarray(_counts(p) if hasattr(p, "vexperts_array")
                                                                  else pol.table.counts(), dtype=np.float64))
            ops = list(getattr(pol, "last_ops", None) or [])
            self._prev[c] = (p, self._base(C, p))
            entry = {"placement": p, "ops": ops, "base": self._prev[c][1]}
            if c == "flexmoe" and self.persistent and not p.is_plain():
                switching = self.choice != "flexmoe"
                parts = self._flex_parts(C, p, ops, False)
                t = None
                if parts is not None:        # as price(): this group alone
                    steady, busy, move = parts
                    build = self._persistent_s(p, ops, True)[1]
                    t = self._flex_time(steady, busy, build if switching else move, switching)
                    entry.update(steady=self.scaled(float(steady.max()), entry["base"], self.factor[c]), busy=busy,
                                 move=move, build=build, raw=float(steady.max()))
                    if first and not switching and self.lookahead:
                        entry["look"] = self._lookahead(C, pol)
            else:
                t = self.price(c, C, p, ops)
                entry["steady"], entry["raw"] = self.scaled(t, entry["base"], self.factor[c]), t
                entry["link"] = self._link_busy(c, C, p)
            prop[c] = entry
            if t is not None:
                raw[c] = t
                times[c] = self.scaled(t, entry["base"], self.factor[c])
        self._proposal = prop
        self.last_times, self.last_price = times, raw     # this group alone: scaled and unscaled
        return times

    def scaled(self, price: float, base: float, factor: float) -> float:
        """A price under a drift factor. The factor is measured on the part of a plan's time that the
        counts decide (compute and all-to-alls of the slowest rank: ``_checked``), so only that part
        is scaled; Trans/Agg and the replica sync move the same bytes whatever the counts. (Scaling
        whole prices charged Pro-Prophet's broadcasts for drift: 8192 GPUs, s 1.6, d 0.5, transient
        predicted ~8% above what it took, FlexMoE ~6% below, and auto entered FlexMoE twice on it.)"""
        if not self.factor_on_base:
            return price * factor
        return price + (factor - 1.0) * base

    def _lookahead(self, C: np.ndarray, pol):
        """FlexMoE's table as its own planner takes it on the load ``C``: a copy of the (shadow)
        table is stepped on ``C`` until a step makes no op (at most ``max_stay`` steps). The first
        step from plain stops early (its migrations open further Expand/Shrink pairs: at 256 GPUs,
        s 1.6 a second step on the same counts takes the planner's price from 33 to 22 ms).
        Returns (steady seconds per rank, link-busy seconds, state moves of the extra ops), as
        ``_flex_parts``; None if it does not fit the memory left."""
        look = copy.copy(pol)
        look.table = pol.table.copy()
        ops = []
        for _ in range(int(self.max_stay)):
            o = look.step(C)
            if not o:
                break
            ops += o
        return self._flex_parts(C, look.placement(), ops, False)

    def commit(self, choice: str) -> Placement:
        """Adopt candidate ``choice``'s proposed placement."""
        self.choice = choice
        self.choices[choice] += 1
        entry = self._proposal[choice]
        self.last_ops = entry["ops"] if choice == "flexmoe" else []
        return entry["placement"]

    def plan(self, counts, current: Optional[Placement] = None) -> Placement:
        self.propose(counts)
        return self.commit(choose([self])[0])

    # the state :func:`choose` keeps on a layer's first policy between re-plans
    _JOINT = ("joint_factor", "joint_spread", "adv", "loss", "regret")

    def state_dict(self) -> Dict:
        """Everything the next re-plan reads: the choice, the drift factors, each candidate's last
        plan with its predicted time and the counts it was planned from (the next re-plan checks
        them), the observed drift, :func:`choose`'s smoothed advantage / regret / loss and joint
        factors, and FlexMoE's shadow table. A replicated expert's gradient is summed in another
        order than plain EP's, so a resumed run continues bit-exactly only if it plans the same
        placements (tests/test_auto_policy.py: save / resume vs uninterrupted)."""
        fx = self.cands.get("flexmoe")
        d = {"choice": self.choice, "factor": dict(self.factor), "choices": dict(self.choices),
             "flexmoe": fx.state_dict() if fx is not None else None, "drift": self.drift,
             "prev_counts": None if self._prev_counts is None else self._prev_counts.tolist(),
             "prev": {c: [p.to_dict(), float(t)] for c, (p, t) in self._prev.items()}}
        d["joint"] = {k: getattr(self, k) for k in self._JOINT if getattr(self, k, None) is not None}
        return d

    def load_state_dict(self, d: Dict) -> bool:
        self.choice = d.get("choice", "none") if d.get("choice") in self.cands else "none"
        self.factor.update({k: float(v) for k, v in d.get("factor", {}).items() if k in self.factor})
        self.choices.update({k: int(v) for k, v in d.get("choices", {}).items() if k in self.choices})
        fx = self.cands.get("flexmoe")
        ok = fx.load_state_dict(d["flexmoe"]) if fx is not None and d.get("flexmoe") else True
        prev = {c: (Placement.from_dict(pd), float(t)) for c, (pd, t) in d.get("prev", {}).items() if c in self.cands}
        pc = d.get("prev_counts")
        if not ok or pc is None or np.shape(pc) != (self.num_ranks, self.num_experts) or \
                any(p.num_ranks != self.num_ranks or p.num_experts != self.num_experts for p, _ in prev.values()):
            return ok          # another EP size / expert count: plan afresh from the next counts
        self._prev, self._prev_counts, self.drift = prev, np.asarray(pc, dtype=np.float64), float(d.get("drift", 0.0))
        for k, v in d.get("joint", {}).items():
            if k in self._JOINT:
                setattr(self, k, dict(v) if isinstance(v, dict) else float(v))
        return ok


def choose(policies: Sequence) -> List:
    """One layer's choice over its EP groups (one ``AutoPolicy`` each, after ``propose``).

    The groups are synchronised: the iteration ends with the slowest group, so a layer's time under
    a choice is the maximum over groups, and a group that switches into FlexMoE alone pays the
    replica build on everybody's iteration while its gain counts only if it was the slowest. So the
    regime is chosen for all groups together:

    * transient: each group takes the cheapest stateless candidate (no replication, Pro-Prophet's
      transient replicas; neither keeps state, so per-group, per-iteration choices cost nothing to
      change); the regime's time is the slowest group's;
    * persistent (FlexMoE in every group): the slowest group's steady time (compute, all-to-alls,
      replica sync) + the state moves of its re-plan per interval, best effort against each rank's
      idle link time (slowest group's excess).

    Entering FlexMoE builds every replica (the same best-effort rule, once); leaving drops them
    (free), and coming back builds them again. Entering is decided as in ski rental: the advantage
    of the persistent regime (transient minus persistent time) is summed over the iterations since
    it last was not positive (``regret``), and FlexMoE is entered when that sum reaches the build's
    exposed time and the smoothed advantage (EMA, weight ``drift_ema``, from 0) is positive; or
    when this re-plan's advantage over the expected stay (``expected_stay``: ~1/drift re-plans, as
    ``price`` spreads a build) pays the build; either way only when this re-plan's advantage exceeds
    the margin (the spread of FlexMoE's realised / predicted ratio about its drift factor times the
    slowest group's base: under drift 0.5 entries predicted 2-4% ahead ran 30-60% behind).
    Entering restarts the smoothing at that advantage
    (the earlier ones priced tables the shadow has left). FlexMoE is left when the smoothed
    advantage is negative and the disadvantage summed since it last was not positive (``loss``)
    exceeds the build's share per re-plan (build / expected stay): leaving costs that rebuild
    again, so a brief dip does not. At the first re-plan (the table one FlexMoE step from plain,
    nothing built at a cost) FlexMoE is kept if it is predicted faster, or if staying pays over the
    expected stay with the table FlexMoE's planner reaches on this load (``_lookahead``). Where the
    run's end is known (``remaining`` re-plans, set by the simulator), no build is entered that the
    rest of the run could not pay back even if FlexMoE's layers took no time (remaining x transient
    time < build): ski rental alone entered at the last re-plans of short runs.
    Several layers (``policies`` a list of layers, each a list of its EP groups' policies; the
    simulator's :func:`plan_layers`): the iteration ends with the slowest group's SUM over layers,
    so one regime is chosen for all of them and every time above is the slowest group's sum. Chosen
    layer by layer, each layer priced by its own slowest group, FlexMoE was overpriced where its
    slowest group differs between layers (8192 GPUs, 2 layers, s 1.0, d 0: 95 ms priced as the sum
    of the layers' maxima against 81 ms the slowest group's sum, which is what the iteration took).
    The state of the rules lives on the first layer's first group.
    Returns each group's choice (per layer when given layers); ``force`` (a test's mutation)
    overrides it."""
    layered = len(policies) > 0 and isinstance(policies[0], (list, tuple))
    layers = [list(x) for x in policies] if layered else [list(policies)]
    p0 = layers[0][0]
    flat = [pol for lay in layers for pol in lay]

    def out(regime: List[List[str]]) -> List:
        return regime if layered else regime[0]
    if p0.force is not None:
        return out([[p0.force] * len(lay) for lay in layers])
    props = [[pol._proposal for pol in lay] for lay in layers]

    def slowest(per: List[np.ndarray]) -> float:
        """The slowest group's sum over layers of per-layer [groups] seconds (one layer: its max)."""
        return float(np.max(np.sum(per, axis=0)))

    def exposed(busy, move, iteration_s: float) -> float:
        """The slowest group's exposed state moves (``busy[l][g]``, ``move[l][g]``: per-rank link
        seconds): every layer's moves of an iteration share its idle link time, as the simulator
        charges them (one iteration lasting ``iteration_s``)."""
        return max(pol.exposed_moves_s(sum(b[g] for b in busy), sum(m[g] for m in move), iteration_s, len(layers))
                   for g, pol in enumerate(layers[0]))
    stateless = [c for c in CANDIDATES if c in p0.cands and "steady" in props[0][0][c] and "busy" not in props[0][0][c]]
    per_group = [[min((c for c in stateless if "steady" in pr[c]), key=lambda c: (pr[c]["steady"], c))
                  for pr in lp] for lp in props]
    # drift factors, per candidate: the slowest group's realised time over the slowest group's
    # predicted one, for each candidate's last plans (all are re-priced every re-plan). Over many
    # groups the maximum of noisy realisations exceeds the maximum of the predictions, more for the
    # noisier candidate, which the groups' own factors (ratios of means) do not see. Per candidate:
    # a factor learnt on Pro-Prophet's plans does not price plain EP's.
    w = p0.drift_ema
    jf = getattr(p0, "joint_factor", None) or {c: 1.0 for c in p0.cands}
    jv = getattr(p0, "joint_spread", None) or {}      # a candidate enters at its first check
    if all(pol._checked for pol in flat):
        for c in jf:
            pairs = [[pol._checked.get(c) for pol in lay] for lay in layers]
            if all(pq is not None for lay in pairs for pq in lay):
                real = slowest([np.array([r for r, _ in lay]) for lay in pairs])
                ratio = real / slowest([np.array([q for _, q in lay]) for lay in pairs])
                if c not in jv:
                    # before any miss is measured, the spread's prior is the counts' own relative
                    # change (observed drift, the largest over the groups): an EMA from 0 trusted
                    # one lucky observation (8192 GPUs, s 1.6, d 0.5: a 1.1 ms margin, FlexMoE
                    # entered and ran 1.5x its price for 8 re-plans)
                    jv[c] = max(pol.drift for pol in flat) ** 2 if p0.spread_prior else 0.0
                jv[c] = (1 - w) * jv[c] + w * (ratio - jf[c]) ** 2
                jf[c] = (1 - w) * jf[c] + w * ratio
    p0.joint_factor, p0.joint_spread = jf, jv
    t_tr = slowest([np.array([p0.scaled(pr[c]["raw"], pr[c]["base"], jf[c]) for pr, c in zip(lp, lc)])
                    for lp, lc in zip(props, per_group)])
    flex = [[pr.get("flexmoe", {}) for pr in lp] for lp in props]
    p0.last_joint = {"transient": t_tr}
    if not all("busy" in f for lf in flex for f in lf):    # no persistent candidate (or it does not fit)
        p0.adv = None
        return out(per_group)
    # every layer's state moves share the iteration's idle link time (``exposed``)
    flex_g = [np.array([p0.scaled(f["raw"], f["base"], jf["flexmoe"]) for f in lf]) for lf in flex]
    steady = slowest(flex_g)
    ops_s = exposed([[f["busy"] for f in lf] for lf in flex], [[f["move"] for f in lf] for lf in flex], steady)
    t_flex = steady + ops_s / p0.interval
    adv = t_tr - t_flex
    # how far FlexMoE's factor-corrected price has missed (its ratio's spread about the factor,
    # EMA): an entry must win by more than that (under drift 0.5 its next tables priced 2-4% under
    # the transient ran 30-60% over it; at drift 0 the spread is ~0 and nothing changes)
    margin = float(np.sqrt(jv.get("flexmoe", 0.0))) * slowest([np.array([f["base"] for f in lf]) for lf in flex]) \
        if p0.margin else 0.0
    p0.last_joint.update(flexmoe=t_flex, margin=margin)
    # the build runs while the current (transient) placement does: its idle links hide part
    build = exposed([[pr[c]["link"] for pr, c in zip(lp, lc)] for lp, lc in zip(props, per_group)],
                    [[f["build"] for f in lf] for lf in flex], t_tr)
    stay = p0.expected_stay()
    everywhere = [["flexmoe"] * len(lay) for lay in layers]
    if getattr(p0, "adv", None) is None:
        # first re-plan: nothing to smooth and no prediction checked yet; the persistent table is
        # one FlexMoE step from plain (moved in the plain iteration's idle time). Its next steps on
        # this load lower it further, moved as FlexMoE's own are, while leaving and coming back
        # costs the build: keep it if it is predicted faster now, or if the next iteration's loss
        # plus the extra steps' exposed moves is paid back over the expected stay by the table
        # they reach. (Keeping it unless the loss exceeded the rebuild was tried: FlexMoE's first
        # table runs far slower than predicted under drift, 1.17x at 8192 GPUs.)
        p0.adv, p0.loss = 0.0, 0.0
        p0.last_joint.update(build=build)
        keep = p0.choice == "flexmoe" and adv > 0
        if p0.choice == "flexmoe" and not keep and all(f.get("look") is not None for lf in flex for f in lf):
            look_g = [np.array([p0.scaled(float(f["look"][0].max()), f["base"], jf["flexmoe"]) for f in lf])
                      for lf in flex]
            lsteady = slowest(look_g)
            lmoves = exposed([[f["look"][1] for f in lf] for lf in flex], [[f["look"][2] for f in lf] for lf in flex],
                             lsteady)
            staying = -adv + lmoves / p0.interval + (stay - 1.0) * (lsteady - t_tr)
            p0.last_joint.update(lookahead=lsteady, staying=staying)
            keep = staying < 0
        return out(everywhere if keep else per_group)
    p0.adv = (1 - w) * p0.adv + w * adv
    p0.last_joint["advantage"] = p0.adv
    if p0.choice == "flexmoe":
        p0.loss = max(0.0, p0.loss - adv)
        p0.last_joint.update(build=build, loss=p0.loss)
        stay_in = p0.adv > 0 or (p0.hysteresis and p0.loss <= build / stay)
        p0.regret = 0.0
    else:
        p0.regret = max(0.0, getattr(p0, "regret", 0.0) + adv)
        p0.last_joint.update(build=build, regret=p0.regret)
        stay_in = (p0.adv > 0 and p0.regret >= build) or (p0.amortised and (adv - margin) * stay >= build)
        stay_in = stay_in and adv > margin
        # no build the rest of the run cannot pay back even if FlexMoE ran in no time
        if p0.horizon and p0.remaining is not None:
            stay_in = stay_in and p0.remaining * t_tr >= build
        if stay_in:
            p0.regret, p0.loss = 0.0, 0.0
            if p0.amortised:
                p0.adv = max(p0.adv, adv)
    return out(everywhere if stay_in else per_group)


def plan_groups(policies: Sequence[AutoPolicy], counts: Sequence[np.ndarray]) -> List[Placement]:
    """Plan one layer for all its EP groups together (:func:`choose`): the simulator's entry point,
    where every group's counts are at hand."""
    return _plan([policies], [counts])[0]


def plan_layers(layers: Sequence[Sequence[AutoPolicy]],
                counts: Sequence[Sequence[np.ndarray]]) -> List[List[Placement]]:
    """Plan every MoE layer of an iteration together (``layers[l][g]``: layer l's EP group g, with
    ``counts[l][g]``): one regime for all layers and groups (:func:`choose` with layers). The
    simulator's entry point with several layers and several EP groups."""
    return _plan(layers, counts)


def _plan(layers, counts) -> List[List[Placement]]:
    """:func:`plan_layers`' work, which :func:`plan_groups` does for one layer (the tests spy on
    the two entry points apart)."""
    if not all(pol.coordinate for lay in layers for pol in lay):
        return [[pol.plan(c) for pol, c in zip(lay, lc)] for lay, lc in zip(layers, counts)]
    for lay, lc in zip(layers, counts):
        for pol, c in zip(lay, lc):
            pol.propose(c)
    return [[pol.commit(c) for pol, c in zip(lay, lch)] for lay, lch in zip(layers, choose(layers))]


register_policy(AutoPolicy)
