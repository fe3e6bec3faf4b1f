"""Grouped experts (--moe-grouped-gemm on the local path) under the features that used to need
megatron-core's expert loop, in the real pretrain() loop on 2 gloo ranks, EP=2, bf16, a router made
skewed on purpose (a hot expert) so that the balance policies replicate at this tiny size:

* every balance policy (Pro-Prophet, FasterMoE, FlexMoE, auto): the replicas run as extra groups of
  the one grouped call; losses and grad norms equal the expert loop under the same policy, bit for
  bit; the grouped path ran (call counter) with replica groups in it; planted faults (a token group
  shifted by a row; replica weights stacked detached so their grads never reach Agg) break it.
"""

import json

import pytest

from megatron_moe.runtime.local_ranks import run_distributed
from tests import _grouped_cases as G


def _argv(iters, *extra):
    return ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32 "
            "--micro-batch-size 2 --global-batch-size 8 --lr 3e-3 --lr-warmup-iters 1 "
            "--mock-data --tokenizer-type NullTokenizer --vocab-size 256 --num-experts 4 "
            "--moe-ffn-hidden-size 16 --moe-router-topk 2 --swiglu --bf16 "
            "--moe-token-dispatcher-type alltoall --moe-aux-loss-coeff 0.0 --log-interval 1 "
            "--eval-interval 1000 --eval-iters 1 --disable-bias-linear "
            f"--expert-model-parallel-size 2 --train-iters {iters}").split() + list(extra)


def test_grouped_experts_under_every_balance_policy(tmp_path):
    profile = tmp_path / "free_comm.json"     # free communication: the planners replicate
    profile.write_text(json.dumps({"a2a_bandwidth": 1e15, "trans_bandwidth": 1e15, "throughput": 1.0}))
    policies = {
        "proprophet": ["--moe-balance-alpha", "0", "--moe-balance-overlap"],
        "fastermoe": ["--moe-balance-profile", str(profile)],
        "flexmoe": ["--moe-balance-profile", str(profile), "--moe-balance-interval", "1"],
        "auto": ["--moe-balance-profile", str(profile)],
    }
    g = "--moe-grouped-gemm"
    runs = []
    for name, extra in policies.items():
        runs += [_argv(3, "--moe-balance-policy", name, *extra),
                 _argv(3, "--moe-balance-policy", name, *extra, g)]
    pp = policies["proprophet"]
    runs += [_argv(3, "--moe-balance-policy", "proprophet", *pp, g),      # 8: token groups shifted
             _argv(3, "--moe-balance-policy", "proprophet", *pp, g)]      # 9: replica grads dropped
    out = run_distributed(G.run_counted, 2, runs, mutations={8: "shift", 9: "detach_replicas"},
                          skew=(4.0, 2), timeout_s=600)
    r = out[0]
    h = lambda k, key="lm_loss": r[k]["history"][key]   # noqa: E731
    for i, name in enumerate(policies):
        loop, grouped = 2 * i, 2 * i + 1
        assert len(h(loop)) == 3 and all(x == x for x in h(loop)), name
        assert h(grouped) == h(loop) and h(grouped, "grad_norm") == h(loop, "grad_norm"), \
            (name, h(grouped), h(loop), h(grouped, "grad_norm"), h(loop, "grad_norm"))
        for rank_out in out:
            assert rank_out[loop]["grouped_calls"] == 0, name
            assert rank_out[grouped]["grouped_calls"] >= 2 * 2 * 3, name   # layers x micro-batches x iters
        # replicas ran as groups of the grouped call (on some rank)
        assert sum(rank_out[grouped]["replica_groups"] for rank_out in out) > 0, name
    assert h(8) != h(0)
    assert sum(rank_out[9]["replica_groups"] for rank_out in out) > 0
    assert h(9, "grad_norm") != h(0, "grad_norm")
