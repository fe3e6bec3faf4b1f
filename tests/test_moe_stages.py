"""The one MoE layer overrides megatron-core's stages, not its forward (megatron_moe/moe/layer.py).

On two ranks (EP=2, gloo) our layer with each middle (none: megatron-core's stages under our
exchange; the chunked pipeline, --moe-a2a-overlap-degree 2; the replica placement with a plain
placement) equals megatron-core's MoELayer with the same weights, run whole (megatron-core's own
forward) and stage by stage (as megatron-core's overlapped 1F1B schedule, fine_grained_callables.py, calls them), forward
and backward; a counter shows the middle and the exchange's chunk sort ran inside our layer, while
megatron-core's own chunk sort stays bound outside the layer's stages (and in megatron-core's layer).
Mutations: the exchange scope binds nothing (our chunk sort never runs), the middle ignored (the
chunked pipeline / replica plan never run).
"""

import pytest

from megatron_moe.runtime.local_ranks import run_distributed
from tests._stage_cases import run_counts, run_stages


def test_forward_is_megatron_cores():
    from megatron.core.transformer.moe.moe_layer import MoELayer as Core

    from megatron_moe.moe.layer import MoELayer

    assert MoELayer.forward is Core.forward
    for stage in ("route", "preprocess", "dispatch", "routed_experts_compute", "combine",
                  "postprocess"):
        assert getattr(MoELayer, stage) is not getattr(Core, stage), stage


MIDDLE_CALL = {"chunked": "chunked_exchange", "placement": "replica_plan"}


@pytest.mark.parametrize("middle,mutate", [
    ("none", None), ("chunked", None), ("placement", None),
    ("none", "scope_binds_nothing"), ("chunked", "middle_ignored"),
    ("placement", "middle_ignored"),
])
def test_stages_equal_megatron_core(middle, mutate):
    results = run_distributed(run_stages, 2, middle, mutate, timeout_s=240)

    def check(r):
        assert r["whole"] < 1e-5 and r["staged"] < 1e-5 and r["grad"] < 1e-5, r
        assert r["outside"], r    # megatron-core's own names outside our layer's stages
        assert r["core_calls"].get("our_chunk_sort", 0) == 0, r   # not in megatron-core's layer
        if middle in MIDDLE_CALL:   # once whole, once staged
            assert r["calls"].get(MIDDLE_CALL[middle], 0) == 2, r
        else:   # two local experts: the dispatcher sorts its chunks twice per forward
            assert r["calls"].get("our_chunk_sort", 0) >= 4, r

    if mutate is None:
        for r in results:
            check(r)
    else:
        with pytest.raises(AssertionError):
            check(results[0])


@pytest.mark.parametrize("grouped,mutate", [(True, None), (False, None), (True, "counts_to_host")])
def test_one_rank_keeps_the_counts_on_the_device(grouped, mutate):
    """EP = TP = 1 with grouped experts: megatron-core's alltoall dispatcher neither copies its
    counts to the host nor waits for a copy (compat/dispatch.py keep_counts_on_device): no point
    it reaches is its copy or sync point. The expert loop needs host counts (its split), so it
    keeps megatron-core's points; so does the mutation (the layer leaves them alone)."""
    (r,) = run_distributed(run_counts, 1, grouped, mutate, timeout_s=120)
    assert r["diff"] < 1e-5, r
    assert r["points"], r   # the dispatcher reached its points
    reached = set(r["points"])
    if grouped and mutate is None:
        assert r["on_device"] and r["sync"] == "no_sync", r
        assert r["dtoh"] not in reached and r["sync"] not in reached, r
    else:
        assert not r["on_device"] or mutate, r
        assert r["sync"] in reached and r["dtoh"] in reached, r
