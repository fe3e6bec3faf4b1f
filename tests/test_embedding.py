"""Hidden-partitioned (MoESys) word embedding: lookups, gradients, DDP/optimizer, checkpoints.

Run: .venv/bin/python -m pytest -q -s tests/test_embedding.py   (-s shows the memory lines)
"""

import argparse
import functools
import shutil
import tempfile

import pytest

from megatron_moe import features
from megatron_moe.models import embedding
from megatron_moe.models.embedding import add_arguments


def validate_args(args):
    """The embedding feature's checks and declared exclusions, as the parser runs them."""
    features.validate_args(args, features=(embedding,))
from megatron_moe.runtime.local_ranks import run_distributed
from tests import _embed_cases as cases


@functools.lru_cache(maxsize=None)
def _suite(world_size, ep):
    """One spawn per world size serves the tests below (2 ranks also run the checkpoint case)."""
    ckpt = tempfile.mkdtemp(prefix="embed_ckpt_") if world_size == 2 else None
    try:
        return run_distributed(cases.suite, world_size, ep, ckpt, timeout_s=300)
    finally:
        if ckpt is not None:
            shutil.rmtree(ckpt, ignore_errors=True)


@pytest.mark.parametrize("world_size", [2, 4])
def test_lookup_forward_bit_identical_and_grads_match(world_size):
    results = [r["lookup"] for r in _suite(world_size, 2)]
    V, H = cases.V, cases.H
    for rank, r in enumerate(results):
        assert r["shape_ok"], rank
        assert r["forward_bit_identical"], rank
        # raw shard grad == column block of the all-reduced (summed) replicated grad, exactly
        assert r["grad_equals_sum_exact"], rank
        # scaled by 1/P, as megatron-core DDP does for it == the DP-averaged replicated grad
        assert r["grad_equals_dp_average"], rank
        assert r["grad_float_close"], rank
        assert r["state_dict_full"] and r["load_full"] and r["load_shard"], rank
        assert r["init_partition_invariant"], rank
        assert "not divisible by the partition group size" in r["indivisible"]
        assert r["shard_shape"] == (V, H // world_size)
        assert r["param_bytes"] == r["param_storage_bytes"] == V * H * 4 // world_size
        assert r["grad_bytes"] == V * H * 4 // world_size
        print(f"\n[embedding memory] P={world_size} rank {rank}: param {r['param_bytes']} B + "
              f"grad {r['grad_bytes']} B per rank (V x H / P = {V}x{H}/{world_size}); "
              f"replicated {r['replicated_bytes']} B; ratio "
              f"{r['param_bytes'] / r['replicated_bytes']:.3f}")


@pytest.mark.parametrize("world_size,ep", [(2, 2), (4, 2)])
def test_gpt_under_ddp_and_optimizer_matches_vocab_embedding(world_size, ep):
    results = [r["ddp"] for r in _suite(world_size, ep)]
    for rank, r in enumerate(results):
        assert r["swapped"] and r["group_size"] == ep and r["same_init"], rank
        assert r["loss_equal"], rank
        assert r["grad_close"], (rank, r["grad_max_abs_diff"])
        # clipping is active (clip 0.05): the global grad norm must count every shard once
        assert r["grad_norm"][0] == pytest.approx(r["grad_norm"][1], rel=1e-6)
        assert r["weights_close"] and r["other_params_close"] and r["step_ok"], rank
        assert "untie-embeddings-and-output-weights" in r["tied"]
        if world_size == ep:
            assert r["dp_group"] == "accepted"  # DP group == EP group: MoESys's setting
        else:
            assert "--embedding-partition-group ep" in r["dp_group"]


def test_checkpoint_reshards_between_hidden_vocab_and_replicated():
    for r in (r["ckpt"] for r in _suite(2, 2)):
        assert r == {"hidden_to_replicated": True, "hidden_to_vocab": True,
                     "vocab_to_hidden": True}


def _args(**kw):
    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(kw.pop("argv", []))
    base = dict(tensor_model_parallel_size=1, context_parallel_size=1,
                expert_tensor_parallel_size=1, expert_model_parallel_size=2, data_parallel_size=2,
                untie_embeddings_and_output_weights=True, hidden_size=16, mtp_num_layers=None)
    base.update(kw)
    for k, v in base.items():
        setattr(args, k, v)
    return args


def test_flags_default_to_vocab_and_validate():
    args = _args()
    assert args.embedding_partition == "vocab" and args.embedding_partition_group == "auto"
    validate_args(_args(tensor_model_parallel_size=4))  # vocab: nothing to check
    validate_args(_args(argv=["--embedding-partition", "hidden"]))


@pytest.mark.parametrize("kw,needle", [
    (dict(untie_embeddings_and_output_weights=False), "--untie-embeddings-and-output-weights"),
    (dict(tensor_model_parallel_size=2), "--tensor-model-parallel-size 1"),
    (dict(context_parallel_size=2), "--context-parallel-size 1"),
    (dict(expert_tensor_parallel_size=2), "--expert-tensor-parallel-size 1"),
    (dict(hidden_size=15), "--hidden-size (15) is not divisible"),
    (dict(data_parallel_size=4, argv=["--embedding-partition", "hidden",
                                      "--embedding-partition-group", "dp"]),
     "--embedding-partition-group dp needs"),
])
def test_hidden_rejects_unsupported_configurations(kw, needle):
    argv = kw.pop("argv", ["--embedding-partition", "hidden"])
    with pytest.raises(ValueError) as exc:
        validate_args(_args(argv=argv, **kw))
    assert needle in str(exc.value)
