#!/usr/bin/env bash
# Qwen3-30B-A3B's configuration (examples/train_qwen3_30b_a3b_distributed.sh, Megatron-LM's flags)
# with only the sizes overridden, on 2 CPU processes (gloo), expert parallelism 2: QK layernorm,
# --kv-channels independent of hidden/heads, fine-grained top-8 experts, fp32 router, no shared
# expert. --moe-grouped-gemm and --moe-permute-fusion (GPU kernels) are dropped, and so is
# --use-distributed-optimizer, so that tests/test_qwen3.py can add the project's features to this
# script unchanged (expert offload refuses the distributed optimizer); its CPU resume is tested by
# tests/test_megatron_mixtral_config.py and tests/test_distrib_optimizer.py.
# tests/test_qwen3.py runs it.
#   bash examples/train_qwen3_30b_a3b_cpu.sh CHECKPOINT_PATH TOKENIZER_MODEL DATA_PATH [extra flags...]
# TOKENIZER_MODEL: a HuggingFace tokenizer directory (tokenizer.json).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CHECKPOINT_PATH=$1; TOKENIZER_MODEL=$2; DATA_PATH=$3; shift 3
PY="${PYTHON:-$ROOT/.venv/bin/python}"
TP=${TP:-1}; PP=${PP:-1}; EP=${EP:-2}

DISTRIBUTED_ARGS=(--nproc_per_node 2 --nnodes 1 --master_addr 127.0.0.1 --master_port "${MASTER_PORT:-29512}")
MODEL_ARGS=(--use-mcore-models --num-layers 2 --hidden-size 64 --ffn-hidden-size 192
            --num-attention-heads 4 --group-query-attention --num-query-groups 2 --kv-channels 32
            --qk-layernorm --seq-length 64 --max-position-embeddings 640
            --position-embedding-type rope --rotary-percent 1.0 --rotary-base 1000000
            --normalization RMSNorm --norm-epsilon 1e-6 --swiglu
            --untie-embeddings-and-output-weights --disable-bias-linear --hidden-dropout 0.0
            --attention-dropout 0.0 --no-masked-softmax-fusion --no-rope-fusion
            --no-bias-swiglu-fusion --make-vocab-size-divisible-by 1187)
MOE_ARGS=(--num-experts 16 --moe-ffn-hidden-size 16 --moe-router-topk 8 --moe-router-dtype fp32
          --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-3
          --moe-token-dispatcher-type alltoall)
DATA_ARGS=(--data-path "$DATA_PATH" --split 98,2,0 --tokenizer-type HuggingFaceTokenizer
           --tokenizer-model "$TOKENIZER_MODEL")
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
