#!/usr/bin/env bash
# Mixtral-8x7B-shaped GPT-MoE on one node with 8 GPUs (NCCL).
# Default mapping: TP=1, PP=1, EP=8 (DP=8): every GPU holds one of the 8 experts of each layer and
# attention is data parallel. For long sequences use e.g. TP=2 PP=2 EP=2 (SP is on with TP>1).
#   bash examples/train_mixtral_8x7b_1node_8gpu.sh CHECKPOINT_PATH TOKENIZER_MODEL DATA_PATH [flags]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CHECKPOINT_PATH=$1; TOKENIZER_MODEL=$2; DATA_PATH=$3; shift 3
TP=${TP:-1}; PP=${PP:-1}; EP=${EP:-8}
export CUDA_DEVICE_MAX_CONNECTIONS=1

DISTRIBUTED_ARGS=(--nproc_per_node 8 --nnodes 1 --master_addr localhost --master_port 6000)
MODEL_ARGS=(--num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32
            --group-query-attention --num-query-groups 8 --seq-length 4096
            --max-position-embeddings 32768 --position-embedding-type rope --rotary-base 1000000
            --normalization RMSNorm --swiglu --untie-embeddings-and-output-weights
            --disable-bias-linear --hidden-dropout 0.0 --attention-dropout 0.0
            --init-method-std 0.01)
MOE_ARGS=(--num-experts 8 --moe-router-topk 2 --moe-router-load-balancing-type aux_loss
          --moe-aux-loss-coeff 1e-2 --moe-token-dispatcher-type alltoall --moe-grouped-gemm
          --moe-permute-fusion)
DATA_ARGS=(--data-path "$DATA_PATH" --split 99990,8,2 --tokenizer-type SentencePieceTokenizer
           --tokenizer-model "$TOKENIZER_MODEL")
TRAINING_ARGS=(--micro-batch-size 1 --global-batch-size 256 --lr 1e-4 --train-iters 500000
               --lr-decay-iters 320000 --lr-decay-style cosine --min-lr 1e-5 --weight-decay 0.1
               --lr-warmup-iters 500 --clip-grad 1.0 --bf16)
MODEL_PARALLEL_ARGS=(--tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP"
                     --expert-model-parallel-size "$EP" --use-distributed-optimizer
                     --sequence-parallel)
LOGGING_ARGS=(--log-interval 1 --save-interval 1000 --eval-interval 1000 --eval-iters 10
              --save "$CHECKPOINT_PATH" --load "$CHECKPOINT_PATH" --ckpt-format torch_dist
              --tensorboard-dir "$CHECKPOINT_PATH/tensorboard")

exec torchrun "${DISTRIBUTED_ARGS[@]}" "$ROOT/pretrain_gpt_moe.py" "${MODEL_ARGS[@]}" \
    "${MOE_ARGS[@]}" "${DATA_ARGS[@]}" "${TRAINING_ARGS[@]}" "${MODEL_PARALLEL_ARGS[@]}" \
    "${LOGGING_ARGS[@]}" "$@"
