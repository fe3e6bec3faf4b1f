"""Megatron-LM's full-iteration CUDA graph (--cuda-graph-impl full_iteration,
megatron_moe/training/cuda_graph.py): what a capture needs, proven on the CPU.

A CUDA graph capture fails at the first host read of device data in the captured region (one
training iteration's forward and backward). pretrain() runs with the flags accepted as on a GPU
and megatron-core's FullCudaGraphWrapper replaced by an emulated capture
(tests/_cuda_graph_cases.py): after the warm-up, every call of the region runs under the capture
counter (tests/_sync_counter.py CaptureCounter: host reads, host waits, host-to-device copies, and
megatron-core's dispatcher copy and wait points, which a CPU build turns into no-ops) and must
record nothing, from any code (ours, megatron-core, torch). The configurations are the GPU kit's
(grouped experts, one grouped weight, SDPA attention, the fused cross-entropy) on 2 data-parallel
ranks; what the mutation run plants (a loss read, a host wait, a host-to-device tensor per
micro-batch, the dispatcher's host copy left in) must each be caught. The capture and replay themselves run on CUDA only (the perf
section's ``ours-graphed`` row).
"""

import pytest

from megatron_moe.runtime.local_ranks import run_distributed
from tests import _cuda_graph_cases as cases
from tests.test_training import TINY

GRAPH = ("--cuda-graph-impl full_iteration --cuda-graph-warmup-steps 1 "
         "--no-check-for-nan-in-loss-and-grad --train-iters 3 --moe-grouped-gemm "
         "--moe-single-grouped-weight --attention-backend flash --cross-entropy-loss-fusion "
         "--attention-dropout 0 --hidden-dropout 0 --bf16 --distributed-backend gloo").split()


def _run(extra=(), mutate=None):
    return run_distributed(cases.train, 2, TINY + GRAPH + list(extra), timeout_s=300,
                           mutate=mutate)


def _check(extra=()):
    from megatron_moe.compat.versions import mcore_at_least

    for losses, calls, reads, impl in _run(extra):
        assert calls["training"] == 3 and len(losses) == 3, (calls, losses)
        assert calls.get("validation", 0) >= 2, calls   # evaluation after training, both sets
        assert impl == ("full_iteration" if mcore_at_least("0.19") else "none"), impl
        assert not reads.get("training") and not reads.get("validation"), reads


def test_captured_iterations_read_nothing_on_the_host():
    _check()


def test_captured_iterations_read_nothing_with_two_micro_batches_and_the_router_bias():
    _check(["--global-batch-size", "16", "--moe-router-enable-expert-bias",
            "--moe-router-score-function", "sigmoid"])


def test_expert_and_tensor_parallel_padded_to_capacity_read_nothing():
    """EP=2, and TP=ETP=2 with sequence parallelism: dropless, megatron-core's all-to-all reads
    its split sizes on the host (refused below); padded to a capacity the shapes are fixed."""
    pad = ["--moe-expert-capacity-factor", "1.0", "--moe-pad-expert-input-to-capacity"]
    _check(["--expert-model-parallel-size", "2"] + pad)
    _check(["--tensor-model-parallel-size", "2", "--sequence-parallel"] + pad)


def test_host_reads_planted_in_the_region_are_caught():
    """Planted per micro-batch, all in one run (each reported on its own): a loss read, a host
    wait, a tensor made from Python data on the device; and megatron-core's host copy of the
    expert counts and its wait left in (what fails a real capture at expert parallel size 1
    unless our layer keeps the counts on the device)."""
    planted = {"loss-item": "Tensor.item", "synchronize": "torch.cuda.synchronize",
               "host-to-device": "torch.tensor of host data",
               "counts-on-host": "dispatcher's host wait"}
    for _, _, reads, _ in _run(mutate=tuple(planted)):
        seen = [what for owner, where, what in reads["training"]]
        for name, what in planted.items():
            assert any(what in s for s in seen), (name, seen)


