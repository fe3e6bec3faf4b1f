"""--moe-shared-expert-overlap on the local path (megatron-core's SharedExpertMLP overlap: the shared
experts run in pieces inside the alltoall dispatcher, on a side CUDA stream, while the tokens are
exchanged). On 2 gloo ranks with expert parallelism: the overlapped pieces run (counted) only with
the flag, the losses equal the non-overlapped run's to summation order (megatron-core: the router
and shared-expert gradients reach the hidden states in another order); mutation: the builder drops
the flag. The stream overlap itself is a GPU matter (unverified on a GPU)."""

import math

import pytest

from megatron_moe.runtime.local_ranks import run_distributed
from tests.test_training import TINY

SHARED = ("--attention-dropout 0 --hidden-dropout 0 --train-iters 3 --expert-model-parallel-size 2 "
          "--moe-shared-expert-intermediate-size 32 --moe-grouped-gemm").split()


def train_counting_overlap(rank, world_size, argv, mutate=None):
    from megatron.core.transformer.moe.shared_experts import SharedExpertMLP

    from megatron_moe.models import builder
    from tests._train_cases import run_pretrain

    if mutate == "flag-dropped":
        make = builder.transformer_config_from_args

        def without_overlap(args, *a, **k):
            config = make(args, *a, **k)
            config.moe_shared_expert_overlap = False
            return config

        builder.transformer_config_from_args = without_overlap
    calls = [0]
    piece = SharedExpertMLP.linear_fc1_forward_and_act

    def counted(self, *a, **k):
        calls[0] += 1
        return piece(self, *a, **k)

    SharedExpertMLP.linear_fc1_forward_and_act = counted
    try:
        return run_pretrain(rank, world_size, argv)["lm_loss"], calls[0]
    finally:
        SharedExpertMLP.linear_fc1_forward_and_act = piece


def _check(mutate=None):
    plain, plain_calls = run_distributed(train_counting_overlap, 2, TINY + SHARED,
                                         timeout_s=300)[0]
    overlapped, calls = run_distributed(train_counting_overlap, 2,
                                        TINY + SHARED + ["--moe-shared-expert-overlap"],
                                        timeout_s=300, mutate=mutate)[0]
    # forward only (the backward is autograd's): 2 MoE layers x (3 iterations x 2 micro-batches
    # a rank + validation and test after training, 2 micro-batches each)
    assert plain_calls == 0 and calls == 2 * (3 * 2 + 2 * 2), (plain_calls, calls)
    assert len(set(plain)) == 3
    assert all(math.isclose(a, b, rel_tol=1e-6) for a, b in zip(overlapped, plain)), (overlapped, plain)


def test_shared_expert_overlap_runs_with_the_same_losses():
    _check()


def test_shared_expert_overlap_mutation_fails():
    with pytest.raises(AssertionError):
        _check("flag-dropped")


@pytest.mark.parametrize("flags", [
    "--moe-shared-expert-intermediate-size 32 --moe-token-dispatcher-type allgather",
    "--moe-token-dispatcher-type alltoall"])   # no shared experts
def test_needs_shared_experts_and_the_alltoall_dispatcher(flags, capsys):
    from megatron_moe.arguments import parse_args

    with pytest.raises(SystemExit):
        parse_args(TINY + ["--moe-shared-expert-overlap"] + flags.split(), world_size=2)
    err = capsys.readouterr().err
    assert "--moe-shared-expert-overlap needs shared experts" in err, err
    assert len(err.strip().splitlines()) == 2, err
