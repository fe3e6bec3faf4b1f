"""--use-distributed-optimizer saves and resumes its Adam state bit-exactly on CPU, without
Transformer Engine or apex (megatron-core's torch.optim.Adam fallback, bridged by
megatron_moe/compat/distrib_optimizer.py), on both megatron-core releases.

One launch of 2 gloo ranks (EP=2: a dense and an expert DistributedOptimizer, chained): 5
iterations saving at 2; a resume from iteration 2 reproduces iterations 3-5 exactly (losses and
grad norms: iteration 4 on depends on the loaded moments and step count); and a resume with the
bridge's per-parameter step copy left out drifts (so the equality is the bridge's doing).
The same launch then runs Megatron-LM's Mixtral precision/overlap flags (--bf16
--overlap-param-gather --overlap-grad-reduce): the distributed optimizer updates only each rank's
shard of the bf16 model params and defers their all-gather to the next forward, so a save must
gather first (training._params_gathered, Megatron's save_checkpoint_and_time); its calls are
counted. Without that gather (measured by removing it, 0.16.1) the checkpoint holds the other
shards' previous-iteration weights and the first resumed loss is 5.8449 instead of 5.8067.
"""

import pytest

from megatron_moe.runtime.local_ranks import run_distributed
from tests._ckpt_cases import TINY

BASE = TINY + ["--train-iters", "5", "--hidden-dropout", "0", "--attention-dropout", "0",
               "--use-distributed-optimizer", "--expert-model-parallel-size", "2"]
MIXTRAL_PRECISION = ["--bf16", "--overlap-param-gather", "--overlap-grad-reduce"]


def _runs(rank, world_size, argvs, mutated):
    """pretrain() runs in sequence; run number ``mutated`` on with the bridge's step copy undone.
    Also counts the synchronous param all-gathers before saves (disable_forward_pre_hook)."""
    import pretrain_gpt_moe
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.enums import ModelType
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    from megatron_moe.compat.distrib_optimizer import bridge_needed
    from megatron_moe.training.loop import pretrain

    gathers = []
    real_disable = DistributedDataParallel.disable_forward_pre_hook

    def counting_disable(self, param_sync=True):
        gathers.append(param_sync)
        return real_disable(self, param_sync)

    DistributedDataParallel.disable_forward_pre_hook = counting_disable
    out = []
    for k, argv in enumerate(argvs):
        parallel_state.destroy_model_parallel()
        bridged_load = DistributedOptimizer.load_state_dict  # installed by the first pretrain()
        if k == mutated:  # mutation: megatron-core's shared step tensor is kept
            DistributedOptimizer.load_state_dict = bridged_load.__wrapped__
        del gathers[:]
        result = pretrain(pretrain_gpt_moe.train_valid_test_datasets_provider,
                          pretrain_gpt_moe.model_provider, ModelType.encoder_or_decoder,
                          pretrain_gpt_moe.forward_step, argv=argv)
        if k == mutated:
            DistributedOptimizer.load_state_dict = bridged_load
        out.append((result["history"], list(gathers)))
    DistributedDataParallel.disable_forward_pre_hook = real_disable
    return out, bridge_needed()


def test_distributed_optimizer_resumes_bit_exact(tmp_path):
    ckpt, ckpt16 = str(tmp_path / "ckpt"), str(tmp_path / "ckpt16")
    resume = BASE + ["--load", ckpt, "--ckpt-step", "2"]
    bf16 = BASE + MIXTRAL_PRECISION
    runs = [BASE + ["--save", ckpt, "--save-interval", "2"], resume, resume,
            bf16 + ["--save", ckpt16, "--save-interval", "2"],
            bf16 + ["--load", ckpt16, "--ckpt-step", "2"]]
    results, bridged = run_distributed(_runs, 2, runs, 2, timeout_s=500)[0]
    if not bridged:
        pytest.skip("Transformer Engine or apex present: megatron-core's FusedAdam path")
    (full, no_overlap), (resumed, _), (mutated, _), (full16, saves16), (resumed16, _) = results
    assert full16["iteration"] == [1, 2, 3, 4, 5] and full16["lm_loss"] != full["lm_loss"]
    assert resumed16["iteration"] == [3, 4, 5]
    assert resumed16["lm_loss"] == full16["lm_loss"][2:]
    assert resumed16["grad_norm"] == full16["grad_norm"][2:]
    # bf16 + --overlap-param-gather: every save (iterations 2, 4 and the last, 5) first gathers
    # the params synchronously; without the overlap no gather is forced
    assert no_overlap == [] and saves16 == [True] * 3
    assert full["iteration"] == [1, 2, 3, 4, 5] and resumed["iteration"] == [3, 4, 5]
    assert all(x == x for x in full["lm_loss"])
    assert resumed["lm_loss"] == full["lm_loss"][2:]
    assert resumed["grad_norm"] == full["grad_norm"][2:]
    # without the bridge's own step per parameter, torch Adam advances one shared step tensor
    # once per parameter: the bias correction is wrong from the first resumed update on
    assert mutated["lm_loss"][0] == full["lm_loss"][2]
    assert mutated["lm_loss"][1:] != full["lm_loss"][3:]