@pytest.mark.parametrize("flags, message", [
    ("--cuda-graph-impl full_iteration --moe-grouped-gemm", "--no-check-for-nan-in-loss-and-grad"),
    ("--cuda-graph-impl full_iteration --no-check-for-nan-in-loss-and-grad", "add --moe-grouped-gemm"),
    ("--cuda-graph-impl full_iteration --no-check-for-nan-in-loss-and-grad --moe-grouped-gemm "
     "--expert-model-parallel-size 2", "split sizes on the host"),
    ("--cuda-graph-impl full_iteration --no-check-for-nan-in-loss-and-grad --moe-grouped-gemm "
     "--tensor-model-parallel-size 2 --sequence-parallel", "split sizes on the host"),
    ("--cuda-graph-impl full_iteration --no-check-for-nan-in-loss-and-grad --moe-grouped-gemm "
     "--moe-balance-policy fastermoe", "--moe-balance-policy"),
    ("--cuda-graph-impl full_iteration --no-check-for-nan-in-loss-and-grad --moe-grouped-gemm "
     "--fp16", "--loss-scale"),
    ("--cuda-graph-impl full_iteration --no-check-for-nan-in-loss-and-grad --moe-grouped-gemm "
     "--check-for-spiky-loss", "--check-for-spiky-loss"),
    ("--cuda-graph-impl full_iteration --no-check-for-nan-in-loss-and-grad --moe-grouped-gemm "
     "--rerun-mode report_stats", "report_stats"),
    ("--cuda-graph-scope attn --cuda-graph-impl local", "only full_iteration"),
    ("--cuda-graph-scope full_iteration", "needs --cuda-graph-impl local"),
])
def test_refused_at_parse_time(flags, message, capsys, monkeypatch):
    from megatron_moe import arguments
    from megatron_moe.arguments import parse_args

    monkeypatch.setattr(arguments, "_cuda_available", lambda: True)
    with pytest.raises(SystemExit):
        parse_args(TINY + ["--train-iters", "4"] + flags.split(), world_size=2)
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 2, err


def test_refused_on_a_cpu(capsys):
    from megatron_moe.arguments import parse_args

    with pytest.raises(SystemExit):
        parse_args(TINY + "--train-iters 4 --cuda-graph-impl full_iteration".split(), world_size=1)
    assert "needs CUDA" in capsys.readouterr().err


@pytest.mark.parametrize("spelling", ["--cuda-graph-impl full_iteration",
                                      "--cuda-graph-impl local --cuda-graph-scope full_iteration"])
def test_both_spellings_reach_megatron_cores_config(spelling, monkeypatch):
    from megatron_moe import arguments
    from megatron_moe.arguments import parse_args
    from megatron_moe.compat.versions import mcore_at_least
    from megatron_moe.models.builder import transformer_config_from_args

    monkeypatch.setattr(arguments, "_cuda_available", lambda: True)
    args = parse_args(TINY + ["--train-iters", "4", "--no-check-for-nan-in-loss-and-grad",
                              "--moe-grouped-gemm"] + spelling.split(), world_size=1)
    config = transformer_config_from_args(args)
    if mcore_at_least("0.19"):
        assert config.cuda_graph_impl == "full_iteration"
    else:
        from megatron.core.transformer.enums import CudaGraphScope

        assert config.cuda_graph_impl == "local"
        assert config.cuda_graph_scope == [CudaGraphScope.full_iteration]
    # what our MoE layers read to keep the expert counts on the device (the region's captures
    # above run with core_v0.16's field left at "none": its "local" impl builds per-layer graphs)
    from megatron_moe.compat.cuda_graph import captures_whole_iterations

    assert captures_whole_iterations(config)
    assert not captures_whole_iterations(transformer_config_from_args(
        parse_args(TINY + ["--train-iters", "4"], world_size=1)))
