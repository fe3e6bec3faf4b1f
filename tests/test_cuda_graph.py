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
micro-batch, the dispatcher's host copy left in) must each be caught.

The captured backward must accumulate into AccumulateGrad nodes made in that call's forward only:
megatron-core's DDP keeps nodes made on the default stream at its construction, and a capture on
a side stream fails accumulating into them (a torch without set_override_stale_capture_stream, as
an H200 run showed); with a full-iteration graph compat.ddp.hook_parameters moves DDP's hooks to
the parameters and drops the nodes. The emulated capture walks each loss's graph for nodes alive
before the call, and the moved hooks must train bit-equal to DDP's own.

The capture and replay themselves run on CUDA only (the perf section's ``ours-graphed`` row).
"""

import functools

import pytest
import torch

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

    for r in _run(extra):
        calls, losses, reads = r["calls"], r["losses"], r["reads"]
        assert calls["training"] == 3 and len(losses) == 3, (calls, losses)
        assert calls.get("validation", 0) >= 2, calls   # evaluation after training, both sets
        assert r["impl"] == ("full_iteration" if mcore_at_least("0.19") else "none"), r["impl"]
        assert not reads.get("training") and not reads.get("validation"), reads
        # the captured backwards reach AccumulateGrad nodes, all made in their own forward
        assert r["accumulators"] > 0 and not r["stale"], (r["accumulators"], r["stale"])


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
    for r in _run(mutate=tuple(planted)):
        seen = [what for owner, where, what in r["reads"]["training"]]
        for name, what in planted.items():
            assert any(what in s for s in seen), (name, seen)


PER_EXPERT_WEIGHTS = ["--moe-single-grouped-weight"]   # dropped: one weight per expert


@functools.cache
def _graphed(weights="single", mutate=None):
    """Rank 0's results of the graphed run; ``weights`` "per-expert": one weight parameter per
    expert (the grouped backward's foreach add into main_grad) in place of the single grouped
    weight; ``mutate``: tests/_cuda_graph_cases.py MUTATIONS."""
    drop = PER_EXPERT_WEIGHTS if weights == "per-expert" else []
    argv = TINY + [f for f in GRAPH if f not in drop]
    return run_distributed(cases.train, 2, argv, timeout_s=300, mutate=mutate)[0]


@pytest.mark.parametrize("weights", ["single", "per-expert"])
def test_ddp_hooks_moved_to_the_parameters_train_bit_equal(weights):
    """The graphed run's DDP hooks run on the parameters (none on a node, DDP keeps no node) and
    train bit-equal to DDP's own hooks on its nodes (compat.ddp.hook_parameters a no-op): same
    losses, same grad norms, the same number of hook runs; the grouped experts' weight grads went
    into main_grad in their backward."""
    moved, kept = _graphed(weights), _graphed(weights, ("ddp-nodes-kept",))
    assert moved["hooks"].get("node", 0) == 0 and moved["hooks"]["parameter"] > 0, moved["hooks"]
    assert not any(moved["grad_accs"]), moved["grad_accs"]
    assert kept["hooks"].get("parameter", 0) == 0, kept["hooks"]
    assert kept["hooks"]["node"] == moved["hooks"]["parameter"], (kept["hooks"], moved["hooks"])
    assert all(kept["grad_accs"]), kept["grad_accs"]
    assert moved["wgrads_into_main_grad"] > 0 and \
        moved["wgrads_into_main_grad"] == kept["wgrads_into_main_grad"]
    assert len(moved["losses"]) == 3 and moved["losses"] == kept["losses"], (moved, kept)
    assert moved["grad_norms"] == kept["grad_norms"], (moved, kept)


def test_the_captured_backward_reaches_no_node_made_before_it():
    """The GPU failure's condition: the captured call's backward accumulates into an
    AccumulateGrad node alive before the call (on CUDA made on the default stream). None is
    reached; with DDP's hooks left on the nodes it keeps, every parameter's is; with the
    dispatchers' last probs left attached to their graph (compat.dispatch.drop_kept_graph a
    no-op), those of the parameters before the last MoE layer's router are (and the run trains
    the same)."""
    moved = _graphed()
    kept, dispatcher = _graphed(mutate=("ddp-nodes-kept",)), _graphed(mutate=("dispatcher-graph",))
    assert moved["accumulators"] > 0 and not moved["stale"], moved["stale"]
    assert kept["stale"] and len(kept["stale"]) == kept["accumulators"], kept["stale"]
    assert dispatcher["stale"], dispatcher
    assert any("word_embeddings" in name for name in dispatcher["stale"]), dispatcher["stale"]
    assert dispatcher["losses"] == moved["losses"] and \
        dispatcher["grad_norms"] == moved["grad_norms"], (dispatcher, moved)


class _FakeDDP(torch.nn.Module):
    """megatron-core DDP's members that compat.ddp.hook_parameters uses, its hook as DDP's: it
    runs once the gradient is accumulated, moves it away (``grad = None``)."""

    def __init__(self, module):
        super().__init__()
        from megatron_moe.compat.ddp import grad_accumulator

        self.module, self.runs, self.grad_accs = module, [], []
        for p in module.parameters():
            node = grad_accumulator(p)
            node.register_hook(self._make_backward_post_hook(p))
            self.grad_accs.append(node)

    def _make_backward_post_hook(self, param):
        def hook(*unused):
            self.runs.append((param, param.grad is not None))
            param.grad = None
        return hook


def test_hook_parameters_moves_the_hook_and_releases_the_nodes():
    from megatron_moe.compat import ddp as D

    ddp = _FakeDDP(torch.nn.Linear(3, 2))
    assert D.hook_parameters([ddp]) == 2 and ddp.grad_accs == []
    for _ in range(2):
        ddp.module(torch.ones(1, 3)).sum().backward()
    params = list(ddp.module.parameters())
    # once per parameter per backward, after the accumulation (the grad was there)
    runs = sorted((id(p), accumulated) for p, accumulated in ddp.runs)
    assert runs == sorted([(id(p), True) for p in params] * 2), ddp.runs
    assert all(p.grad is None for p in params)
    # DDP's nodes are gone: autograd made new ones (unmarked)
    assert not any(D._DROPPED in D.grad_accumulator(p).metadata for p in params)


def test_hook_parameters_refuses_a_node_kept_alive():
    """A graph through a parameter's node outlives DDP's references: the next forward would
    reuse the node with both hooks on it (and on CUDA the capture would accumulate into it)."""
    from megatron_moe.compat import ddp as D

    ddp = _FakeDDP(torch.nn.Linear(3, 2))
    kept = ddp.module(torch.ones(1, 3))   # its graph holds both parameters' nodes
    with pytest.raises(RuntimeError, match="stay alive"):
        D.hook_parameters([ddp])
    del kept


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
