"""FlexMoE persistent vExpert replicas in the real training loop (megatron_moe.training.loop.pretrain,
megatron-core FP32 optimizer + DDP, gloo, EP = world) under a skewed, drifting router:

* losses and owner parameters equal plain EP (policy none);
* after every step each replica's weights and Adam state (exp_avg, exp_avg_sq, step) are bit-equal
  to its owner's, with no per-iteration parameter transfer;
* the placement really changes (Expand, and Shrink/Migrate that remove a rank from a replica set);
* params + state move only when a rank joins a replica set: fewer upkeep bytes than transient Trans,
  while the gradient sync costs exactly twice transient's Agg (the sum comes back to the replicas);
* save -> resume (replicas not checkpointed, rebuilt from the owners) continues identically;
* --use-distributed-optimizer falls back to transient replicas with a one-line log message.
"""

import json

import numpy as np
import pytest

from megatron_moe.runtime.local_ranks import run_distributed
from tests import _flexmoe_persistent_cases as C

# fp32: a replicated expert's gradient is summed in another order than plain EP's; losses agree to
# 1e-6, parameters to 1e-5 (Adam's m / sqrt(v) magnifies last-bit differences where v is tiny)
LOSS_TOL, PARAM_TOL = 1e-6, 1e-5


def _argv(world, iters, profile, *extra):
    return ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32 "
            "--micro-batch-size 2 --global-batch-size 8 --lr 3e-3 --mock-data "
            "--tokenizer-type NullTokenizer --vocab-size 256 --num-experts 4 --moe-router-topk 2 "
            "--moe-token-dispatcher-type alltoall --moe-aux-loss-coeff 0.0 --log-interval 1 "
            "--eval-interval 1000 --eval-iters 1 --disable-bias-linear "
            f"--expert-model-parallel-size {world} --train-iters {iters}").split() + list(extra)


def _flex(profile, mode):
    # free communication in the planner's cost model: the tiny model's skew makes FlexMoE replicate
    return ["--moe-balance-policy", "flexmoe", "--moe-balance-profile", profile,
            "--moe-balance-interval", "1", "--moe-flexmoe-replicas", mode]


@pytest.fixture
def profile(tmp_path):
    path = tmp_path / "free_comm.json"
    path.write_text(json.dumps({"a2a_bandwidth": 1e15, "trans_bandwidth": 1e15, "throughput": 1.0}))
    return str(path)


def _run(world, argv):
    return run_distributed(C.run, world, argv, timeout_s=600)


def _summed(out, key):
    """Per iteration, a metric summed over ranks (each rank reports what it sent)."""
    return [sum(o["iters"][i]["metrics"][key] for o in out) for i in range(len(out[0]["iters"]))]


def _check_replicas_bit_equal(out):
    steps_with_replicas = 0
    for o in out:
        for rec in o["iters"]:
            assert rec["replica_mode"] == "persistent" and set(rec["mode"]) == {"persistent"}, rec
            assert rec["replica_mismatch"] == [], rec                 # params + optimizer state
            if rec["replicas"]:
                steps_with_replicas += 1
                assert {"linear_fc1.weight.exp_avg", "linear_fc1.weight.exp_avg_sq",
                        "linear_fc1.weight.step"} <= set(rec["replica_state_keys"]), rec
    assert steps_with_replicas >= 3, steps_with_replicas


def _check_equal_to_plain(ours, plain):
    for o, p in zip(ours, plain):
        assert np.allclose(o["history"]["lm_loss"], p["history"]["lm_loss"], rtol=0, atol=LOSS_TOL), \
            (o["history"]["lm_loss"], p["history"]["lm_loss"])
        assert o["params"].keys() == p["params"].keys()
        worst = max(float(np.abs(o["params"][k] - p["params"][k]).max()) for k in p["params"])
        assert worst < PARAM_TOL, worst


def _check_identical(a_out, b_out):
    """Persistent and transient replicas compute the same sums in the same order: bit-identical."""
    for a, b in zip(a_out, b_out):
        assert a["history"]["lm_loss"] == b["history"]["lm_loss"]
        assert all(np.array_equal(a["params"][k], b["params"][k]) for k in b["params"])


def _check_placement_changes(out):
    sets = [[pl["replica_sets"] for pl in rec["placements"]] for rec in out[0]["iters"]]
    changes = sum(a != b for a, b in zip(sets, sets[1:]))
    assert changes >= 2, sets
    ops = out[0]["iters"][-1]["ops"]
    assert ops["expand"] >= 2 and ops["shrink"] + ops["migrate"] >= 1, ops
    added = sum(_summed(out, "balance/replicas_added"))
    dropped = sum(_summed(out, "balance/replicas_dropped"))
    assert added >= 2 and dropped >= 1, (added, dropped)      # copies really created and freed
    return changes


