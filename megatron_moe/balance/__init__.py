"""Load balancing by lightweight expert replication (Pro-Prophet). See docs/balance.md.

A feature (megatron_moe/features.py): its flags, checks, spec edit and run hooks; the run calls

    spec = balance.customize_spec(args, spec)          # the replica placement into the MoE layer spec
    mgr = balance.run_hooks(args, model_chunks, optimizer)  # a BalanceManager, after the model is built
    ... forward/backward of all micro-batches ...
    mgr.set_optimizer(optimizer)                       # FlexMoE persistent replicas (else transient)
    mgr.before_finalize_grads()                        # Agg: before finalize_model_grads / clip / step
    mgr.after_finalize_grads()                         # persistent: finalised grads back to the replicas
    ok, grad_norm, _ = optimizer.step()
    mgr.after_optimizer_step(ok, grad_norm)            # persistent: the same update on every replica
    mgr.after_step(iteration)                          # stats, next plan, trace files
    log.update(mgr.metrics())
    ckpt["balance"] = mgr.state_dict(); mgr.load_state_dict(ckpt["balance"])
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Dict, List, Optional

import numpy as np

from megatron_moe.flags.exclusions import Exclusion, te_grouped_gemm

__all__ = ["add_arguments", "validate_args", "setting", "EXCLUDES", "install", "customize_spec",
           "run_hooks", "BalanceManager"]

_DEFAULTS = dict(moe_balance_policy="none", moe_balance_alpha=1.0, moe_balance_n=0, moe_balance_interval=1,
                 moe_balance_overlap=False, moe_balance_profile=None, moe_balance_predictor="last",
                 moe_routing_trace_dir=None, moe_flexmoe_replicas="persistent")


def _with_defaults(args):
    """Tolerate an args namespace built without ``add_arguments`` (the flags' defaults apply)."""
    for k, v in _DEFAULTS.items():
        if not hasattr(args, k):
            setattr(args, k, v)
    return args


def add_arguments(parser):
    g = parser.add_argument_group("MoE load balancing (Pro-Prophet)")
    g.add_argument("--moe-balance-policy", choices=["none", "proprophet", "fastermoe", "flexmoe", "auto"],
                   default="none",
                   help="Placement policy: none = plain expert parallelism; proprophet (planned "
                        "lightweight replicas), fastermoe (dynamic shadowing), flexmoe (vExperts with "
                        "the flexible token router; persistent replicas, see --moe-flexmoe-replicas "
                        "and docs/balance.md); auto (per layer and re-plan the cost model picks none, "
                        "proprophet or flexmoe; the choice is in the [moe] log line).")
    g.add_argument("--moe-balance-alpha", type=float, default=1.0,
                   help="Balance tolerance alpha of Eq. 7: stop the search when max H - min H < alpha*I/E "
                        "(default 1.0; the paper artifact hard-codes 3, which never triggers for few experts).")
    g.add_argument("--moe-balance-n", type=_balance_n, default=0,
                   help="Ranks a selected expert is NOT replicated to (0 = all ranks get a replica), or "
                        "'cost': per replicated expert the planner picks n = D-k, k in {D, D/2, ..., 2}, "
                        "by the Eq. 6/8 cost (its k heaviest senders keep a replica; docs/balance.md).")
    g.add_argument("--moe-balance-interval", type=int, default=1, help="Re-plan every N iterations.")
    g.add_argument("--moe-balance-overlap", action="store_true",
                   help="Block-wise scheduler (next iteration planned under the dispatch all-to-all, "
                        "Trans in two pieces and Agg overlapped) and the Eq. 8 cost model.")
    g.add_argument("--moe-balance-profile", type=str, default=None,
                   help="Calibration JSON (tools/calibrate_balance.py); default: documented constants.")
    g.add_argument("--moe-balance-predictor", choices=["last", "ema"], default="last",
                   help="Locality predictor of the next iteration's routing.")
    g.add_argument("--moe-flexmoe-replicas", choices=["persistent", "transient"], default="persistent",
                   help="flexmoe: persistent = a replica keeps its weights and its own optimizer state "
                        "across iterations (params + state move only when the placement changes; grads "
                        "summed over the replica group, every member applies the same update); transient "
                        "= parameters sent from the owner every iteration, as proprophet. Persistent "
                        "needs the non-distributed fp32 optimizer; otherwise transient with a log line.")
    g.add_argument("--moe-routing-trace-dir", type=str, default=None,
                   help="Write per-layer/iteration count matrices (JSON lines) here.")
    return parser


def _balance_n(text):
    """``--moe-balance-n``: an integer >= 0 or ``cost`` (argparse reports the one-line error)."""
    if text == "cost":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--moe-balance-n {text!r}: must be an integer >= 0 or 'cost'") from None


def _check_args(args):
    _with_defaults(args)
    if args.moe_balance_interval < 1:
        raise ValueError(f"--moe-balance-interval {args.moe_balance_interval}: must be >= 1")
    if args.moe_balance_alpha < 0:
        raise ValueError(f"--moe-balance-alpha {args.moe_balance_alpha}: must be >= 0")
    from megatron_moe.balance.policies.proprophet import check_n
    check_n(args.moe_balance_n)


def validate_args(args):
    """Parse-time checks of the flags' ranges (arguments.parse_args, before any process group);
    what the balanced layer cannot run with is ``EXCLUDES`` (megatron_moe/features.py checks it)."""
    _check_args(args)


def setting(args):
    """``--moe-balance-policy X`` (or ``--moe-routing-trace-dir``) when the balanced layer is on."""
    policy = args.moe_balance_policy
    if not getattr(args, "num_experts", None) or (policy == "none" and not args.moe_routing_trace_dir):
        return None
    return f"--moe-balance-policy {policy}" if policy != "none" else "--moe-routing-trace-dir"


_WHOLE_TOKENS = "the balanced layer exchanges whole tokens over the expert-parallel group"
_OWN_EXCHANGE = "the balanced layer needs its own token exchange over whole expert inputs"
# the configurations the balanced layer cannot run, which it would otherwise hand silently to the
# stock layer
EXCLUDES = (
    Exclusion("--tensor-model-parallel-size", _WHOLE_TOKENS, needs_one=True),
    Exclusion("--expert-tensor-parallel-size", _WHOLE_TOKENS, needs_one=True),
    # on the local path the grouped experts run the replicas as extra groups; TE's TEGroupedMLP cannot
    Exclusion("--moe-grouped-gemm", "on Transformer Engine (TEGroupedMLP); --transformer-impl local "
              "runs the replicas as extra groups", is_set=te_grouped_gemm),
    Exclusion("--moe-pad-expert-input-to-capacity", _OWN_EXCHANGE),
    Exclusion("--moe-shared-expert-overlap", _OWN_EXCHANGE),
    Exclusion("--moe-latent-size", _OWN_EXCHANGE),
    Exclusion("--mtp-num-layers", "the balancer keys its plans by layer number; megatron-core "
              "numbers the MTP layer's inner layer from 1"),
    # megatron-core's overlapped 1F1B schedule runs the dispatch and combine stages on its
    # communication stream against another micro-batch's compute; the placement's stages plan on
    # the host and issue Trans / Agg there, which nothing here has checked on CUDA streams
    Exclusion("--overlap-moe-expert-parallel-comm", "the balanced layer's stages have not been "
              "checked under megatron-core's overlapped 1F1B schedule"),
    # a recomputed layer would run its placement twice per micro-batch: counts, Trans and the
    # scheduler's per-layer points are once-per-forward
    Exclusion("--recompute-modules", "moe: the balanced layer's plan and statistics run once per "
              "forward", is_set=lambda args: "moe" in (getattr(args, "recompute_modules", None) or ())),
    Exclusion("--moe-layer-recompute", "the balanced layer's plan and statistics run once per "
              "forward"),
)


def install(args, layer_spec, force: bool = False):
    """Inject the replica placement into every MoE layer of a GPT layer spec (0.16.x ModuleSpec or a
    TransformerBlockSubmodules with ``layer_specs``): megatron_moe.moe.layer.MoELayer with
    ``placement=ReplicaPlacement()`` and the exchange chosen by the flags. A no-op with policy none and
    no trace dir unless ``force``."""
    _check_args(args)
    if not force and args.moe_balance_policy == "none" and not args.moe_routing_trace_dir:
        return layer_spec
    from megatron_moe.balance.layer import ReplicaPlacement
    from megatron_moe.moe.dispatcher import exchange_from_args
    from megatron_moe.moe.layer import use_layer

    return use_layer(layer_spec, f"--moe-balance-policy {args.moe_balance_policy}",
                     exchange=exchange_from_args(args), placement=ReplicaPlacement())


def customize_spec(args, spec):
    """The feature's spec edit (megatron_moe/features.py)."""
    if not getattr(args, "num_experts", None):
        return spec
    return install(args, spec)


def run_hooks(args, model, optimizer=None, tracker=None):
    """The feature's part of the training step (megatron_moe/features.py): a BalanceManager for
    every MoE model (it also writes routing traces and statistics with policy none)."""
    if not getattr(args, "num_experts", None):
        return None
    manager = BalanceManager(args, model, tracker=tracker)
    if optimizer is not None:
        manager.set_optimizer(optimizer)
    return manager


class BalanceManager:
    """Owns the stats, the policy, the scheduler and the trace writer for every balanced MoE layer."""

    def __init__(self, args, model_chunks, num_microbatches: Optional[int] = None, log=None, tracker=None):
        # ``tracker`` (the lead's ExpertLoadTracker) is accepted but not needed: the layer all-gathers
        # the [D x E] counts itself, since its all-to-all needs them anyway.
        import torch.distributed as dist

        from megatron_moe.balance.cost_model import CostModel
        from megatron_moe.balance.policies.base import make_policy
        from megatron_moe.balance.scheduler import BalanceScheduler, EventLog
        from megatron_moe.balance.stats import RoutingStats

        _check_args(args)
        self.args = args
        chunks = model_chunks if isinstance(model_chunks, (list, tuple)) else [model_chunks]
        from megatron_moe.moe.layer import MoELayer

        layers = [m for c in chunks for m in c.modules()
                  if isinstance(m, MoELayer) and m.placement is not None]
        if args.moe_balance_policy != "none":
            bad = [m.layer_number for m in layers if m.balance is None]
            if bad:
                raise ValueError(f"--moe-balance-policy {args.moe_balance_policy}: MoE layers {bad} are "
                                 "unsupported (needs TP=1, expert TP=1, SequentialMLP, no latent MoE, no shared-expert overlap, no pad-to-capacity)")
        self.layers = [m for m in layers if m.balance is not None]
        if args.moe_balance_policy != "none" and self.layers:
            # Agg adds replica grads into the owners' main_grad: a bucket already reduced over the
            # expert-data-parallel group by overlapped DDP would miss them
            overlapped = any(getattr(getattr(c, "ddp_config", None), "overlap_grad_reduce", False) for c in chunks)
            try:
                from megatron.core import parallel_state

                edp = parallel_state.get_expert_data_parallel_world_size()
            except Exception:
                edp = 1
            if overlapped and edp > 1:
                raise ValueError(f"--moe-balance-policy {args.moe_balance_policy} with --overlap-grad-reduce "
                                 f"and expert-data-parallel size {edp}: replica gradients would miss the "
                                 "overlapped expert-grad reduction; drop --overlap-grad-reduce")
        self.log = log if log is not None else EventLog(enabled=False)
        self.scheduler = BalanceScheduler(overlap=bool(args.moe_balance_overlap), log=self.log)
        # Plan ahead (scheduler on): the next plan runs under the dispatch all-to-all of the last
        # micro-batch; tests turn it off to compare with the sequential plan in after_step
        self.plan_ahead = bool(args.moe_balance_overlap)
        self.scheduler.planner = self._plan_ahead
        self._next_iteration: Optional[int] = None   # after_step's next iteration number, once known
        if num_microbatches is None and getattr(args, "num_microbatches", None):
            num_microbatches = args.num_microbatches
        if num_microbatches is None:
            mb, gb = getattr(args, "micro_batch_size", None), getattr(args, "global_batch_size", None)
            dp = getattr(args, "data_parallel_size", None)
            num_microbatches = gb // (mb * dp) if mb and gb and dp else 1
        self.scheduler.num_microbatches = int(num_microbatches)
        for m in self.layers:
            m.balance.layer_number = m.layer_number
            m.balance.log = self.log
            self.scheduler.register(m.balance)
        self.stats = RoutingStats(predictor=getattr(args, "moe_balance_predictor", "last"))
        self.policy = None
        self.policies = {}
        self.metrics_: Dict[str, float] = {}
        if self.layers:
            st = self.layers[0].balance
            cfg = self.layers[0].config
            elem = 4 if cfg.params_dtype is None else (2 if "16" in str(cfg.params_dtype) else
                                                        8 if "64" in str(cfg.params_dtype) else 4)
            self.cost = CostModel.from_profile(args.moe_balance_profile, input_bytes=cfg.hidden_size * elem,
                                               expert_bytes=st.numel * elem)
            self.scheduler.cost = self.cost          # Trans split: static t_fnec vs per-expert Trans time
            kw = {"cost": self.cost}
            proprophet = dict(alpha=args.moe_balance_alpha, n=args.moe_balance_n)
            if args.moe_balance_policy == "proprophet":
                kw.update(proprophet, eq8=bool(args.moe_balance_overlap))
            if args.moe_balance_policy == "auto":
                # persistent replicas are switched on for the whole manager (flexmoe only), so under
                # auto a FlexMoE placement runs with transient replicas and is priced that way
                kw.update(eq8=bool(args.moe_balance_overlap), interval=args.moe_balance_interval,
                          persistent=False, planners={"proprophet": proprophet})
            # one policy per layer: stateful policies (flexmoe's slot table) keep per-layer state
            self.policies = {m.balance.layer_number: make_policy(args.moe_balance_policy,
                                                                 st.num_experts, st.D, **kw)
                             for m in self.layers}
            self.policy = self.policies[st.layer_number]
        # FlexMoE persistent replicas: requested here, switched on by set_optimizer (it needs the
        # megatron-core optimizer); any other configuration runs transient replicas
        self.replica_mode = "transient"
        self.replica_fallback: Optional[str] = None
        self.persistent_requested = (args.moe_balance_policy == "flexmoe" and bool(self.layers)
                                     and args.moe_flexmoe_replicas == "persistent")
        if self.persistent_requested:
            self.replica_fallback = _persistent_unsupported(args)
            if self.replica_fallback:
                _log_rank0(f"> balance: flexmoe replicas transient: {self.replica_fallback}")
        self._totals_prev: Dict[str, float] = {}
        self.op_counts = {"expand": 0, "shrink": 0, "migrate": 0}
        self.trace_path = None
        if args.moe_routing_trace_dir and self.layers and self.layers[0].balance.rank == 0:
            os.makedirs(args.moe_routing_trace_dir, exist_ok=True)
            g = dist.get_rank() if dist.is_initialized() else 0
            self.trace_path = os.path.join(args.moe_routing_trace_dir, f"counts_rank{g:05d}.jsonl")

    # -- persistent replicas (FlexMoE) --------------------------------------------------------------
    def set_optimizer(self, optimizer) -> str:
        """Hand the megatron-core optimizer over; with ``--moe-flexmoe-replicas persistent`` (flexmoe)
        and a non-distributed fp32 optimizer the layers switch to persistent replicas. Returns the
        replica mode."""
        if not self.persistent_requested or self.replica_fallback:
            return self.replica_mode
        lookup, reason = _optimizer_lookup(optimizer)
        if reason is None and any(getattr(m.balance.experts, "single_names", ()) for m in self.layers):
            # a persistent replica copies its owner's optimizer state per expert parameter
            reason = ("--moe-single-grouped-weight: one parameter and optimizer state hold all of "
                      "a layer's experts")
        if reason is None:
            missing = [m.balance.layer_number for m in self.layers
                       if any(p not in lookup for p in m.balance._ref_params())]
            if missing:
                reason = f"expert params of MoE layers {missing} are not in the optimizer"
        if reason is not None:
            self.replica_fallback = reason
            _log_rank0(f"> balance: flexmoe replicas transient: {reason}")
            return self.replica_mode
        self.replica_mode = "persistent"
        for m in self.layers:
            m.balance.optim_lookup = lookup
            if m.balance.mode != "persistent":
                m.balance.mode = "persistent"
                m.balance.invalidate_replicas()    # built from the owners at the next forward
        return self.replica_mode

    def before_finalize_grads(self) -> None:
        """Agg: every replica gradient summed into its owner's grad (call before finalize_model_grads)."""
        self.scheduler.finish_agg()

    def after_finalize_grads(self) -> None:
        """Persistent replicas: the owners' finalised gradients go to their replicas (issued here,
        waited in ``after_optimizer_step``, so the owner's step overlaps the transfer)."""
        for m in self.layers:
            m.balance.issue_sumback(self.scheduler.iteration)

    def after_optimizer_step(self, update_successful: bool, grad_norm) -> None:
        """Persistent replicas: right after megatron-core's ``optimizer.step()`` (before the lr
        scheduler steps): every replica applies the owner's update (skipped if the step was)."""
        for m in self.layers:
            m.balance.step_replicas(bool(update_successful), grad_norm)

    def _set_horizon(self, policy, iteration: int) -> None:
        """auto's horizon rule: the re-plans a plan made after ``iteration`` serves (as the
        simulator sets it; unknown when the run is sized by --train-samples)."""
        total = getattr(self.args, "train_iters", None)
        if hasattr(policy, "remaining") and total:
            policy.remaining = max(0, int(total) - int(iteration)) / self.args.moe_balance_interval

    def _replan_expected(self) -> bool:
        k = self.args.moe_balance_interval
        return k == 1 or (self._next_iteration is not None and self._next_iteration % k == 0)

    def _plan_ahead(self, st) -> None:
        """Scheduler callback under the dispatch all-to-all: once this iteration's counts of the layer
        are complete (last training micro-batch), plan iteration j+1 exactly as ``after_step`` would."""
        policy = self.policies.get(st.layer_number)
        if (not self.plan_ahead or policy is None or st.train_forwards != self.scheduler.num_microbatches
                or st.plan_ahead is not None or not self._replan_expected()):
            return
        it = self.scheduler.iteration
        C = st.counts.numpy().copy()
        self.log.record("plan_start", st.layer_number, it)
        self._set_horizon(policy, it + 1)  # after_step's iteration: the one these counts complete
        placement = policy.plan(self.stats.peek(st.layer_number, C), st._active_placement)
        st.plan_ahead = (it, C, placement)
        self.log.record("plan", st.layer_number, it)

    def after_step(self, iteration: int) -> None:
        """After the optimizer step: record counts, plan the next placement (or apply the plan made
        under the all-to-all), write the trace."""
        from megatron_moe.balance.stats import imbalance

        replan = iteration % self.args.moe_balance_interval == 0
        self._next_iteration = int(iteration) + 1
        rows, before, after, rmm0, rmm1, replicated = [], [], [], [], [], 0
        for m in self.layers:
            st = m.balance
            C = st.counts.numpy().copy()
            st.counts.zero_()
            ahead, st.plan_ahead = st.plan_ahead, None
            if C.sum() == 0:
                continue
            used = st._active_placement
            fig = imbalance(C, used)
            before.append(fig["balance_before"]); after.append(fig["balance_after"])
            rmm0.append(fig["rank_max_over_mean"]); rmm1.append(fig["rank_max_over_mean_after"])
            replicated += len(used.replicated())
            self.stats.add(st.layer_number, iteration, C)
            if self.trace_path:
                row = {"iteration": int(iteration), "layer": int(st.layer_number),
                       "counts": C.astype(np.int64).tolist(), "placement": used.to_plan()}
                if used.vexperts is not None:      # FlexMoE: the router's slot counts [E][D]
                    row["vexperts"] = [list(map(int, r)) for r in used.vexperts]
                rows.append(row)
            if replan and st.layer_number in self.policies:
                if ahead is not None and ahead[0] == self.scheduler.iteration and np.array_equal(ahead[1], C):
                    st.placement = ahead[2]              # same inputs, same deterministic planner
                    self.log.record("plan_apply", st.layer_number, self.scheduler.iteration)
                else:
                    policy = self.policies[st.layer_number]
                    self._set_horizon(policy, iteration)
                    st.placement = policy.plan(self.stats.predict(st.layer_number), used)
                    self.log.record("plan", st.layer_number, self.scheduler.iteration)
                for op in getattr(self.policies[st.layer_number], "last_ops", None) or []:
                    if op[0] in self.op_counts:
                        self.op_counts[op[0]] += 1
        for m in self.layers:
            st = m.balance
            if st.mode == "persistent" and st.agg_issued and st.trans_issued and not st.replicas_stepped:
                # the loop skipped after_finalize_grads/after_optimizer_step: the replicas missed this
                # update, so they are rebuilt from the owners (same decision on every rank)
                st.invalidate_replicas()
        totals = self._replica_totals()
        delta = {k: v - self._totals_prev.get(k, 0.0) for k, v in totals.items()}
        self._totals_prev = totals
        self.scheduler.end_iteration()
        if rows:
            with open(self.trace_path, "a") as f:
                for r in rows:
                    f.write(json.dumps(r) + "\n")
        if before:
            self.metrics_ = {
                "balance/std_before": float(np.mean(before)), "balance/std_after": float(np.mean(after)),
                "balance/rank_max_over_mean_before": float(np.mean(rmm0)),
                "balance/rank_max_over_mean_after": float(np.mean(rmm1)),
                "balance/replicated_experts": float(replicated),
                "balance/trans_bytes": float(sum(m.balance.bytes_trans_sent for m in self.layers)),
            }
        if self.layers:
            # this iteration, sent by this rank: replica upkeep (transient: Trans of the parameters;
            # persistent: params + optimizer state for new replicas) and gradient sync (Agg, and for
            # persistent the finalised grads back to the replicas)
            self.metrics_.update({
                "balance/replicas_persistent": float(self.replica_mode == "persistent"),
                "balance/replica_upkeep_bytes": delta["bytes_trans_sent"] + delta["bytes_move_sent"],
                "balance/replica_upkeep_msgs": delta["msgs_trans_sent"] + delta["msgs_move_sent"],
                "balance/grad_sync_bytes": delta["bytes_agg_sent"] + delta["bytes_sumback_sent"],
                "balance/grad_sync_msgs": delta["msgs_agg_sent"] + delta["msgs_sumback_sent"],
                "balance/replicas_added": delta["replicas_added"],
                "balance/replicas_dropped": delta["replicas_dropped"],
                "balance/replica_moves_from_replica": delta["moves_from_replica"],
            })
            chosen = {k: getattr(p, "choice", None) for k, p in self.policies.items()}
            if any(v is not None for v in chosen.values()):   # auto: the policy each layer runs now
                self.metrics_["balance/auto"] = " ".join(f"L{k}={v}" for k, v in sorted(chosen.items()))

    _COUNTERS = ("bytes_trans_sent", "msgs_trans_sent", "bytes_move_sent", "msgs_move_sent",
                 "bytes_agg_sent", "msgs_agg_sent", "bytes_sumback_sent", "msgs_sumback_sent",
                 "replicas_added", "replicas_dropped", "replica_steps", "moves_from_replica")

    def _replica_totals(self) -> Dict[str, float]:
        return {k: float(sum(getattr(m.balance, k) for m in self.layers)) for k in self._COUNTERS}

    def metrics(self) -> Dict[str, float]:
        return dict(self.metrics_)

    def state_dict(self) -> dict:
        return {"stats": self.stats.state_dict(), "iteration": self.scheduler.iteration,
                "placements": {int(m.balance.layer_number): m.balance.placement.to_dict() for m in self.layers},
                "policies": {int(k): p.state_dict() for k, p in self.policies.items()
                             if hasattr(p, "state_dict")}}

    def load_state_dict(self, sd: dict) -> None:
        from megatron_moe.balance.policies.base import Placement

        self.stats.load_state_dict(sd["stats"])
        self.scheduler.iteration = int(sd.get("iteration", 0))
        self._next_iteration = None
        pl = {int(k): v for k, v in sd.get("placements", {}).items()}
        for m in self.layers:
            m.balance.invalidate_replicas()    # never checkpointed: rebuilt from the (loaded) owners
            if int(m.balance.layer_number) in pl:
                p = Placement.from_dict(pl[int(m.balance.layer_number)])
                if p.num_experts == m.balance.num_experts and p.num_ranks == m.balance.D:
                    m.balance.placement = p     # a different EP size re-plans from plain EP
        for layer, state in sd.get("policies", {}).items():
            policy = self.policies.get(int(layer))
            if policy is not None and hasattr(policy, "load_state_dict"):
                policy.load_state_dict(state)  # flexmoe falls back to its initial slots on an EP change


def _log_rank0(msg: str) -> None:
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_rank() == 0:
        print(msg, flush=True)


def _persistent_unsupported(args) -> Optional[str]:
    """Why persistent FlexMoE replicas cannot run with these flags (None: they can)."""
    if getattr(args, "use_distributed_optimizer", False):
        return "--use-distributed-optimizer shards the optimizer state (not supported)"
    if getattr(args, "fp16", False) or getattr(args, "bf16", False):
        return "--fp16/--bf16 keep fp32 main params outside the model (not supported)"
    dt = getattr(args, "params_dtype", None)
    if dt is not None and str(dt) not in ("fp32", "torch.float32"):
        return f"params dtype {dt} (only fp32 supported)"
    return None


class _OptimizerLookup:
    """param -> (torch optimizer, its live param group, clip_grad). Re-indexed whenever the groups
    change: torch's ``Optimizer.load_state_dict`` (checkpoint load) replaces the group dicts, and the
    lr scheduler writes into the live ones."""

    def __init__(self, subs):
        self.subs = subs
        self._sig = None
        self._map = {}

    def _signature(self):
        return tuple((id(s.optimizer), tuple(id(g) for g in s.optimizer.param_groups)) for s in self.subs)

    def __call__(self, p):
        sig = self._signature()
        if sig != self._sig:
            self._map = {id(q): (s.optimizer, g, float(s.config.clip_grad or 0.0))
                         for s in self.subs for g in s.optimizer.param_groups for q in g["params"]}
            self._sig = sig
        return self._map[id(p)]

    def __contains__(self, p):
        try:
            self(p)
        except KeyError:
            return False
        return True


def _optimizer_lookup(optimizer):
    """An ``_OptimizerLookup`` over a megatron-core FP32Optimizer or a ChainedOptimizer of them;
    (None, reason) for anything else."""
    from megatron.core.optimizer.optimizer import ChainedOptimizer, FP32Optimizer

    subs = optimizer.chained_optimizers if isinstance(optimizer, ChainedOptimizer) else [optimizer]
    for sub in subs:
        if not isinstance(sub, FP32Optimizer):
            return None, f"optimizer {type(sub).__name__} is not megatron-core's FP32Optimizer"
    return _OptimizerLookup([s for s in subs if not getattr(s, "is_stub_optimizer", False)
                             and s.optimizer is not None]), None
