#!/usr/bin/env bash
# gpt-oss-20b (20.9B parameters, 3.6B active: 24 layers, 32 experts of 2880, top-4, GQA 64/8 heads
# of 64 channels, attention sinks, sliding window of 128 tokens on every other layer, clamped
# quick-GEGLU experts with biases, YaRN RoPE) on 2 nodes x 8 GPUs, 80 GB each.
# The model flags are Megatron-LM's gpt-oss-20b configuration
# (examples/post_training/modelopt/conf/openai/gpt-oss-20b.sh and the YaRN flags of
# tests/functional_tests/test_cases/moe/gpt_dynamic_inference_tp2_pp2_ep2_gptoss_20b_swa at main)
# with linear biases on, as the released checkpoint has them (q/k/v/o, router, experts); that
# script's --enable-gpt-oss and --export-force-local-attention are ModelOpt's, not Megatron-LM
# training flags, and are not passed. Untested on GPU here (docs/gpt-oss.md).
# gpu-memory-gb: 80
# vocab-size: 201088
# Mapping: TP=1, PP=1, EP=8 (DP=16, expert-DP=2): each GPU holds all 24 layers' attention and 4
# of the 32 experts of each; the all-to-all stays inside a node. Per GPU: see
#   python tools/report_theoretical_memory.py <these flags> --world-size 16 --vocab-size 201088
#   NNODES=2 NODE_RANK=0..1 MASTER_ADDR=host0 \
#   bash examples/train_gpt_oss_20b_distributed.sh CHECKPOINT_PATH TOKENIZER_MODEL DATA_PATH [flags]
# TOKENIZER_MODEL: a local copy of the openai/gpt-oss-20b tokenizer (HuggingFaceTokenizer).
# From the released weights: tools/checkpoint/convert.py --model-type GPT --loader hf --saver
# megatron --load-dir gpt-oss-20b-bf16 --save-dir CHECKPOINT_PATH --target-expert-parallel-size 8
# (a bf16 copy: the MXFP4 experts of the release are not read).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CHECKPOINT_PATH=$1; TOKENIZER_MODEL=$2; DATA_PATH=$3; shift 3
GPUS_PER_NODE=${GPUS_PER_NODE:-8}; NNODES=${NNODES:-2}; NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-localhost}; MASTER_PORT=${MASTER_PORT:-6000}
TP=${TP:-1}; PP=${PP:-1}; EP=${EP:-8}
export CUDA_DEVICE_MAX_CONNECTIONS=1

DISTRIBUTED_ARGS=(--nproc_per_node "$GPUS_PER_NODE" --nnodes "$NNODES" --node_rank "$NODE_RANK"
                  --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT")
MODEL_ARGS=(--use-mcore-models --num-layers 24 --hidden-size 2880 --ffn-hidden-size 2880
            --num-attention-heads 64 --group-query-attention --num-query-groups 8 --kv-channels 64
            --seq-length 4096 --max-position-embeddings 131072
            --position-embedding-type yarn --rotary-percent 1.0 --rotary-base 150000
            --rotary-scaling-factor 32 --yarn-original-max-position-embeddings 4096
            --yarn-beta-fast 32 --yarn-beta-slow 1 --mscale 1.0 --mscale-all-dim 0.0
            --no-yarn-correction-range-round-to-int
            --softmax-type learnable --window-size 127,0 --window-attn-skip-freq 2
            --quick-geglu --glu-linear-offset 1.0 --activation-func-clamp-value 7.0
            --normalization RMSNorm --norm-epsilon 1e-5 --add-bias-linear
            --untie-embeddings-and-output-weights --hidden-dropout 0.0 --attention-dropout 0.0
            --no-masked-softmax-fusion --no-rope-fusion --no-bias-gelu-fusion
            --no-bias-dropout-fusion --make-vocab-size-divisible-by 128)
MOE_ARGS=(--num-experts 32 --moe-ffn-hidden-size 2880 --moe-router-topk 4 --moe-router-dtype fp32
          --moe-router-score-function softmax --moe-router-load-balancing-type aux_loss
          --moe-aux-loss-coeff 1e-3 --moe-token-dispatcher-type alltoall --moe-grouped-gemm)
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