def test_flexmoe_persistent_ep2(tmp_path, profile):
    iters = 10
    plain = _run(2, _argv(2, iters, profile))
    pers = _run(2, _argv(2, iters, profile, *_flex(profile, "persistent")))
    trans = _run(2, _argv(2, iters, profile, *_flex(profile, "transient")))
    _check_replicas_bit_equal(pers)
    _check_equal_to_plain(pers, plain)
    _check_placement_changes(pers)
    _check_identical(pers, trans)
    # transient and persistent ran the same placements (same counts, same planner)
    assert [r["placements"] for r in pers[0]["iters"]] == [r["placements"] for r in trans[0]["iters"]]
    up_p, up_t = _summed(pers, "balance/replica_upkeep_bytes"), _summed(trans, "balance/replica_upkeep_bytes")
    assert sum(up_p) < sum(up_t), (up_p, up_t)
    # an unchanged placement moves nothing in persistent mode (transient: a Trans every iteration)
    sets = [[pl["replica_sets"] for pl in r["placements"]] for r in pers[0]["iters"]]
    steady = [i for i in range(1, iters) if sets[i] == sets[i - 1] and up_t[i] > 0]
    assert steady and all(up_p[i] == 0 for i in steady), (steady, up_p)
    sync_p, sync_t = _summed(pers, "balance/grad_sync_bytes"), _summed(trans, "balance/grad_sync_bytes")
    assert sync_p == [2 * s for s in sync_t], (sync_p, sync_t)
    assert sum(_summed(pers, "balance/replica_upkeep_msgs")) < sum(_summed(trans, "balance/replica_upkeep_msgs"))

    # save at 5, resume to 10: replicas rebuilt from the owners (params + optimizer state)
    ckpt = str(tmp_path / "ckpt")
    first = _run(2, _argv(2, iters, profile, *_flex(profile, "persistent"), "--save", ckpt,
                          "--exit-interval", "5"))
    resumed = _run(2, _argv(2, iters, profile, *_flex(profile, "persistent"), "--load", ckpt))
    _check_replicas_bit_equal(resumed)
    for f, r, u in zip(first, resumed, pers):
        assert f["history"]["lm_loss"] + r["history"]["lm_loss"] == u["history"]["lm_loss"]
        assert all(np.array_equal(r["params"][k], u["params"][k]) for k in u["params"])
        assert [x["placements"] for x in r["iters"]] == [x["placements"] for x in u["iters"][5:]]
    # the resumed run re-sent every replica it needed at its first iteration
    assert _summed(resumed, "balance/replica_upkeep_bytes")[0] > 0


def test_flexmoe_persistent_ep4(profile):
    iters = 8
    clip = ("--clip-grad", "0.05")     # grad norms are ~0.6: every step clips, replicas must too
    plain = _run(4, _argv(4, iters, profile, *clip))
    pers = _run(4, _argv(4, iters, profile, *clip, *_flex(profile, "persistent")))
    trans = _run(4, _argv(4, iters, profile, *clip, *_flex(profile, "transient")))
    assert all(g > 0.05 for g in pers[0]["history"]["grad_norm"]), pers[0]["history"]["grad_norm"]
    _check_replicas_bit_equal(pers)
    _check_identical(pers, trans)
    _check_equal_to_plain(pers, plain)
    _check_placement_changes(pers)
    up_p, up_t = _summed(pers, "balance/replica_upkeep_bytes"), _summed(trans, "balance/replica_upkeep_bytes")
    assert sum(up_p) < sum(up_t), (up_p, up_t)


def test_flexmoe_distributed_optimizer_falls_back_to_transient(profile):
    out = _run(2, _argv(2, 4, profile, *_flex(profile, "persistent"), "--use-distributed-optimizer"))
    assert out[0]["logs"] == ["> balance: flexmoe replicas transient: --use-distributed-optimizer shards "
                              "the optimizer state (not supported)"], out[0]["logs"]
    assert out[1]["logs"] == []                                   # printed once (rank 0)
    for o in out:
        for rec in o["iters"]:
            assert rec["replica_mode"] == "transient" and set(rec["mode"]) == {"transient"}
            assert rec["replicas"] == 0
    assert sum(_summed(out, "balance/replica_upkeep_bytes")) > 0      # Trans ran instead


def test_persistent_unsupported_flags():
    import argparse

    from megatron_moe.balance import _persistent_unsupported

    ok = argparse.Namespace(use_distributed_optimizer=False, fp16=False, bf16=False, params_dtype="fp32")
    assert _persistent_unsupported(ok) is None
    assert "--fp16/--bf16" in _persistent_unsupported(argparse.Namespace(**{**vars(ok), "bf16": True}))
    assert "distributed" in _persistent_unsupported(
        argparse.Namespace(**{**vars(ok), "use_distributed_optimizer": True}))


def test_new_replica_copies_from_a_replica_on_its_node(profile):
    """Two emulated nodes of 2 ranks: a rank joining an expert's replica set copies params + Adam
    state from a replica on its own node when one exists (FlexMoE's cheapest link), not from the
    owner across nodes; the copy is still bit-equal, and the run equals transient replicas."""
    iters = 10
    nodes = ("--ranks-per-node", "2")
    pers = _run(4, _argv(4, iters, profile, *nodes, *_flex(profile, "persistent")))
    trans = _run(4, _argv(4, iters, profile, *nodes, *_flex(profile, "transient")))
    _check_replicas_bit_equal(pers)
    _check_identical(pers, trans)
    assert sum(_summed(pers, "balance/replica_moves_from_replica")) >= 1
