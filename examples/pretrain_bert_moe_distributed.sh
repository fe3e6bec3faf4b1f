#!/usr/bin/env bash
# BERT-large-shaped MoE on GPUs (NCCL), one or more nodes under torchrun.
# gpu-memory-gb: 80   (checked by tests/test_theoretical_memory.py with tools/report_theoretical_memory.py)
# Default mapping per node of 8 GPUs: TP=1, PP=1, EP=8 (DP = world): experts and the word-embedding
# columns (--embedding-partition hidden) are split over the same 8 ranks, so the embedding
# gradient needs no all-reduce at all. With EP < DP the embedding shards are all-reduced over the
# expert-data-parallel group, like experts. Hidden partitioning needs TP=CP=ETP=1; for TP>1 pass
# EMBEDDING_PARTITION=vocab (megatron-core's vocab-parallel embedding).
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=host0 \
#   bash examples/pretrain_bert_moe_distributed.sh CHECKPOINT_PATH VOCAB_FILE DATA_PATH [flags]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CHECKPOINT_PATH=$1; VOCAB_FILE=$2; DATA_PATH=$3; shift 3
GPUS_PER_NODE=${GPUS_PER_NODE:-8}; NNODES=${NNODES:-1}; NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-localhost}; MASTER_PORT=${MASTER_PORT:-6000}
TP=${TP:-1}; PP=${PP:-1}; EP=${EP:-8}; EMBEDDING_PARTITION=${EMBEDDING_PARTITION:-hidden}
export CUDA_DEVICE_MAX_CONNECTIONS=1

DISTRIBUTED_ARGS=(--nproc_per_node "$GPUS_PER_NODE" --nnodes "$NNODES" --node_rank "$NODE_RANK"
                  --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT")
MODEL_ARGS=(--num-layers 24 --hidden-size 1024 --ffn-hidden-size 4096 --num-attention-heads 16
            --seq-length 512 --max-position-embeddings 512 --untie-embeddings-and-output-weights
            --embedding-partition "$EMBEDDING_PARTITION" --attention-dropout 0.1 --hidden-dropout 0.1)
MOE_ARGS=(--num-experts 8 --moe-router-topk 2 --moe-router-load-balancing-type aux_loss
          --moe-aux-loss-coeff 1e-2 --moe-token-dispatcher-type alltoall --moe-grouped-gemm
          --moe-permute-fusion)
DATA_ARGS=(--data-path "$DATA_PATH" --split 949,50,1 --tokenizer-type BertWordPieceLowerCase
           --vocab-file "$VOCAB_FILE" --mask-prob 0.15 --short-seq-prob 0.1)
TRAINING_ARGS=(--micro-batch-size 8 --global-batch-size 1024 --lr 1e-4 --train-iters 1000000
               --lr-decay-iters 990000 --lr-decay-style linear --min-lr 1e-5 --weight-decay 0.01
               --lr-warmup-fraction 0.01 --clip-grad 1.0 --bf16)
MODEL_PARALLEL_ARGS=(--tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP"
                     --expert-model-parallel-size "$EP" --use-distributed-optimizer)
if [ "$TP" -gt 1 ]; then MODEL_PARALLEL_ARGS+=(--sequence-parallel); fi
LOGGING_ARGS=(--log-interval 100 --save-interval 10000 --eval-interval 1000 --eval-iters 10
              --save "$CHECKPOINT_PATH" --load "$CHECKPOINT_PATH" --ckpt-format torch_dist
              --tensorboard-dir "$CHECKPOINT_PATH/tensorboard")

exec torchrun "${DISTRIBUTED_ARGS[@]}" "$ROOT/pretrain_bert_moe.py" "${MODEL_ARGS[@]}" \
    "${MOE_ARGS[@]}" "${DATA_ARGS[@]}" "${TRAINING_ARGS[@]}" "${MODEL_PARALLEL_ARGS[@]}" \
    "${LOGGING_ARGS[@]}" "$@"
