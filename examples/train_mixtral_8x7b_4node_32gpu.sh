#!/usr/bin/env bash
# Mixtral-8x7B-shaped GPT-MoE (46.7B parameters) on 4 nodes x 8 GPUs (NCCL), 80 GB each.
# gpu-memory-gb: 80
# Mapping: TP=1, PP=4, EP=8 (DP=8, expert-DP=1): each GPU holds 8 of the 32 layers and one of the
# 8 experts of each; 1F1B keeps up to 4 micro-batches of activations on the first stage.
# Per GPU (python tools/report_theoretical_memory.py <these flags> --world-size 32): ~3.8 GB bf16
# weights + 7.5 GB fp32 grads + 17.6 GB Adam/main params + 31.8 GB activations = ~61 GB.
# Why not one node: bf16 weights + fp32 grads + fp32 Adam state are 18 bytes per parameter,
# 46.7B x 18 B = 840 GB, more than 8 x 80 GB however it is split; the old 1-node TP1 PP1 EP8
# mapping needed ~108 GB/GPU before activations (~146 GB with them). What this trades: 4x the
# GPUs, and a pipeline bubble of (PP-1)/micro-batches = 3/32 (~9%) of each step; the all-to-all
# stays inside a node (EP=8 = GPUs per node), PP's point-to-point crosses nodes.
#   NNODES=4 NODE_RANK=0..3 MASTER_ADDR=host0 \
#   bash examples/train_mixtral_8x7b_4node_32gpu.sh CHECKPOINT_PATH TOKENIZER_MODEL DATA_PATH [flags]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CHECKPOINT_PATH=$1; TOKENIZER_MODEL=$2; DATA_PATH=$3; shift 3
GPUS_PER_NODE=${GPUS_PER_NODE:-8}; NNODES=${NNODES:-4}; NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-localhost}; MASTER_PORT=${MASTER_PORT:-6000}
TP=${TP:-1}; PP=${PP:-4}; EP=${EP:-8}
export CUDA_DEVICE_MAX_CONNECTIONS=1

DISTRIBUTED_ARGS=(--nproc_per_node "$GPUS_PER_NODE" --nnodes "$NNODES" --node_rank "$NODE_RANK"
                  --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT")
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
                     --expert-model-parallel-size "$EP" --use-distributed-optimizer)
if [ "$TP" -gt 1 ]; then MODEL_PARALLEL_ARGS+=(--sequence-parallel); fi
LOGGING_ARGS=(--log-interval 1 --save-interval 1000 --eval-interval 1000 --eval-iters 10
              --save "$CHECKPOINT_PATH" --load "$CHECKPOINT_PATH" --ckpt-format torch_dist
              --tensorboard-dir "$CHECKPOINT_PATH/tensorboard")

exec torchrun "${DISTRIBUTED_ARGS[@]}" "$ROOT/pretrain_gpt_moe.py" "${MODEL_ARGS[@]}" \
    "${MOE_ARGS[@]}" "${DATA_ARGS[@]}" "${TRAINING_ARGS[@]}" "${MODEL_PARALLEL_ARGS[@]}" \
    "${LOGGING_ARGS[@]}" "$@"
