"""On CUDA the local path takes megatron-core's own torch.compile fusions (bias + SwiGLU, also
per-token weighted inside the experts; bias-dropout-add; the native fused cross-entropy:
megatron_moe/models/builder.py _fusion_selectors). On the CPU the builder leaves them off (tests
run the eager ops); here they are forced on as on CUDA, through grouped experts and SDPA, the fused
functions counted: SwiGLU and bias-dropout-add train bit for bit as the eager ops (fp32); the
fused cross-entropy gives the same losses and rounds the logits' gradient to bf16 (megatron-core's
fused_cross_entropy.py casts it so, whatever the run's dtype), so its grad norms are close, not
equal."""

from megatron_moe.runtime.local_ranks import run_distributed
from tests import _fusion_cases as F

ARGV = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
        "--micro-batch-size 2 --global-batch-size 4 --lr 3e-3 --mock-data "
        "--tokenizer-type NullTokenizer --vocab-size 256 --num-experts 4 --moe-ffn-hidden-size 32 "
        "--moe-router-topk 2 --swiglu --moe-token-dispatcher-type alltoall --log-interval 1 "
        "--eval-interval 1000 --eval-iters 1 --disable-bias-linear --train-iters 3 "
        "--moe-grouped-gemm --attention-backend flash --cross-entropy-loss-fusion "
        "--hidden-dropout 0 --attention-dropout 0").split()
ITERS, LAYERS, MICRO = 3, 2, 2
EVAL = 2   # after training: one batch each of the validation and test sets (forward only)


def test_compiled_fusions_train_as_the_eager_ops():
    eager, = run_distributed(F.run, 1, ARGV, False, timeout_s=300)
    mlp, = run_distributed(F.run, 1, ARGV, ["bias_activation_fusion", "bias_dropout_fusion"],
                           timeout_s=600)
    ce, = run_distributed(F.run, 1, ARGV, ["cross_entropy_loss_fusion"], timeout_s=600)
    assert eager["calls"] == {"swiglu": 0, "cross_entropy": 0}
    # the weighted SwiGLU of the grouped experts: per MoE layer per micro-batch
    assert mlp["calls"] == {"swiglu": (ITERS + EVAL) * LAYERS * MICRO, "cross_entropy": 0}
    assert mlp["losses"] == eager["losses"] and mlp["grad_norms"] == eager["grad_norms"]
    assert ce["calls"] == {"swiglu": 0, "cross_entropy": (ITERS + EVAL) * MICRO}
    assert ce["losses"][0] == eager["losses"][0]
    for a, b in zip(ce["losses"] + ce["grad_norms"], eager["losses"] + eager["grad_norms"]):
        assert abs(a - b) <= 5e-3 * abs(b), (ce, eager)
