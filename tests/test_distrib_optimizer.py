"""--use-distributed-optimizer saves and resumes its Adam state bit-exactly on CPU, without
Transformer Engine or apex (megatron-core's torch.optim.Adam fallback, bridged by
megatron_moe/compat/distrib_optimizer.py), on both megatron-core releases.

One launch of 2 gloo ranks (EP=2: a dense and an expert DistributedOptimizer, chained): 5
iterations saving at 2; a resume from iteration 2 reproduces iterations 3-5 exactly (losses and
grad norms: iteration 4 on depends on the loaded moments and step count); and a resume with the
bridge's per-parameter step copy left out drifts (so the equality is the bridge's doing).
"""

import pytest

from megatron_moe.testing import run_distributed
from tests._ckpt_cases import TINY

BASE = TINY + ["--train-iters", "5", "--hidden-dropout", "0", "--attention-dropout", "0",
               "--use-distributed-optimizer", "--expert-model-parallel-size", "2"]


def _runs(rank, world_size, argvs):
    """pretrain() runs in sequence; the last one with the bridge's step copy undone."""
    import pretrain_gpt_moe
    from megatron.core import parallel_state
    from megatron.core.enums import ModelType
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    from megatron_moe.compat.distrib_optimizer import bridge_needed
    from megatron_moe.training import pretrain

    out = []
    for k, argv in enumerate(argvs):
        parallel_state.destroy_model_parallel()
        if k == len(argvs) - 1:  # mutation: megatron-core's shared step tensor is kept
            DistributedOptimizer.load_state_dict = DistributedOptimizer.load_state_dict.__wrapped__
        result = pretrain(pretrain_gpt_moe.train_valid_test_datasets_provider,
                          pretrain_gpt_moe.model_provider, ModelType.encoder_or_decoder,
                          pretrain_gpt_moe.forward_step, argv=argv)
        out.append(result["history"])
    return out, bridge_needed()


def test_distributed_optimizer_resumes_bit_exact(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    resume = BASE + ["--load", ckpt, "--ckpt-step", "2"]
    runs = [BASE + ["--save", ckpt, "--save-interval", "2"], resume, resume]
    histories, bridged = run_distributed(_runs, 2, runs, timeout_s=400)[0]
    if not bridged:
        pytest.skip("Transformer Engine or apex present: megatron-core's FusedAdam path")
    full, resumed, mutated = histories
    assert full["iteration"] == [1, 2, 3, 4, 5] and resumed["iteration"] == [3, 4, 5]
    assert all(x == x for x in full["lm_loss"])
    assert resumed["lm_loss"] == full["lm_loss"][2:]
    assert resumed["grad_norm"] == full["grad_norm"][2:]
    # without the bridge's own step per parameter, torch Adam advances one shared step tensor
    # once per parameter: the bias correction is wrong from the first resumed update on
    assert mutated["lm_loss"][0] == full["lm_loss"][2]
    assert mutated["lm_loss"][1:] != full["lm_loss"][3:]
