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

State and rules are typed: :class:`AutoState` is one EP group's (its choice, drift factors, last
plans), :class:`RegimeState` what :func:`choose` carries for the groups it decides together (owned
by whoever groups them), :class:`AutoRules` the rules (each one can be switched off for an
ablation; the defaults are the production rules).
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np

from megatron_moe.balance.cost_model import CostModel, PlannerCost, as_planner_cost, rank_time_s
from megatron_moe.balance.policies.base import (BalancePolicy, NoBalancePolicy, Placement, default_owner, loads,
                                                make_policy, register_policy)
from megatron_moe.balance.policies.flexmoe import Priced, route_hosts, route_real, spill_traffic, sync_hosts

__all__ = ["AutoPolicy", "AutoRules", "AutoState", "RegimeState", "CANDIDATES", "choose", "plan_groups",
           "plan_layers"]

CANDIDATES = ("none", "proprophet", "flexmoe")


@dataclasses.dataclass(frozen=True)
class AutoRules:
    """How auto turns prices into a choice. The defaults are the production rules; each switch
    below turns one rule off, for the ablations that show the rule matters (the benches and tests
    build them with ``dataclasses.replace``; ``bench/auto_policy.py --auto-kwargs``)."""

    candidates: Tuple[str, ...] = CANDIDATES   # the planners asked at every re-plan
    drift_ema: float = 0.2           # weight of the newest observation in every smoothed value
    max_stay: float = 20.0           # cap of the expected stay (re-plans) a build is spread over
    moves_overlap: bool = True       # FlexMoE's state moves hide in idle link time (False: all exposed)
    coordinate: bool = True          # a layer's EP groups choose one regime together (False: alone)
    lookahead: bool = True           # the first re-plan prices the table FlexMoE converges to
    amortised: bool = True           # enter FlexMoE when one re-plan's advantage pays the build
    hysteresis: bool = True          # leave FlexMoE only when the loss exceeds the build's share
    horizon: bool = True             # no build the rest of the run cannot pay back
    joint_layers: bool = True        # the simulator chooses for all layers of an iteration at once
    factor_on_base: bool = True      # drift factors scale only the part the counts decide
    chain_build: bool = True         # a build sends each expert down a chain of its new hosts
    margin: bool = True              # an entry must beat how far FlexMoE's prices have missed
    spread_prior: bool = True        # that spread starts from the observed drift, not from 0


DEFAULT_RULES = AutoRules()


@dataclasses.dataclass
class AutoState:
    """One EP group's state between re-plans (what :meth:`AutoPolicy.state_dict` checkpoints with
    FlexMoE's shadow table and the group's :class:`RegimeState`)."""

    choice: str                                   # the candidate whose placement runs now
    factor: Dict[str, float]                      # per candidate: realised / predicted time, EMA
    choices: Dict[str, int]                       # how often each candidate was chosen
    drift: float = 0.0                            # observed ||C_j - C_{j-1}||_1 / ||C_{j-1}||_1
    # per candidate: its last plan and that plan's predicted base time (checked at the next re-plan)
    prev: Dict[str, Tuple[Placement, float]] = dataclasses.field(default_factory=dict)
    prev_counts: Optional[np.ndarray] = None      # the counts those plans were made from


@dataclasses.dataclass
class RegimeState:
    """What :func:`choose` carries between re-plans for the EP groups (and, in the simulator, the
    layers) it decides together. Whoever groups them owns it: an :class:`AutoPolicy` planning
    alone (training: one EP group per layer) its own ``regime``; the simulator one per layer, or
    one per iteration when it chooses for all layers at once."""

    joint_factor: Optional[Dict[str, float]] = None   # per candidate: the slowest group's drift factor
    joint_spread: Optional[Dict[str, float]] = None   # per candidate: EMA of that ratio's squared miss
    adv: Optional[float] = None        # smoothed advantage of FlexMoE (None: no re-plan priced it yet)
    loss: Optional[float] = None       # FlexMoE's disadvantage summed since it last was not positive
    regret: Optional[float] = None     # the advantage missed, summed since it last was not positive
    last_joint: Dict[str, float] = dataclasses.field(default_factory=dict)   # this re-plan's prices

    CHECKPOINTED = ("joint_factor", "joint_spread", "adv", "loss", "regret")


