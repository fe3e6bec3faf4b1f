"""Host (Python) work our own code adds to a training iteration does not grow with the number of
experts (the H200 profile: the fine-grained model host-bound, the device busy 16% of the time).
Counted, not timed: the Python function calls made in or from megatron_moe/ in one iteration of
the real loop (tests/_host_calls_cases.py), 4 experts against 16. The grouped experts read their
linears' parameters and hooks without a ``nn.Module.__getattr__`` call per expert, test DDP's
``main_grad`` of all the weights in one call, and the fused Adam pre-hook walks the parameters
before the first step and after loads and saves only. Mutations: each of those put back as it was.

With ``--moe-single-grouped-weight`` every Python call of the iteration is counted (megatron-core's
and torch's too, and builtins), 4 experts against 32: equal, and so is the number of modules,
because the empty per-expert MLPs are kept out of the module tree that megatron-core walks every
iteration (``finalize_model_grads``), and the grouped call tests its experts for balance replicas
only when they are not its own. Mutations: the shells registered again; the replica test per
expert.

That the pre-hook still follows loads and saves is tests/test_fused_adam.py's (its walk test and
the resumed runs)."""

import pytest

from megatron_moe.runtime.local_ranks import run_distributed
from tests import _host_calls_cases as C


def _argv(experts):
    return ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
            "--micro-batch-size 2 --global-batch-size 4 --lr 1e-3 --mock-data "
            "--tokenizer-type NullTokenizer --vocab-size 128 --swiglu --disable-bias-linear "
            f"--num-experts {experts} --moe-ffn-hidden-size 16 --moe-router-topk 2 "
            "--moe-token-dispatcher-type alltoall --moe-grouped-gemm --bf16 "
            "--log-interval 100 --eval-interval 1000 --eval-iters 1 --train-iters 3").split()


@pytest.mark.parametrize("mutate", [None, "experts_by_getattr", "main_grad_test_per_weight",
                                    "adam_walk_every_step"])
def test_host_calls_per_iteration_do_not_grow_with_experts(mutate):
    # comm/strict.py's device checks (a torch function mode on every op) are test machinery
    small, big = (run_distributed(C.count, 1, _argv(e), 3, mutate, timeout_s=300,
                                  env={"MEGATRON_MOE_STRICT_DEVICES": "0"})[0] for e in (4, 16))
    for experts, res in ((4, small), (16, big)):
        # the paths counted really ran: 2 layers x 2 micro-batches grouped, each expert's two
        # weights' grads into main_grad, the fused kernel once per param group
        assert res["ran"] == {"grouped_calls": 2 * 2, "fused_adam_calls": 2,
                              "wgrads_into_main_grad": 2 * 2 * 2 * experts}, res["ran"]
    n_small, n_big = sum(small["calls"].values()), sum(big["calls"].values())
    grown = {k: (small["calls"].get(k, 0), n) for k, n in big["calls"].items()
             if n != small["calls"].get(k, 0)}
    if mutate is None:
        assert n_small == n_big, grown
    else:   # a call per expert (12 more) per layer per micro-batch, or per parameter per step
        assert n_big - n_small >= 12 * 2 * 2, grown



@pytest.mark.parametrize("mutate", [None, "expert_shells_registered",
                                    "replicas_counted_per_expert"])
def test_single_grouped_weight_iteration_calls_and_modules_do_not_grow_with_experts(mutate):
    small, big = (run_distributed(C.count, 1, _argv(e) + ["--moe-single-grouped-weight"], 3,
                                  mutate, True, timeout_s=300,
                                  env={"MEGATRON_MOE_STRICT_DEVICES": "0"})[0] for e in (4, 32))
    for res in (small, big):
        # the stacked path ran: 2 layers x 2 micro-batches grouped, one main_grad add per stacked
        # weight (2 per layer) per micro-batch
        assert res["ran"] == {"grouped_calls": 2 * 2, "fused_adam_calls": 2,
                              "wgrads_into_main_grad": 2 * 2 * 2}, res["ran"]
    n_small, n_big = sum(small["calls"].values()), sum(big["calls"].values())
    grown = {k: (small["calls"].get(k, 0), n) for k, n in big["calls"].items()
             if n != small["calls"].get(k, 0)}
    if mutate is None:
        assert small["modules"] == big["modules"]
        assert n_small == n_big, grown
    elif mutate == "expert_shells_registered":
        # an MLP and its two linears per expert per layer, walked at least once per iteration
        assert big["modules"] - small["modules"] == 2 * 28 * 3
        assert n_big - n_small >= 2 * 28 * 3, grown
    else:   # an isinstance call per expert per layer per micro-batch
        assert big["modules"] == small["modules"]
        assert n_big - n_small >= 28 * 2 * 2, grown
