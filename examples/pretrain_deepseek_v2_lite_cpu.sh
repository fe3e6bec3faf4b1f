#!/usr/bin/env bash
# DeepSeek-V2-Lite's configuration (examples/pretrain_deepseek_v2_lite.sh, Megatron-LM's) with only
# the sizes overridden, on 2 CPU processes (gloo), expert parallelism 2, synthetic data.
# --moe-grouped-gemm is dropped (a GPU kernel). The tests run it (tests/test_deepseek.py).
#   bash examples/pretrain_deepseek_v2_lite_cpu.sh CHECKPOINT_PATH [extra flags...]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CHECKPOINT_PATH=$1; shift 1
PY="${PYTHON:-$ROOT/.venv/bin/python}"

DISTRIBUTED_ARGS=(--nproc_per_node 2 --nnodes 1 --master_addr 127.0.0.1 --master_port "${MASTER_PORT:-29512}")
MODEL_ARGS=(--attention-dropout 0.0 --hidden-dropout 0.0 --no-masked-softmax-fusion
            --disable-bias-linear --untie-embeddings-and-output-weights
            --position-embedding-type rope --no-rope-fusion --normalization RMSNorm
            --norm-epsilon 1e-6 --swiglu --num-layers 3 --hidden-size 64
            --ffn-hidden-size 128 --num-attention-heads 4 --kv-channels 16
            --multi-latent-attention --kv-lora-rank 16 --v-head-dim 16 --qk-head-dim 16
            --qk-layernorm --qk-pos-emb-head-dim 8 --seq-length 64
            --max-position-embeddings 64 --make-vocab-size-divisible-by 128
            --attention-softmax-in-fp32 --use-mcore-models --rotary-percent 1.0
            --rotary-base 10000 --rotary-scaling-factor 40 --mscale 0.707 --mscale-all-dim 0.707)
MOE_ARGS=(--num-experts 8 --moe-layer-freq "([0]+[1]*2)" --moe-ffn-hidden-size 32
          --moe-router-score-function softmax --moe-router-topk 6
          --moe-router-topk-scaling-factor 1.0 --moe-router-pre-softmax
          --moe-shared-expert-intermediate-size 64 --moe-aux-loss-coeff 1e-3
          --moe-token-dispatcher-type alltoall --moe-token-drop-policy probs
          --moe-router-load-balancing-type seq_aux_loss)
DATA_ARGS=(--mock-data --tokenizer-type NullTokenizer --vocab-size 1000)
TRAINING_ARGS=(--micro-batch-size 2 --global-batch-size 8 --lr 4.2e-3 --min-lr 4.2e-4
               --lr-decay-style cosine --lr-warmup-iters 1 --train-iters 6
               --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --clip-grad 1.0
               --init-method-std 0.02 --seed 1234)
MODEL_PARALLEL_ARGS=(--tensor-model-parallel-size 1 --pipeline-model-parallel-size 1
                     --expert-model-parallel-size 2 --sequence-parallel --distributed-backend gloo)
LOGGING_ARGS=(--log-interval 1 --save-interval 3 --eval-interval 1000 --eval-iters 1
              --save "$CHECKPOINT_PATH" --ckpt-format torch_dist)

exec "$PY" -m torch.distributed.run "${DISTRIBUTED_ARGS[@]}" "$ROOT/pretrain_gpt_moe.py" \
    "${MODEL_ARGS[@]}" "${MOE_ARGS[@]}" "${DATA_ARGS[@]}" "${TRAINING_ARGS[@]}" \
    "${MODEL_PARALLEL_ARGS[@]}" "${LOGGING_ARGS[@]}" "$@"
