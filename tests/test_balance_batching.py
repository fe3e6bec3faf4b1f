"""Issue 21 item 6 mechanisms of the balanced layer, each proven to run and mutation-checked:

* the dispatch/combine all-to-all is skipped when no (token, expert) pair crosses ranks (every rank
  decides from the same all-gathered send matrix): ``a2a_skipped`` counts it, no exchange goes
  through megatron_moe.comm, and the run equals stock megatron-core EP (float64, < 1e-10); mutated
  never to skip, the counters catch it; mutated to skip although pairs cross, the run fails;
* Trans and Agg move one flat message per (owner, replica rank) pair: message and byte counters
  equal the pair count and the note's ``(|S_e|-1) * size(params)``; mutated back to one message per
  expert (still correct math) the message count doubles, which the count check catches.
"""

import torch

from megatron_moe.runtime.local_ranks import run_distributed
from tests import _balance_cases as bc

ITERS = 2


def _run(rank, world, plan, mutate=None):
    """ITERS iterations of stock EP vs the balanced layer with ``plan`` ("all": every expert on every
    rank, "plain", "random"); returns diffs and the layer's counters."""
    from megatron_moe import comm
    from megatron_moe.balance import BalanceManager, layer, placement
    from megatron_moe.balance.policies.base import Placement

    saved = (layer.crosses_ranks, placement.LayerBalance._pair_batches)
    if mutate == "skip_always":
        layer.crosses_ranks = lambda send: False
    elif mutate == "never_skip":
        layer.crosses_ranks = lambda send: True
    elif mutate == "per_expert":
        def per_expert(self, experts):
            return [(o, d, [e]) for o, d, ex in saved[1](self, experts) for e in ex]
        placement.LayerBalance._pair_batches = per_expert
    try:
        ref = bc._build(2, False, torch.float64)
        ours = bc._build(2, True, torch.float64)
        mgr = BalanceManager(bc._args(moe_balance_policy="proprophet"), [ours], num_microbatches=1)
        opt_r = torch.optim.Adam(ref.parameters(), lr=1e-2)
        opt_o = torch.optim.Adam(ours.parameters(), lr=1e-2)
        diff, exchanges = 0.0, 0
        for it in range(ITERS):
            for m in mgr.layers:
                if plan == "all":
                    m.balance.placement = Placement([list(range(world))] * bc.E, world)
                elif plan == "random":
                    m.balance.placement = bc._random_placement(1000 * it + m.balance.layer_number, world)
                else:
                    m.balance.placement = Placement.plain(bc.E, world)
            lr, _ = bc._iteration(ref, opt_r, it, rank)
            with comm.count_exchanges() as c:
                try:
                    lo, _ = bc._iteration(ours, opt_o, it, rank, mgr)
                except (IndexError, RuntimeError) as err:    # the mutant may also crash: it failed
                    if mutate != "skip_always":
                        raise
                    return {"diff": float("inf"), "skipped": sum(m.balance.a2a_skipped for m in mgr.layers),
                            "error": repr(err)[:200]}
            exchanges += sum(c.values())
            pr, po = dict(ref.named_parameters()), dict(ours.named_parameters())
            diff = max(diff, abs(lr - lo), max(float((pr[k] - po[k]).abs().max()) for k in pr))
    finally:
        layer.crosses_ranks, placement.LayerBalance._pair_batches = saved
    st = [m.balance for m in mgr.layers]
    return {"diff": diff, "exchanges": exchanges, "skipped": sum(s.a2a_skipped for s in st),
            "numel": st[0].numel,
            **{k: sum(getattr(s, k) for s in st) for k in ("msgs_trans_sent", "bytes_trans_sent",
                                                           "msgs_agg_sent", "bytes_agg_sent")}}


def batching_rank(rank, world):
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(expert_model_parallel_size=world)
    return {name: _run(rank, world, plan, mutate) for name, plan, mutate in (
        ("all", "all", None), ("plain", "plain", None), ("per_expert", "all", "per_expert"),
        ("never_skip", "all", "never_skip"),
        ("skip_always", "random", "skip_always"))}     # last: a crashing mutant ends the spawn


def test_exchange_skip_and_flat_trans_agg():
    out = run_distributed(batching_rank, 2, timeout_s=300)
    layers = 2
    for r in out:
        everywhere, plain = r["all"], r["plain"]
        # every pair local: both layers skip in every iteration, nothing goes through comm's exchange,
        # and the run is stock EP
        assert everywhere["diff"] < 1e-10, everywhere
        assert everywhere["skipped"] == layers * ITERS and everywhere["exchanges"] == 0, everywhere
        # plain EP: pairs cross, nothing skipped, the exchanges run
        assert plain["diff"] < 1e-10 and plain["skipped"] == 0 and plain["exchanges"] > 0, plain
        # one Trans and one Agg message per (owner, replica rank) pair: with EP 2 and every expert
        # replicated each rank sends one of each per layer and iteration, carrying its 2 experts
        per_msg = 2 * everywhere["numel"] * 8
        for kind in ("trans", "agg"):
            assert everywhere[f"msgs_{kind}_sent"] == layers * ITERS, everywhere
            assert everywhere[f"bytes_{kind}_sent"] == layers * ITERS * per_msg, everywhere
        # mutations: never skipping keeps the math but the skip counter and the exchange count catch
        # it; skipping although pairs cross breaks the run (wrong rows: an index error or a
        # mismatch); one message per expert keeps the math and the bytes but doubles the messages
        ns = r["never_skip"]
        assert ns["diff"] < 1e-10 and ns["skipped"] == 0 and ns["exchanges"] > 0, ns
        assert r["skip_always"]["skipped"] > 0 and r["skip_always"]["diff"] > 1e-6, r["skip_always"]
        pe = r["per_expert"]
        assert pe["diff"] < 1e-10 and pe["bytes_trans_sent"] == everywhere["bytes_trans_sent"], pe
        assert pe["msgs_trans_sent"] == pe["msgs_agg_sent"] == 2 * layers * ITERS, pe
