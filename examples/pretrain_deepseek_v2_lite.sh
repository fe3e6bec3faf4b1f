#!/usr/bin/env bash
# DeepSeek-V2-Lite (15.7B total, 2.4B active parameters) on 1 node x 8 GPUs (NCCL), 80 GB each.
# gpu-memory-gb: 80
# vocab-size: 102400
# The model flags are Megatron-LM's DeepSeek-V2-Lite configuration
# (examples/post_training/modelopt/conf/deepseek-ai/DeepSeek-V2-Lite.sh, core_v0.16.1): MLA with
# kv-lora-rank 512 and decoupled RoPE (YaRN, factor 40, mscale 0.707), 1 dense + 26 MoE layers of
# 64 routed experts (top-6) + 2 shared, sequence aux loss. examples/pretrain_deepseek_v2_lite_cpu.sh
# is the same configuration with only the sizes overridden (the tests train it on 2 CPU ranks).
# Mapping: TP=1, PP=1, EP=8 (DP=8, expert-DP=1), distributed optimizer: each GPU holds all
# non-expert weights and 8 of the 64 experts of each MoE layer.
# Per GPU (python tools/report_theoretical_memory.py <these flags> --world-size 8 --vocab-size
# 102400; it counts 1.312B non-expert + 8 x 1.799B expert = 15.7B parameters): 6.2 GB bf16 weights
# + 12.4 GB fp32 grads + 23.6 GB Adam/main params (sharded) + 4.1 GB activations = ~46 GB.
#   bash examples/pretrain_deepseek_v2_lite.sh CHECKPOINT_PATH TOKENIZER_MODEL DATA_PATH [flags]
# TOKENIZER_MODEL: a Hugging Face tokenizer directory or name (deepseek-ai/DeepSeek-V2-Lite).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CHECKPOINT_PATH=$1; TOKENIZER_MODEL=$2; DATA_PATH=$3; shift 3
GPUS_PER_NODE=${GPUS_PER_NODE:-8}; NNODES=${NNODES:-1}; NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-localhost}; MASTER_PORT=${MASTER_PORT:-6000}
TP=${TP:-1}; PP=${PP:-1}; EP=${EP:-8}
export CUDA_DEVICE_MAX_CONNECTIONS=1

DISTRIBUTED_ARGS=(--nproc_per_node "$GPUS_PER_NODE" --nnodes "$NNODES" --node_rank "$NODE_RANK"
                  --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT")
MODEL_ARGS=(--attention-dropout 0.0 --hidden-dropout 0.0 --no-masked-softmax-fusion
            --disable-bias-linear --untie-embeddings-and-output-weights
            --position-embedding-type rope --no-rope-fusion --normalization RMSNorm
            --norm-epsilon 1e-6 --swiglu --num-layers 27 --hidden-size 2048
            --ffn-hidden-size 10944 --num-attention-heads 16 --kv-channels 16
            --multi-latent-attention --kv-lora-rank 512 --v-head-dim 128 --qk-head-dim 128
            --qk-layernorm --qk-pos-emb-head-dim 64 --seq-length 1024
            --max-position-embeddings 1024 --make-vocab-size-divisible-by 3200
            --attention-softmax-in-fp32 --use-mcore-models --rotary-percent 1.0
            --rotary-base 10000 --rotary-scaling-factor 40 --mscale 0.707 --mscale-all-dim 0.707)
MOE_ARGS=(--num-experts 64 --moe-layer-freq "([0]+[1]*26)" --moe-ffn-hidden-size 1408
          --moe-grouped-gemm --moe-router-score-function softmax --moe-router-topk 6
          --moe-router-topk-scaling-factor 1.0 --moe-router-pre-softmax
          --moe-shared-expert-intermediate-size 2816 --moe-aux-loss-coeff 1e-3
          --moe-token-dispatcher-type alltoall --moe-token-drop-policy probs
          --moe-router-load-balancing-type seq_aux_loss)
DATA_ARGS=(--data-path "$DATA_PATH" --split 99990,8,2 --tokenizer-type HuggingFaceTokenizer
           --tokenizer-model "$TOKENIZER_MODEL")
TRAINING_ARGS=(--micro-batch-size 1 --global-batch-size 512 --lr 4.2e-4 --min-lr 4.2e-5
               --lr-decay-style cosine --lr-warmup-iters 2000 --train-iters 500000
               --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --clip-grad 1.0
               --init-method-std 0.006 --bf16)
MODEL_PARALLEL_ARGS=(--tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP"
                     --expert-model-parallel-size "$EP" --sequence-parallel
                     --use-distributed-optimizer)
LOGGING_ARGS=(--log-interval 1 --save-interval 1000 --eval-interval 1000 --eval-iters 10
              --save "$CHECKPOINT_PATH" --load "$CHECKPOINT_PATH" --ckpt-format torch_dist
              --tensorboard-dir "$CHECKPOINT_PATH/tensorboard")

exec torchrun "${DISTRIBUTED_ARGS[@]}" "$ROOT/pretrain_gpt_moe.py" "${MODEL_ARGS[@]}" \
    "${MOE_ARGS[@]}" "${DATA_ARGS[@]}" "${TRAINING_ARGS[@]}" "${MODEL_PARALLEL_ARGS[@]}" \
    "${LOGGING_ARGS[@]}" "$@"
