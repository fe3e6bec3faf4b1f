"""The dispatcher hooks: our fused permute kernels inside megatron-core's alltoall dispatcher."""

from tests.test_training import train


def test_permute_fusion_gives_bit_identical_training():
    layout = ("--expert-model-parallel-size 2 --train-iters 3 --moe-expert-capacity-factor 1.5 "
              "--moe-pad-expert-input-to-capacity")
    dropless = "--expert-model-parallel-size 2 --train-iters 3"
    for flags in (dropless, layout):
        plain = train(2, flags)[0]
        fused = train(2, flags + " --moe-permute-fusion")[0]
        assert fused["lm_loss"] == plain["lm_loss"]
        assert fused["grad_norm"] == plain["grad_norm"]