def _counts(p: Placement):
    """``p.vexperts``, or FlexMoE's count array while its lists are unbuilt (flexmoe._TablePlacement)."""
    a = p.vexperts_array() if hasattr(p, "vexperts_array") else None
    return p.vexperts if a is None else a


class AutoPolicy(BalancePolicy):
    """``planners``: keyword arguments of each candidate planner by name (Pro-Prophet's default
    ``alpha`` 1 and ``n`` 0 are training's flag defaults); ``remaining``: re-plans left in the run
    that a plan made now serves (None: unknown), set by the caller before each plan (the balance
    manager from --train-iters, the simulator from the trace's length)."""

    name = "auto"

    def __init__(self, num_experts: int, num_ranks: int, cost: Optional[CostModel] = None,
                 planner_cost: Optional[PlannerCost] = None, eq8: bool = False, interval: int = 1,
                 persistent: bool = True, memory_left_bytes: Optional[float] = None,
                 planners: Optional[Dict[str, Dict]] = None, rules: AutoRules = DEFAULT_RULES):
        super().__init__(num_experts, num_ranks)
        self.cost = cost if cost is not None else CostModel.from_profile(None)
        self.pc = planner_cost if planner_cost is not None else as_planner_cost(self.cost, num_ranks)
        self.eq8, self.interval, self.persistent = bool(eq8), max(1, int(interval)), bool(persistent)
        self.memory_left_bytes = memory_left_bytes
        self.rules = rules
        self.remaining: Optional[float] = None
        self.owner = default_owner(num_experts, num_ranks)
        self._to_owner = np.zeros((num_experts, num_ranks))
        self._to_owner[np.arange(num_experts), self.owner] = 1.0
        planners = planners or {}
        self.cands: Dict[str, BalancePolicy] = {}
        for c in rules.candidates:
            if c == "none":
                self.cands[c] = NoBalancePolicy(num_experts, num_ranks)
            elif c == "proprophet":
                kw = {"alpha": 1.0, "n": 0, **planners.get(c, {})}
                self.cands[c] = make_policy(c, num_experts, num_ranks, cost=self.cost, eq8=eq8, **kw)
            elif c == "flexmoe":
                self.cands[c] = make_policy(c, num_experts, num_ranks, cost=self.pc, **planners.get(c, {}))
            else:
                raise ValueError(f"--moe-balance-policy auto: unknown candidate {c!r}; choose from {CANDIDATES}")
        # before the first plan every placement is plain, so the persistent regime's table (plain)
        # is in sync: it starts there and grows by FlexMoE's own ops (paid as FlexMoE pays them)
        self.state = AutoState(choice="flexmoe" if "flexmoe" in self.cands and self.persistent else "none",
                               factor={c: 1.0 for c in self.cands}, choices={c: 0 for c in self.cands})
        self.regime = RegimeState()
        self.last_times: Dict[str, float] = {}
        self.last_ops: List = []
        # pricing caches, owned here (a pure cache: every value is what the uncached call returns)
        self._memo: Optional[Dict] = None      # during propose(): per-placement arrays and prices
        self._kept: Dict = {}                  # the arrays of the plans in state.prev, for the next propose()
        self._shared = None                    # (counts, FlexMoE's pricing of them on its table): run_priced
        self._flex_last = None                 # during propose(): the last FlexMoE router result (_flex_router)
        self._plain: Optional[Placement] = None    # the none candidate's placement (NoBalancePolicy's, reused)

    @property
    def choice(self) -> str:
        """The candidate whose placement runs now (the balance manager logs it)."""
        return self.state.choice

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
        """FlexMoE's pricing (``Priced``) of counts on the vExpert placement ``p`` that runs now,
        for the simulator's router. When ``p`` is the shadow table's last plan (FlexMoE chosen),
        it is that table's own ``price(counts)``, and the next :meth:`propose` of the same
        ``counts`` array steps the table from it (as the flexmoe policy shares it with its step)."""
        fx = self.cands.get("flexmoe")
        last = self.state.prev.get("flexmoe")
        if fx is not None and last is not None and last[0] is p:
            n = fx.table.counts()
            a = p.vexperts_array() if hasattr(p, "vexperts_array") else None   # (ints compare faster)
            if np.array_equal(n, a if a is not None else self.vexperts_array(p)):
                pr = fx.price(counts, n)
                self._shared = (counts, pr)
                return pr
        return Priced(counts, self.vexperts_array(p), self.pc)

    def vexperts_array(self, p: Placement) -> np.ndarray:
        """``np.asarray(p.vexperts, float64)``; free for the plans this policy proposed last (the
        simulator runs them)."""
        hit = self._kept.get(("vx", id(p)))
        return hit[1] if hit is not None and hit[0] is p else np.asarray(_counts(p), dtype=np.float64)

    # -- the cost model's price of one placement ------------------------------------------------
    def _ranks(self, counts: np.ndarray, p: Placement, priced: Optional[Priced] = None):
        """Per-rank (compute + 4 all-to-alls) seconds of ``p`` on ``counts`` (``rank_time_s``)
        and per-rank forward compute seconds. FlexMoE placements route by the real-number router
        (``priced``: FlexMoE's pricing of these counts on ``p``'s table, when at hand: its router
        entries, and the traffic its ``dispatch`` gave the simulator)."""
        return self._cached(("ranks", id(counts), self._content(p)), counts,
                            lambda: self._ranks_now(counts, p, priced))

    def _ranks_now(self, counts: np.ndarray, p: Placement, priced: Optional[Priced] = None):
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

    def _flex_router(self, counts: np.ndarray, n: np.ndarray, priced: Optional[Priced] = None):
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
                    r1 = route_hosts(counts.T[rows], nr, nr.sum(axis=1))
                    if r1 is None:
                        return None
                    i = np.flatnonzero(r1["frac_h"] > 0)
                    np.add.at(traffic.T, r1["hg"][i], r1["spill"][r1["he"][i]] * r1["frac_h"][i, None])
                    np.add.at(keep, r1["hg"], r1["keep_h"])
                return traffic, keep
        r = priced.route if priced is not None else route_hosts(counts.T, n, n.sum(axis=1))
        if r is None:
            return None
        traffic = getattr(priced, "dispatched", None)                # [src, dst]
        if traffic is None:                 # as dispatch fills the simulator's array
            traffic = np.empty((self.num_ranks, self.num_ranks))
            spill_traffic(r, traffic.T)
        keep = np.bincount(r["hg"], weights=r["keep_h"], minlength=self.num_ranks)
        self._flex_last = (counts, n, r, traffic, keep)
        return traffic, keep

    def _base(self, counts: np.ndarray, p: Placement, priced: Optional[Priced] = None) -> float:
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
        # additions; sync_hosts is sync_s_vec row by row)
        sync = self._cached(("sync", id(p)), p, lambda: np.bincount(
            g, sync_hosts(self.pc, n, e, g, np.bincount(e, minlength=self.num_experts))[e], self.num_ranks))
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
        expert with k new hosts would carry k copies on the busiest link of the iteration (its
        all-to-all's hot receiver), where almost none of the build can hide."""
        new = g != self.owner[e]
        e, g = e[new], g[new]
        if not self.rules.chain_build or len(e) == 0:
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
        return float(min(self.rules.max_stay, 1.0 / max(self.state.drift, 1.0 / self.rules.max_stay)))

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
        if not self.rules.moves_overlap:
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
            switching = self.state.choice != "flexmoe" if switching is None else switching
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
            kept = {id(p) for p, _ in self.state.prev.values()}
            self._kept = {k: v for k, v in self._memo.items() if k[0] in ("vx", "mask", "content", "sync", "hosts") and k[1] in kept}
            self._memo = self._flex_last = None

    def _propose(self, counts) -> Dict[str, float]:
        C = np.asarray(counts, dtype=np.float64)
        first = self.state.prev_counts is None
        # drift: how each candidate's previous plan priced on the counts that really came
        self._checked = {}                 # candidate -> (previous plan priced on the counts that came, as predicted)
        # FlexMoE's table priced on these counts already (run_priced: the running table, which is
        # its last plan): its router entries serve that plan's price below, its step starts from it
        sh, self._shared = self._shared, None
        shared = sh[1] if sh is not None and sh[0].dtype == C.dtype and np.array_equal(sh[0], C) else None
        if self.state.prev_counts is not None:
            self.state.drift = float(np.abs(C - self.state.prev_counts).sum() / max(1.0, self.state.prev_counts.sum()))
            for c, (p, predicted) in self.state.prev.items():
                if predicted > 0:
                    real = self._base(C, p, shared if c == "flexmoe" else None)
                    self._checked[c] = (real, predicted)
                    self.state.factor[c] = (1 - self.rules.drift_ema) * self.state.factor[c] + self.rules.drift_ema * real / predicted
        self.state.prev_counts = C.copy()
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
            self.state.prev[c] = (p, self._base(C, p))
            entry = {"placement": p, "ops": ops, "base": self.state.prev[c][1]}
            if c == "flexmoe" and self.persistent and not p.is_plain():
                switching = self.state.choice != "flexmoe"
                parts = self._flex_parts(C, p, ops, False)
                t = None
                if parts is not None:        # as price(): this group alone
                    steady, busy, move = parts
                    build = self._persistent_s(p, ops, True)[1]
                    t = self._flex_time(steady, busy, build if switching else move, switching)
                    entry.update(steady=self.scaled(float(steady.max()), entry["base"], self.state.factor[c]), busy=busy,
                                 move=move, build=build, raw=float(steady.max()))
                    if first and not switching and self.rules.lookahead:
                        entry["look"] = self._lookahead(C, pol)
            else:
                t = self.price(c, C, p, ops)
                entry["steady"], entry["raw"] = self.scaled(t, entry["base"], self.state.factor[c]), t
                entry["link"] = self._link_busy(c, C, p)
            prop[c] = entry
            if t is not None:
                raw[c] = t
                times[c] = self.scaled(t, entry["base"], self.state.factor[c])
        self._proposal = prop
        self.last_times, self.last_price = times, raw     # this group alone: scaled and unscaled
        return times

    def scaled(self, price: float, base: float, factor: float) -> float:
        """A price under a drift factor. The factor is measured on the part of a plan's time that the
        counts decide (compute and all-to-alls of the slowest rank: ``_checked``), so only that part
        is scaled; Trans/Agg and the replica sync move the same bytes whatever the counts. (Scaling
        whole prices would charge Pro-Prophet's broadcasts for drift, overpricing the transient
        regime exactly where broadcasts are a large share of it.)"""
        if not self.rules.factor_on_base:
            return price * factor
        return price + (factor - 1.0) * base

    def _lookahead(self, C: np.ndarray, pol):
        """FlexMoE's table as its own planner takes it on the load ``C``: a copy of the (shadow)
        table is stepped on ``C`` until a step makes no op (at most ``max_stay`` steps). The first
        step from plain stops early (its migrations open further Expand/Shrink pairs, so a second
        step on the same counts can lower the planner's price by a third).
        Returns (steady seconds per rank, link-busy seconds, state moves of the extra ops), as
        ``_flex_parts``; None if it does not fit the memory left."""
        look = copy.copy(pol)
        look.table = pol.table.copy()
        ops = []
        for _ in range(int(self.rules.max_stay)):
            o = look.step(C)
            if not o:
                break
            ops += o
        return self._flex_parts(C, look.placement(), ops, False)

    def commit(self, choice: str) -> Placement:
        """Adopt candidate ``choice``'s proposed placement."""
        self.state.choice = choice
        self.state.choices[choice] += 1
        entry = self._proposal[choice]
        self.last_ops = entry["ops"] if choice == "flexmoe" else []
        return entry["placement"]

    def plan(self, counts, current: Optional[Placement] = None) -> Placement:
        """Plan this EP group alone (training), with its own :class:`RegimeState`."""
        self.propose(counts)
        return self.commit(choose([self], self.regime)[0])

    def state_dict(self) -> Dict:
        """Everything the next re-plan reads: the choice, the drift factors, each candidate's last
        plan with its predicted time and the counts it was planned from (the next re-plan checks
        them), the observed drift, the regime's smoothed advantage / regret / loss and joint
        factors, and FlexMoE's shadow table. A replicated expert's gradient is summed in another
        order than plain EP's, so a resumed run continues bit-exactly only if it plans the same
        placements (tests/test_auto_policy.py: save / resume vs uninterrupted)."""
        st, fx = self.state, self.cands.get("flexmoe")
        d = {"choice": st.choice, "factor": dict(st.factor), "choices": dict(st.choices),
             "flexmoe": fx.state_dict() if fx is not None else None, "drift": st.drift,
             "prev_counts": None if st.prev_counts is None else st.prev_counts.tolist(),
             "prev": {c: [p.to_dict(), float(t)] for c, (p, t) in st.prev.items()}}
        d["joint"] = {k: getattr(self.regime, k) for k in RegimeState.CHECKPOINTED
                      if getattr(self.regime, k) is not None}
        return d

    def load_state_dict(self, d: Dict) -> bool:
        st = self.state
        st.choice = d.get("choice", "none") if d.get("choice") in self.cands else "none"
        st.factor.update({k: float(v) for k, v in d.get("factor", {}).items() if k in st.factor})
        st.choices.update({k: int(v) for k, v in d.get("choices", {}).items() if k in st.choices})
        fx = self.cands.get("flexmoe")
        ok = fx.load_state_dict(d["flexmoe"]) if fx is not None and d.get("flexmoe") else True
        prev = {c: (Placement.from_dict(pd), float(t)) for c, (pd, t) in d.get("prev", {}).items() if c in self.cands}
        pc = d.get("prev_counts")
        if not ok or pc is None or np.shape(pc) != (self.num_ranks, self.num_experts) or \
                any(p.num_ranks != self.num_ranks or p.num_experts != self.num_experts for p, _ in prev.values()):
            return ok          # another EP size / expert count: plan afresh from the next counts
        st.prev, st.prev_counts, st.drift = prev, np.asarray(pc, dtype=np.float64), float(d.get("drift", 0.0))
        for k, v in d.get("joint", {}).items():
            if k in RegimeState.CHECKPOINTED:
                setattr(self.regime, k, dict(v) if isinstance(v, dict) else float(v))
        return ok


class _Groups:
    """The EP groups one :func:`choose` decides over, after their ``propose``: ``layers[l][g]`` is
    layer l's group g (one layer unless the simulator chooses for all layers at once). The groups
    share their settings (rules, interval, cost model), which are read from the first."""

    def __init__(self, layers: List[List[AutoPolicy]]):
        self.layers = layers
        self.lead = layers[0][0]
        self.flat = [pol for lay in layers for pol in lay]
        self.props = [[pol._proposal for pol in lay] for lay in layers]

    @staticmethod
    def slowest(per: List[np.ndarray]) -> float:
        """The slowest group's sum over layers of per-layer [groups] seconds (one layer: its max)."""
        return float(np.max(np.sum(per, axis=0)))

    def exposed(self, busy, move, iteration_s: float) -> float:
        """The slowest group's exposed state moves (``busy[l][g]``, ``move[l][g]``: per-rank link
        seconds): every layer's moves of an iteration share its idle link time, as the simulator
        charges them (one iteration lasting ``iteration_s``)."""
        return max(pol.exposed_moves_s(sum(b[g] for b in busy), sum(m[g] for m in move), iteration_s,
                                       len(self.layers))
                   for g, pol in enumerate(self.layers[0]))

    def everywhere(self, choice: str) -> List[List[str]]:
        return [[choice] * len(lay) for lay in self.layers]


class _Persistent(NamedTuple):
    """The persistent regime (FlexMoE in every group) at this re-plan."""
    flex: List[List[Dict]]     # each group's FlexMoE proposal, per layer
    time: float                # the slowest group's time: steady + its ops' exposed moves per interval
    advantage: float           # the transient regime's time minus ``time``
    margin: float              # how far FlexMoE's prices have missed (an entry must beat it)
    build: float               # exposed seconds of building every replica now, during the transient


def choose(policies: Sequence, regime: RegimeState) -> List:
    """One layer's choice over its EP groups (one ``AutoPolicy`` each, after ``propose``), with
    the ``regime`` state they share.

    The groups are synchronised: the iteration ends with the slowest group, so a layer's time under
    a choice is the maximum over groups, and a group that switches into FlexMoE alone pays the
    replica build on everybody's iteration while its gain counts only if it was the slowest. So the
    regime is chosen for all groups together, in four steps:

    1. the drift factors per candidate (:func:`_update_factors`);
    2. the transient regime (:func:`_transient`): each group takes the cheapest stateless
       candidate (no replication, Pro-Prophet's transient replicas; neither keeps state, so
       per-group, per-iteration choices cost nothing to change); its time is the slowest group's;
    3. the persistent regime (:func:`_persistent`, FlexMoE in every group): the slowest group's
       steady time (compute, all-to-alls, replica sync) + the state moves of its re-plan per
       interval, best effort against each rank's idle link time; and what building it would cost;
    4. the switch: at the first re-plan :func:`_keep_first_table`, later :func:`_persistent_wins`.

    Entering FlexMoE builds every replica; leaving drops them (free), and coming back builds them
    again. Several layers (``policies`` a list of layers, each a list of its EP groups' policies;
    the simulator's :func:`plan_layers`): the iteration ends with the slowest group's SUM over
    layers, so one regime is chosen for all of them and every time above is the slowest group's
    sum. Chosen layer by layer, each layer priced by its own slowest group, FlexMoE would be
    overpriced wherever its slowest group differs between layers (the sum of the layers' maxima
    exceeds the slowest group's sum, which is what the iteration takes). Returns each group's
    choice (per layer when given layers)."""
    layered = len(policies) > 0 and isinstance(policies[0], (list, tuple))
    groups = _Groups([list(x) for x in policies] if layered else [list(policies)])
    _update_factors(groups, regime)
    per_group, t_tr = _transient(groups, regime)
    regime.last_joint = {"transient": t_tr}
    pers = _persistent(groups, regime, per_group, t_tr)
    if pers is None:                   # no persistent candidate (or it does not fit)
        regime.adv = None
        out = per_group
    elif regime.adv is None:
        out = groups.everywhere("flexmoe") if _keep_first_table(groups, regime, pers, t_tr) else per_group
    else:
        out = groups.everywhere("flexmoe") if _persistent_wins(groups, regime, pers, t_tr) else per_group
    return out if layered else out[0]


def _update_factors(groups: _Groups, regime: RegimeState) -> None:
    """Drift factors, per candidate: the slowest group's realised time over the slowest group's
    predicted one, for each candidate's last plans (all are re-priced every re-plan). Over many
    groups the maximum of noisy realisations exceeds the maximum of the predictions, more for the
    noisier candidate, which the groups' own factors (ratios of means) do not see. Per candidate:
    a factor learnt on Pro-Prophet's plans does not price plain EP's. With each factor, the spread
    of its ratio about it (EMA of the squared miss): the entry margin."""
    lead, w = groups.lead, groups.lead.rules.drift_ema
    jf = regime.joint_factor or {c: 1.0 for c in lead.cands}
    jv = regime.joint_spread or {}      # a candidate enters at its first check
    if all(pol._checked for pol in groups.flat):
        for c in jf:
            pairs = [[pol._checked.get(c) for pol in lay] for lay in groups.layers]
            if all(pq is not None for lay in pairs for pq in lay):
                real = groups.slowest([np.array([r for r, _ in lay]) for lay in pairs])
                ratio = real / groups.slowest([np.array([q for _, q in lay]) for lay in pairs])
                if c not in jv:
                    # before any miss is measured, the spread's prior is the counts' own relative
                    # change (observed drift, the largest over the groups): an EMA from 0 would
                    # trust one lucky observation, and a table planned on the last counts has no
                    # better claim on these than their own change
                    jv[c] = max(pol.state.drift for pol in groups.flat) ** 2 if lead.rules.spread_prior else 0.0
                jv[c] = (1 - w) * jv[c] + w * (ratio - jf[c]) ** 2
                jf[c] = (1 - w) * jf[c] + w * ratio
    regime.joint_factor, regime.joint_spread = jf, jv


def _transient(groups: _Groups, regime: RegimeState):
    """(each group's cheapest stateless candidate per layer, the transient regime's time: the
    slowest group's, each price under its candidate's layer factor)."""
    lead, jf = groups.lead, regime.joint_factor
    first = groups.props[0][0]
    stateless = [c for c in CANDIDATES if c in lead.cands and "steady" in first[c] and "busy" not in first[c]]
    per_group = [[min((c for c in stateless if "steady" in pr[c]), key=lambda c: (pr[c]["steady"], c))
                  for pr in lp] for lp in groups.props]
    t_tr = groups.slowest([np.array([lead.scaled(pr[c]["raw"], pr[c]["base"], jf[c]) for pr, c in zip(lp, lc)])
                           for lp, lc in zip(groups.props, per_group)])
    return per_group, t_tr


def _persistent(groups: _Groups, regime: RegimeState, per_group, t_tr: float) -> Optional[_Persistent]:
    """The persistent regime's time, advantage, entry margin and build; None if a group has no
    FlexMoE proposal that fits."""
    flex = [[pr.get("flexmoe", {}) for pr in lp] for lp in groups.props]
    if not all("busy" in f for lf in flex for f in lf):
        return None
    lead, jf, jv = groups.lead, regime.joint_factor, regime.joint_spread
    # every layer's state moves share the iteration's idle link time (``exposed``)
    steady = groups.slowest([np.array([lead.scaled(f["raw"], f["base"], jf["flexmoe"]) for f in lf])
                             for lf in flex])
    ops_s = groups.exposed([[f["busy"] for f in lf] for lf in flex], [[f["move"] for f in lf] for lf in flex],
                           steady)
    t_flex = steady + ops_s / lead.interval
    # how far FlexMoE's factor-corrected price has missed (its ratio's spread about the factor,
    # EMA): an entry must win by more than that (under heavy drift a table priced a few percent
    # under the transient can run far over it; at drift 0 the spread is ~0 and nothing changes)
    margin = float(np.sqrt(jv.get("flexmoe", 0.0))) * \
        groups.slowest([np.array([f["base"] for f in lf]) for lf in flex]) if lead.rules.margin else 0.0
    regime.last_joint.update(flexmoe=t_flex, margin=margin)
    # the build runs while the current (transient) placement does: its idle links hide part
    build = groups.exposed([[pr[c]["link"] for pr, c in zip(lp, lc)] for lp, lc in zip(groups.props, per_group)],
                           [[f["build"] for f in lf] for lf in flex], t_tr)
    return _Persistent(flex, t_flex, t_tr - t_flex, margin, build)


def _keep_first_table(groups: _Groups, regime: RegimeState, pers: _Persistent, t_tr: float) -> bool:
    """The first re-plan: nothing to smooth and no prediction checked yet; the persistent table is
    one FlexMoE step from plain (moved in the plain iteration's idle time). Its next steps on this
    load lower it further, moved as FlexMoE's own are, while leaving and coming back costs the
    build: keep it if it is predicted faster now, or if the next iteration's loss plus the extra
    steps' exposed moves is paid back over the expected stay by the table they reach (the
    lookahead). (It is not kept merely because leaving would cost a rebuild: under drift FlexMoE's
    first table runs far slower than predicted.)"""
    lead = groups.lead
    regime.adv, regime.loss = 0.0, 0.0
    regime.last_joint.update(build=pers.build)
    in_flex = lead.state.choice == "flexmoe"
    keep = in_flex and pers.advantage > 0
    if in_flex and not keep and all(f.get("look") is not None for lf in pers.flex for f in lf):
        look_g = [np.array([lead.scaled(float(f["look"][0].max()), f["base"], regime.joint_factor["flexmoe"])
                            for f in lf]) for lf in pers.flex]
        lsteady = groups.slowest(look_g)
        lmoves = groups.exposed([[f["look"][1] for f in lf] for lf in pers.flex],
                                [[f["look"][2] for f in lf] for lf in pers.flex], lsteady)
        staying = -pers.advantage + lmoves / lead.interval + (lead.expected_stay() - 1.0) * (lsteady - t_tr)
        regime.last_joint.update(lookahead=lsteady, staying=staying)
        keep = staying < 0
    return keep


def _persistent_wins(groups: _Groups, regime: RegimeState, pers: _Persistent, t_tr: float) -> bool:
    """Later re-plans: stay in, leave, or enter FlexMoE.

    In FlexMoE, it is left when the smoothed advantage (EMA, from 0) is negative and the
    disadvantage summed since it last was not positive (``loss``) exceeds the build's share per
    re-plan (build / expected stay): leaving costs that rebuild again, so a brief dip does not.

    Outside, entering is decided as in ski rental: the advantage summed over the re-plans since it
    last was not positive (``regret``) reaches the build's exposed time and the smoothed advantage
    is positive; or this re-plan's advantage over the expected stay (~1/drift re-plans, as
    ``price`` spreads a build) pays the build; either way only when this re-plan's advantage
    exceeds the margin (under heavy drift a small predicted lead is noise). Where the
    run's end is known (``remaining`` re-plans), no build is entered that the rest of the run could
    not pay back even if FlexMoE's layers took no time (remaining x transient time < build): ski
    rental alone entered at the last re-plans of short runs. Entering restarts the smoothing at
    that advantage (the earlier ones priced tables the shadow has left)."""
    lead = groups.lead
    rules, w, adv, build = lead.rules, lead.rules.drift_ema, pers.advantage, pers.build
    stay = lead.expected_stay()
    regime.adv = (1 - w) * regime.adv + w * adv
    regime.last_joint["advantage"] = regime.adv
    if lead.state.choice == "flexmoe":
        regime.loss = max(0.0, regime.loss - adv)
        regime.last_joint.update(build=build, loss=regime.loss)
        regime.regret = 0.0
        return regime.adv > 0 or (rules.hysteresis and regime.loss <= build / stay)
    regime.regret = max(0.0, (regime.regret or 0.0) + adv)
    regime.last_joint.update(build=build, regret=regime.regret)
    enter = (regime.adv > 0 and regime.regret >= build) or (rules.amortised and (adv - pers.margin) * stay >= build)
    enter = enter and adv > pers.margin
    if rules.horizon and lead.remaining is not None:
        enter = enter and lead.remaining * t_tr >= build
    if enter:
        regime.regret, regime.loss = 0.0, 0.0
        if rules.amortised:
            regime.adv = max(regime.adv, adv)
    return enter


def plan_groups(policies: Sequence[AutoPolicy], counts: Sequence[np.ndarray], regime: RegimeState) -> List[Placement]:
    """Plan one layer for all its EP groups together (:func:`choose`, with the layer's ``regime``):
    the simulator's entry point, where every group's counts are at hand."""
    return _plan([policies], [counts], regime)[0]


def plan_layers(layers: Sequence[Sequence[AutoPolicy]], counts: Sequence[Sequence[np.ndarray]],
                regime: RegimeState) -> List[List[Placement]]:
    """Plan every MoE layer of an iteration together (``layers[l][g]``: layer l's EP group g, with
    ``counts[l][g]``): one regime for all layers and groups (:func:`choose` with layers). The
    simulator's entry point with several layers and several EP groups."""
    return _plan(layers, counts, regime)


def _plan(layers, counts, regime: RegimeState) -> List[List[Placement]]:
    """:func:`plan_layers`' work, which :func:`plan_groups` does for one layer (the tests spy on
    the two entry points apart). Without coordination (an ablation) every group plans alone."""
    if not all(pol.rules.coordinate for lay in layers for pol in lay):
        return [[pol.plan(c) for pol, c in zip(lay, lc)] for lay, lc in zip(layers, counts)]
    for lay, lc in zip(layers, counts):
        for pol, c in zip(lay, lc):
            pol.propose(c)
    return [[pol.commit(c) for pol, c in zip(lay, lch)] for lay, lch in zip(layers, choose(layers, regime))]


register_policy(AutoPolicy)
