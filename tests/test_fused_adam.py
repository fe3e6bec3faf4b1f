"""megatron-core's torch Adam fallback (no TE, no apex) on torch's fused kernel, as the local path
does on CUDA (megatron_moe/compat/optimizer.py fuse_torch_adam); forced on the CPU here: the same
training within float rounding of the per-tensor path, the fused kernel called once per step, and a
resume from a checkpoint (plain and distributed optimizer, whose loads restore host step counters)
continues exactly as the straight fused run."""

import pytest
import torch

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


@pytest.mark.parametrize("mutate", [None, "walk_every_step", "ignore_loads", "ignore_saves"])
def test_fused_adam_pre_hook_walks_the_parameters_only_when_the_groups_may_have_changed(
        monkeypatch, mutate):
    """The pre-hook's walk over every parameter runs before the first step, then only after a
    ``load_state_dict`` (here one that brings back unfused groups) and after a ``state_dict`` (the
    distributed optimizer's save bridge creates host ``step`` counters: here a float64 one stands
    in, which the fused kernel's layout makes float32). Mutations: the walk on every step; loads
    (hook and group identities) or saves not followed."""
    import operator

    from megatron_moe.compat import optimizer as opt_compat

    walked = {"params": 0}

    def fusable(param):
        walked["params"] += 1
        return True
    monkeypatch.setattr(opt_compat, "fusable", fusable)
    fused = {"calls": 0}
    orig_fused = torch._fused_adamw_

    def counted(*args, **kwargs):
        fused["calls"] += 1
        return orig_fused(*args, **kwargs)
    monkeypatch.setattr(torch, "_fused_adamw_", counted)
    if mutate == "walk_every_step":
        orig_fuse = opt_compat.fuse_torch_adam

        def fuse_each_step(optimizer):
            for opt in opt_compat.torch_adams(optimizer):
                opt.register_step_pre_hook(lambda opt, a, k: opt_compat._fuse_groups(opt))
            return orig_fuse(optimizer)
        monkeypatch.setattr(opt_compat, "fuse_torch_adam", fuse_each_step)
    if mutate == "ignore_loads":
        monkeypatch.setattr(torch.optim.Optimizer, "register_load_state_dict_post_hook",
                            lambda self, hook, prepend=False: None)
        monkeypatch.setattr(operator, "is_", lambda a, b: True)
    if mutate == "ignore_saves":
        monkeypatch.setattr(torch.optim.Optimizer, "register_state_dict_pre_hook",
                            lambda self, hook, prepend=False: None)

    params = [torch.nn.Parameter(torch.ones(4)) for _ in range(3)]

    def step(opt):
        for p in params:
            p.grad = torch.full_like(p, 0.5)
        opt.step()

    unfused = torch.optim.AdamW([torch.nn.Parameter(torch.ones(4)) for _ in range(3)], lr=0.1)
    for p in unfused.param_groups[0]["params"]:
        p.grad = torch.ones_like(p)
    unfused.step()
    unfused_checkpoint = unfused.state_dict()   # (not hooked) an unfused run's, after one step

    opt = torch.optim.AdamW(params, lr=0.1, foreach=False)
    assert opt_compat.fuse_torch_adam(opt) == 1
    seen = {}
    for _ in range(3):
        step(opt)
    seen["walked after 3 steps"] = walked["params"]
    opt.load_state_dict(unfused_checkpoint)
    assert opt.param_groups[0]["fused"] is not True   # the unfused groups came back
    step(opt)
    seen["fused after a load"] = opt.param_groups[0]["fused"]
    seen["walked after a load"] = walked["params"]
    opt.state[params[0]]["step"] = torch.tensor(5.0, dtype=torch.float64)
    opt.state_dict()
    try:
        step(opt)
        seen["step after a save"] = opt.state[params[0]]["step"].dtype
    except RuntimeError as e:   # torch's fused kernel refusing the float64 counter
        seen["step after a save"] = str(e)
    seen["walked after a save"] = walked["params"]
    seen["fused calls"] = fused["calls"]

    followed = {"walked after 3 steps": 3, "fused after a load": True, "walked after a load": 6,
                "step after a save": torch.float32, "walked after a save": 9, "fused calls": 5}
    if mutate is None:
        assert seen == followed
    elif mutate == "walk_every_step":
        assert seen["walked after 3 steps"] > 3, seen
    elif mutate == "ignore_loads":
        assert seen["fused after a load"] is not True, seen
    else:
        assert seen["step after a save"] != torch.float32, seen
