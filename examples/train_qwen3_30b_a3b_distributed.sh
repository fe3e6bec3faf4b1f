#!/usr/bin/env bash
# Qwen3-30B-A3B (30.5B parameters, 3.3B active: 48 layers, 128 fine-grained experts of 768, top-8,
# QK layernorm, GQA 32/4 heads of 128 channels, no shared expert) on 2 nodes x 8 GPUs, 80 GB each.
# The model flags are Megatron-LM's Qwen3-30B-A3B configuration
# (examples/post_training/modelopt/conf/Qwen/Qwen3-30B-A3B.sh at core_v0.16.1).
# gpu-memory-gb: 80
# Mapping: TP=1, PP=2, EP=8 (DP=8, expert-DP=1): each GPU holds 24 of the 48 layers and 16 of the
# 128 experts of each; the all-to-all stays inside a node (EP=8 = GPUs per node), PP's
# point-to-point crosses nodes. Per GPU (python tools/report_theoretical_memory.py <these flags>
# --world-size 16 --vocab-size 151936): 5.2 GB bf16 weights + 10.3 GB fp32 grads + 22.9 GB Adam
# state and main params + 22.6 GB activations = ~61 GB on pipeline stage 0. Why not one node: 30.5B parameters x 18 bytes (bf16 weight, fp32 grad, fp32
# Adam m/v + main copy) = 549 GB before activations, ~69 GB of it per GPU at EP=8.
#   NNODES=2 NODE_RANK=0..1 MASTER_ADDR=host0 \
#   bash examples/train_qwen3_30b_a3b_distributed.sh CHECKPOINT_PATH TOKENIZER_MODEL DATA_PATH [flags]
# TOKENIZER_MODEL: a local copy of the Qwen/Qwen3-30B-A3B tokenizer (HuggingFaceTokenizer).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CHECKPOINT_PATH=$1; TOKENIZER_MODEL=$2; DATA_PATH=$3; shift 3
GPUS_PER_NODE=${GPUS_PER_NODE:-8}; NNODES=${NNODES:-2}; NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-localhost}; MASTER_PORT=${MASTER_PORT:-6000}
TP=${TP:-1}; PP=${PP:-2}; EP=${EP:-8}
export CUDA_DEVICE_MAX_CONNECTIONS=1

DISTRIBUTED_ARGS=(--nproc_per_node "$GPUS_PER_NODE" --nnodes "$NNODES" --node_rank "$NODE_RANK"
                  --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT")
MODEL_ARGS=(--use-mcore-models --num-layers 48 --hidden-size 2048 --ffn-hidden-size 6144
            --num-attention-heads 32 --group-query-attention --num-query-groups 4 --kv-channels 128
            --qk-layernorm --seq-length 4096 --max-position-embeddings 40960
            --position-embedding-type rope --rotary-percent 1.0 --rotary-base 1000000
            --normalization RMSNorm --norm-epsilon 1e-6 --swiglu
            --untie-embeddings-and-output-weights --disable-bias-linear --hidden-dropout 0.0
            --attention-dropout 0.0 --no-masked-softmax-fusion --no-rope-fusion
            --no-bias-swiglu-fusion --make-vocab-size-divisible-by 1187)
MOE_ARGS=(--num-experts 128 --moe-ffn-hidden-size 768 --moe-router-topk 8 --moe-router-dtype fp32
          --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-3
          --moe-token-dispatcher-type alltoall --moe-grouped-gemm --moe-permute-fusion)
DATA_ARGS=(--data-path "$DATA_PATH" --split 99990,8,2 --tokenizer-type HuggingFaceTokenizer
           --tokenizer-model "$TOKENIZER_MODEL")
TRAINING_ARGS=(--micro-batch-size 1 --global-batch-size 256 --lr 3e-4 --train-iters 500000
               --lr-decay-iters 320000 --lr-decay-style cosine --min-lr 3e-5 --weight-decay 0.1
               --lr-warmup-iters 2000 --clip-grad 1.0 --bf16)
MODEL_PARALLEL_ARGS=(--tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP"
                     --expert-model-parallel-size "$EP" --use-distributed-optimizer)
if [ "$TP" -gt 1 ]; then MODEL_PARALLEL_ARGS+=(--sequence-parallel); fi
LOGGING_ARGS=(--log-interval 1 --save-interval 1000 --eval-interval 1000 --eval-iters 10
              --save "$CHECKPOINT_PATH" --load "$CHECKPOINT_PATH" --ckpt-format torch_dist
              --tensorboard-dir "$CHECKPOINT_PATH/tensorboard")

exec torchrun "${DISTRIBUTED_ARGS[@]}" "$ROOT/pretrain_gpt_moe.py" "${MODEL_ARGS[@]}" \
    "${MOE_ARGS[@]}" "${DATA_ARGS[@]}" "${TRAINING_ARGS[@]}" "${MODEL_PARALLEL_ARGS[@]}" \
    "${LOGGING_ARGS[@]}" "$@"
