"""megatron-core's torch Adam fallback (no TE, no apex) on torch's fused kernel, as the local path
does on CUDA (megatron_moe/compat/optimizer.py fuse_torch_adam); forced on the CPU here: the same
training within float rounding of the per-tensor path, the fused kernel called once per step, and a
resume from a checkpoint (plain and distributed optimizer, whose loads restore host step counters)
continues exactly as the straight fused run."""

from megatron_moe.runtime.local_ranks import run_distributed
from tests import _fused_adam_cases as A


def _argv(iters, *extra):
    return ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
            "--micro-batch-size 2 --global-batch-size 4 --lr 3e-3 --lr-warmup-iters 1 "
            "--mock-data --tokenizer-type NullTokenizer --vocab-size 128 --swiglu "
            "--disable-bias-linear --num-experts 4 --moe-ffn-hidden-size 16 --moe-router-topk 2 "
            "--moe-token-dispatcher-type alltoall --moe-grouped-gemm --bf16 --log-interval 1 "
            f"--eval-interval 1000 --eval-iters 1 --train-iters {iters}").split() + list(extra)


def test_fused_adam_trains_as_the_per_tensor_path_and_resumes_exactly(tmp_path):
    plain, = run_distributed(A.run, 1, [_argv(4)], False, timeout_s=300)[0]
    ck, ck2 = str(tmp_path / "ck"), str(tmp_path / "ck2")
    dist = ["--use-distributed-optimizer"]
    runs = [_argv(4),
            _argv(4, "--save", ck, "--exit-interval", "2"), _argv(4, "--load", ck),
            _argv(4, *dist),
            _argv(4, *dist, "--save", ck2, "--exit-interval", "2"), _argv(4, *dist, "--load", ck2)]
    fused, saved, resumed, dfused, dsaved, dresumed = run_distributed(
        A.run, 1, runs, True, timeout_s=500)[0]
    # one fused call per param group (megatron-core's: with and without weight decay) per step
    assert plain["fused_calls"] == 0 and fused["fused_calls"] == 2 * 4
    assert dfused["fused_calls"] == 2 * 4
    for a, b in zip(fused["losses"] + fused["grad_norms"], plain["losses"] + plain["grad_norms"]):
        assert abs(a - b) <= 1e-6 * abs(b), (fused, plain)   # bit-equal on the CPU so far
    assert saved["losses"] == fused["losses"][:2] and resumed["losses"] == fused["losses"][2:]
    assert resumed["fused_calls"] == 2 * 2
    assert dsaved["losses"] == dfused["losses"][:2] and dresumed["losses"] == dfused["losses"][2:]
    assert dresumed["fused_calls"] == 2 * 2


def test_torch_adams_found_through_a_chain_without_touching_its_optimizer_property():
    """megatron-core's ChainedOptimizer (expert and dense parameters in separate optimizers)
    asserts when its ``.optimizer`` is read with more than one optimizer chained."""
    import torch
    from megatron.core.optimizer.optimizer import ChainedOptimizer

    from megatron_moe.compat.optimizer import torch_adams

    class Wrapper:   # a mixed-precision wrapper holds its torch optimizer as .optimizer
        def __init__(self, opt):
            self.optimizer = opt

    adams = [torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))]) for _ in range(2)]
    chain = ChainedOptimizer.__new__(ChainedOptimizer)
    chain.chained_optimizers = [Wrapper(a) for a in adams]
    try:
        chain.optimizer
    except AssertionError:
        pass
    else:
        raise AssertionError("megatron-core's chain no longer asserts: drop this test's premise")
    assert sorted(map(id, torch_adams(chain))) == sorted(map(id, adams))
