"""One exchange path (issue 14): the balanced layer trains on megatron_moe.comm, so
--moe-a2a-algorithm, --moe-a2a-compression and --moe-permute-fusion apply under every policy.

One 4-rank launch (2 emulated nodes x 2 ranks) loops over policy x algorithm inside the workers
(tests/_exchange_cases.py); strict device mode is on (megatron_moe/runtime/local_ranks.py).
"""

import pytest

from megatron_moe.runtime.local_ranks import run_distributed
from tests import _exchange_cases as cases


@pytest.fixture(scope="module")
def results():
    return run_distributed(cases.exchange_path_rank, 4, timeout_s=400)


def test_every_policy_and_algorithm_is_bit_exact_to_flat(results):
    for rank, res in enumerate(results):
        for policy in cases.POLICIES:
            for algo in cases.ALGORITHMS:
                r = res[(policy, algo)]
                assert r["equal_to_flat"], (rank, policy, algo, r["losses"], res[(policy, "flat")]["losses"])
                # the configured algorithm carried every token exchange, uncompressed
                assert set(r["exchanges"]) == {(algo, "none")} and r["exchanges"][(algo, "none")] > 0, r
                if policy != "none":   # replicas really served tokens under the policy
                    assert r["replicated"] > 0, (policy, algo)
            # flat and pipe send one message per peer, hierarchical aggregates per node: the byte
            # counters differ, so the algorithm that ran is visible on the wire too
            flat_w, hier_w = res[(policy, "flat")]["wire"], res[(policy, "hierarchical")]["wire"]
            assert hier_w["inter_msgs"] < flat_w["inter_msgs"], (policy, flat_w, hier_w)
            assert res[(policy, "pipe")]["wire"] == flat_w, policy
    # replicas computed tokens: Pro-Prophet/FasterMoE replicas serve their own rank's tokens, so fewer
    # rows cross the all-to-all than under plain EP; FlexMoE replicas receive other ranks' overflow
    rows = {p: sum(res[(p, "flat")]["a2a_rows"] for res in results) for p in cases.POLICIES}
    for policy in ("proprophet", "fastermoe"):
        assert rows[policy] < rows["none"], rows
    assert sum(res[("flexmoe", "flat")]["replica_rows"] for res in results) > 0


def test_compression_and_fused_permute_run_under_every_policy(results):
    for rank, res in enumerate(results):
        for policy in cases.POLICIES:
            r = res[(policy, "bf16+fused")]
            # tokens went bf16 over the configured non-flat algorithm; probs (1-D) uncompressed
            assert r["exchanges"].get((r["algorithm"], "bf16"), 0) > 0, r
            assert set(a for a, _ in r["exchanges"]) == {r["algorithm"]}, r
            assert r["permute_calls"].get("permute", 0) > 0 and r["permute_calls"].get("unpermute", 0) > 0, r
            # lossy, and bounded: bf16 rows (8 mantissa bits) over 2 iterations of a tiny model
            assert 0 < r["param_diff"] < 5e-2, (policy, r)
            assert r["loss_diff"] < 5e-2, (policy, r)


def test_fused_permute_trains_like_megatron_permute(results):
    for res in results:
        r = res["fused"]
        assert r["permute_calls"]["permute"] > 0
        assert r["equal"], r["param_diff"]


def test_policy_with_tensor_parallel_is_refused_at_parse_time(capsys):
    from megatron_moe.arguments import parse_args
    from tests.test_training import TINY

    base = TINY + ["--train-iters", "1", "--moe-balance-policy", "proprophet"]
    for extra, flag in ((["--tensor-model-parallel-size", "2", "--sequence-parallel"],
                         "--tensor-model-parallel-size"),
                        (["--expert-tensor-parallel-size", "2"], "--expert-tensor-parallel-size"),
                        (["--moe-pad-expert-input-to-capacity", "--moe-expert-capacity-factor", "1"],
                         "--moe-pad-expert-input-to-capacity")):
        with pytest.raises(SystemExit) as e:
            parse_args(base + extra, world_size=2)
        err = capsys.readouterr().err
        assert e.value.code == 2 and "--moe-balance-policy proprophet" in err and flag in err, err
        assert len(err.strip().splitlines()) == 2, err   # one line + the --help pointer
    # the exchange flags are accepted with a policy (they apply, see above)
    args = parse_args(base + ["--moe-a2a-algorithm", "hierarchical", "--moe-a2a-compression", "bf16",
                              "--moe-permute-fusion", "--expert-model-parallel-size", "2"], world_size=2)
    assert args.moe_balance_policy == "proprophet"
