"""Megatron-FSDP (--use-megatron-fsdp, --data-parallel-sharding-strategy, --ckpt-format
fsdp_dtensor) in the real training loop on 2 gloo ranks (tiny CPU runs):

* ZeRO-3 (optim_grads_params) at DP=2: each rank holds half of the parameters' elements as
  megatron-core FullyShardedDataParallel DTensor shards (its config has the
  --suggested-communication-unit-size given), and the losses equal the DDP +
  distributed optimizer run's (fp32, 1e-6); mutation: the builder wraps in DDP (every rank holds
  every element), and without compat/cpu.py's shim the wrapper cannot be built on a CPU;
* fsdp_dtensor checkpoints at EP=2 with SwiGLU, grouped experts, bf16, overlapped gradient
  reduce and parameter gather, and dropout: a run saved at
  iteration 2 and resumed repeats iterations 3-4 of the uninterrupted run exactly; the directory
  is one DCP save (SwiGLU's fc1 and its Adam moments split into _w / _v as Megatron-LM stores
  them) with our checksum manifest; mutations: the optimizer state not loaded, or the RNG states
  not restored (--no-load-rng): the losses differ;
  the checkpoint loads at EP=1 too (iteration 3 within 1e-6 of the same-layout resume, 4
  within 1e-4: gradients reduced in another order);
  a run without Megatron-FSDP refuses to resume from that checkpoint with one line naming the
  format (its weights load without Megatron-FSDP: tests/test_fsdp_dtensor_export.py);
* Megatron-LM's parse-time rules and ours, one line each.
"""

import os

import pytest
import torch.distributed.checkpoint as dcp

from megatron_moe.arguments import parse_args
from megatron_moe.runtime.local_ranks import DistributedRunError, run_distributed
from tests import _megatron_fsdp_cases as cases
from tests.test_training import TINY

EXACT = "--attention-dropout 0 --hidden-dropout 0".split()
FSDP = ("--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params "
        "--ckpt-format fsdp_dtensor").split()


def _run(argv, mutate=None, dropout=False):
    return run_distributed(cases.train, 2, TINY + ([] if dropout else EXACT) + argv,
                           timeout_s=300, mutate=mutate)


def _zero3(mutate=None):
    (losses, proof), (losses1, proof1) = _run(
        FSDP + ["--train-iters", "3", "--suggested-communication-unit-size", "5000"], mutate)
    assert losses == losses1
    assert proof["wrapper"] == "FullyShardedDataParallel", proof
    assert proof["unit"] == 5000, proof
    # each rank holds its shard: the two halves of every layer's flat buffer
    assert 0.3 < proof["share"] < 0.7 and 0.3 < proof1["share"] < 0.7, (proof, proof1)
    assert abs(proof["share"] + proof1["share"] - 1) < 1e-6, (proof, proof1)
    return losses


@pytest.fixture(scope="module")
def ddp_losses():
    (losses, proof), _ = _run(["--use-distributed-optimizer", "--train-iters", "3"])
    assert proof["wrapper"] == "DistributedDataParallel" and proof["share"] == 1.0
    return losses


def test_zero3_shards_and_trains_as_ddp(ddp_losses):
    losses = _zero3()
    assert len(set(losses)) == 3
    assert all(abs(a - b) <= 1e-6 * abs(b) for a, b in zip(losses, ddp_losses)), \
        (losses, ddp_losses)


def test_zero3_mutation_fsdp_dropped_fails():
    with pytest.raises(AssertionError):
        _zero3("fsdp-dropped")


def test_megatron_fsdp_needs_its_cpu_shim():
    with pytest.raises(DistributedRunError, match="cuda"):
        _zero3("no-cpu-shim")


# as Megatron's DeepSeek-proxy FSDP configs: bf16, overlapped gradient reduce and param gather
RESUME = FSDP + ("--expert-model-parallel-size 2 --moe-grouped-gemm --swiglu --bf16 "
                 "--overlap-grad-reduce --overlap-param-gather").split()


