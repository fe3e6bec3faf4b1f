#!/usr/bin/env bash
# gpt-oss-20b's configuration (examples/train_gpt_oss_20b_distributed.sh, Megatron-LM's flags) with
# only the sizes overridden, on 2 CPU processes (gloo), expert parallelism 2: attention sinks
# (--softmax-type learnable), a sliding window on every other layer (--window-size 3,0 here: the
# sequence is 32 tokens), clamped quick-GEGLU experts with biases, YaRN RoPE. Synthetic data and
# NullTokenizer, as Megatron-LM's examples/gptoss/02_train.sh defaults to. --moe-grouped-gemm
# (a GPU kernel) and --use-distributed-optimizer are dropped. tests/test_gpt_oss.py runs it.
#   bash examples/train_gpt_oss_20b_cpu.sh CHECKPOINT_PATH [extra flags...]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CHECKPOINT_PATH=$1; shift 1
PY="${PYTHON:-$ROOT/.venv/bin/python}"
TP=${TP:-1}; PP=${PP:-1}; EP=${EP:-2}

DISTRIBUTED_ARGS=(--nproc_per_node 2 --nnodes 1 --master_addr 127.0.0.1 --master_port "${MASTER_PORT:-29514}")
MODEL_ARGS=(--use-mcore-models --num-layers 2 --hidden-size 64 --ffn-hidden-size 64
            --num-attention-heads 4 --group-query-attention --num-query-groups 2 --kv-channels 16
            --seq-length 32 --max-position-embeddings 1024
            --position-embedding-type yarn --rotary-percent 1.0 --rotary-base 150000
            --rotary-scaling-factor 32 --yarn-original-max-position-embeddings 32
            --yarn-beta-fast 32 --yarn-beta-slow 1 --mscale 1.0 --mscale-all-dim 0.0
            --no-yarn-correction-range-round-to-int
            --softmax-type learnable --window-size 3,0 --window-attn-skip-freq 2
            --quick-geglu --glu-linear-offset 1.0 --activation-func-clamp-value 7.0
            --normalization RMSNorm --norm-epsilon 1e-5 --add-bias-linear
            --untie-embeddings-and-output-weights --hidden-dropout 0.0 --attention-dropout 0.0
            --no-masked-softmax-fusion --no-rope-fusion --no-bias-gelu-fusion
            --no-bias-dropout-fusion --make-vocab-size-divisible-by 128)
MOE_ARGS=(--num-experts 4 --moe-ffn-hidden-size 64 --moe-router-topk 2 --moe-router-dtype fp32
          --moe-router-score-function softmax --moe-router-load-balancing-type aux_loss
          --moe-aux-loss-coeff 1e-3 --moe-token-dispatcher-type alltoall)
DATA_ARGS=(--mock-data --tokenizer-type NullTokenizer --vocab-size 511)
TRAINING_ARGS=(--micro-batch-size 2 --global-batch-size 8 --lr 3e-3 --train-iters 100
               --lr-decay-style cosine --min-lr 3e-4 --weight-decay 0.1 --lr-warmup-iters 2
               --clip-grad 1.0 --bf16)
MODEL_PARALLEL_ARGS=(--tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP"
                     --expert-model-parallel-size "$EP" --distributed-backend gloo)
if [ "$TP" -gt 1 ]; then MODEL_PARALLEL_ARGS+=(--sequence-parallel); fi
LOGGING_ARGS=(--log-interval 1 --eval-interval 1000 --eval-iters 1 --save "$CHECKPOINT_PATH"
              --load "$CHECKPOINT_PATH" --save-interval 50 --ckpt-format torch_dist)

exec "$PY" -m torch.distributed.run "${DISTRIBUTED_ARGS[@]}" "$ROOT/pretrain_gpt_moe.py" \
    "${MODEL_ARGS[@]}" "${MOE_ARGS[@]}" "${DATA_ARGS[@]}" "${TRAINING_ARGS[@]}" \
    "${MODEL_PARALLEL_ARGS[@]}" "${LOGGING_ARGS[@]}" "$@"
