#!/usr/bin/env bash
# Small BERT-MoE on 2 CPU processes (gloo), expert parallelism 2, masked LM + sentence-order head,
# MoESys hidden-partitioned word embedding (EP group = DP group: no embedding all-reduce).
#   bash examples/pretrain_bert_moe_cpu.sh CHECKPOINT_PATH VOCAB_FILE DATA_PATH [extra flags...]
# DATA_PATH is a sentence-level prefix (.bin/.idx), e.g. from
#   python tools/preprocess_data.py --input corpus.jsonl --output-prefix my-bert \
#       --tokenizer-type BertWordPieceLowerCase --vocab-file vocab.txt --split-sentences
# (-> my-bert_text_sentence). Pass --embedding-partition vocab for megatron-core's embedding.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CHECKPOINT_PATH=$1; VOCAB_FILE=$2; DATA_PATH=$3; shift 3
PY="${PYTHON:-$ROOT/.venv/bin/python}"

DISTRIBUTED_ARGS=(--nproc_per_node 2 --nnodes 1 --master_addr 127.0.0.1 --master_port "${MASTER_PORT:-29521}")
MODEL_ARGS=(--num-layers 4 --hidden-size 128 --ffn-hidden-size 512 --num-attention-heads 4
            --seq-length 128 --max-position-embeddings 512
            --untie-embeddings-and-output-weights --embedding-partition hidden)
MOE_ARGS=(--num-experts 8 --moe-ffn-hidden-size 256 --moe-router-topk 2
          --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-2
          --moe-token-dispatcher-type alltoall)
DATA_ARGS=(--data-path "$DATA_PATH" --split 98,2,0 --tokenizer-type BertWordPieceLowerCase
           --vocab-file "$VOCAB_FILE" --mask-prob 0.15 --short-seq-prob 0.1)
TRAINING_ARGS=(--micro-batch-size 4 --global-batch-size 16 --train-iters 100 --lr 1e-3
               --min-lr 1e-4 --lr-decay-style linear --lr-warmup-iters 10 --weight-decay 0.01
               --clip-grad 1.0 --seed 1234)
MODEL_PARALLEL_ARGS=(--expert-model-parallel-size 2 --distributed-backend gloo)
LOGGING_ARGS=(--log-interval 10 --eval-interval 50 --eval-iters 2 --save "$CHECKPOINT_PATH"
              --load "$CHECKPOINT_PATH" --save-interval 50 --ckpt-format torch_dist
              --tensorboard-dir "$CHECKPOINT_PATH/tensorboard")

exec "$PY" -m torch.distributed.run "${DISTRIBUTED_ARGS[@]}" "$ROOT/pretrain_bert_moe.py" \
    "${MODEL_ARGS[@]}" "${MOE_ARGS[@]}" "${DATA_ARGS[@]}" "${TRAINING_ARGS[@]}" \
    "${MODEL_PARALLEL_ARGS[@]}" "${LOGGING_ARGS[@]}" "$@"