def _resume_run(argv, mutate=None):
    # dropout on: an exact resume also needs every rank's generators back
    return _run(RESUME + argv, mutate, dropout=True)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(uninterrupted losses, checkpoint root saved at iteration 2 of the same run)."""
    root = str(tmp_path_factory.mktemp("fsdp") / "ckpt")
    (straight, _), _ = _resume_run(["--train-iters", "4"])
    (first, _), _ = _resume_run(["--train-iters", "4", "--save", root, "--save-interval", "2",
                                 "--exit-interval", "2"])
    assert first == straight[:2]
    return straight, root


def test_fsdp_dtensor_resume_is_exact(saved):
    straight, root = saved
    ckpt = os.path.join(root, "iter_0000002")
    names = set(os.listdir(ckpt))
    assert {".metadata", "__0_0.distcp", "__1_0.distcp", "megatron_moe_checksums.json"} <= names
    assert "metadata.json" not in names and "common.pt" not in names   # not torch_dist
    stored = dcp.FileSystemReader(ckpt).read_metadata().state_dict_metadata
    for part in ("model.", "optimizer.state."):   # megatron-core's SwiGLU split, as Megatron-LM
        assert any(k.startswith(part) and "linear_fc1.weight_w" in k for k in stored), part
    assert {"args", "iteration", "opt_param_scheduler.num_steps"} <= set(stored)
    (resumed, _), _ = _resume_run(["--train-iters", "4", "--load", root])
    assert resumed == straight[2:], (resumed, straight)


def test_fsdp_dtensor_resume_mutation_rng_not_restored(saved):
    straight, root = saved
    (resumed, _), _ = _resume_run(["--train-iters", "4", "--load", root, "--no-load-rng"])
    assert resumed != straight[2:]   # other dropout masks


def test_checkpoint_info_reads_an_fsdp_dtensor_checkpoint(saved):
    """tools/checkpoint_info.py reads its common state from the shards (the inference tools and
    the converter read its weights: tests/test_fsdp_dtensor_export.py)."""
    from tools import checkpoint_info

    _, root = saved
    info = checkpoint_info.inspect(os.path.join(root, "iter_0000002"))
    assert info["complete"], info["problems"]
    assert info["iteration"] == 2 and info["layout"]["ep"] == 2 and info["has_optimizer"]
    assert info["format"] == {"sharded_backend": "fsdp_dtensor"}


def test_fsdp_dtensor_resume_mutation_optimizer_not_loaded(saved):
    straight, root = saved
    (resumed, _), _ = _resume_run(["--train-iters", "4", "--load", root],
                                  mutate="optimizer-not-loaded")
    assert resumed != straight[2:]


def test_fsdp_dtensor_reshards_from_ep2_to_ep1(saved):
    """The same checkpoint at EP=1 (experts sharded over both ranks instead of split between
    them): megatron-core's expert renumbering maps them; the Adam state loads as well. Dropout
    off (the RNG state is restored only into the same layout, as for torch_dist), against the
    same-layout resume, also without dropout."""
    _, root = saved
    load = ["--train-iters", "4", "--load", root]
    (same, _), _ = _run(RESUME + load)
    ep1 = [a for a in RESUME if a not in ("--expert-model-parallel-size", "2")]
    (resharded, _), _ = _run(ep1 + load)
    assert len(set(same)) == 2
    # the first step from the loaded state: the same forward; after it the gradients were
    # reduced in another order (EP=1 reduce-scatters the experts' over both ranks)
    assert abs(resharded[0] - same[0]) <= 1e-6 * same[0], (resharded, same)
    assert abs(resharded[1] - same[1]) <= 1e-4 * same[1], (resharded, same)


def test_fsdp_dtensor_checkpoint_refused_by_a_ddp_run(saved):
    _, root = saved
    argv = [a for a in RESUME if a not in FSDP] + ["--use-distributed-optimizer",
                                                   "--train-iters", "4", "--load", root]
    with pytest.raises(DistributedRunError, match="fsdp_dtensor .Megatron-FSDP's. checkpoint; "
                                                  "this run has no --use-megatron-fsdp: "
                                                  "resume it with --use-megatron-fsdp .*"
                                                  "--finetune or --pretrained-checkpoint"):
        _run(argv)


BASE = TINY + ["--train-iters", "2"]


@pytest.mark.parametrize("extra, message", [
    (["--use-megatron-fsdp"], "--use-megatron-fsdp needs --ckpt-format fsdp_dtensor"),
    (["--ckpt-format", "fsdp_dtensor"], "--ckpt-format fsdp_dtensor needs --use-megatron-fsdp"),
    (FSDP + ["--optimizer", "muon"], "--optimizer muon"),   # 0.16: no Muon at all
    (FSDP + ["--outer-dp-sharding-strategy", "optim"], "hybrid FSDP is not supported"),
    (FSDP + ["--async-save", "--save", "ckpt"], "--async-save cannot run with --ckpt-format fsdp_dtensor"),
    (FSDP + ["--moe-balance-policy", "proprophet"], "cannot be combined with --moe-balance-policy"),
    (FSDP + ["--moe-expert-offload", "host"], "cannot be combined with --moe-expert-offload"),
    (FSDP + ["--check-weight-hash-across-dp-replicas-interval", "5"], "no rank holds"),
])
def test_refused_at_parse_time(extra, message, capsys):
    with pytest.raises(SystemExit):
        parse_args(BASE + extra)
    err = capsys.readouterr().err
    assert message in err and len([line for line in err.splitlines() if "error:" in line]) == 1, err


def test_turns_on_the_distributed_optimizer():
    args = parse_args(BASE + FSDP)
    assert args.use_distributed_optimizer and args.use_megatron_fsdp
