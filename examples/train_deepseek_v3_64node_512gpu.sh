#!/usr/bin/env bash
# DeepSeek-V3 / DeepSeek-R1 (671B parameters, 37B active; R1 is V3's architecture) on 64 nodes x 8 GPUs (512 GPUs, NCCL), 80 GB each.
# gpu-memory-gb: 80
# vocab-size: 129280
# MLA, 256 routed experts (top-8 of 8 groups, 4 groups per token) + 1 shared, 3 dense layers, one MTP layer.
# Mapping: TP=1, PP=16 (layout Et*3|(tttt|)*14ttmL: the 61 layers unevenly, embedding and
# loss stages lighter), EP=32, DP=32 with the distributed optimizer, full recompute (uniform, 1).
# Per GPU (python tools/report_theoretical_memory.py <these flags> --world-size 512): ~44.6 GB (stage 15: 2.7B non-expert + 1.1B expert parameters)
# (the most loaded stage; a 80 GB card's budget is 90% minus 3 GB).
#   NNODES=64 NODE_RANK=0..63 MASTER_ADDR=host0 \
#   bash examples/train_deepseek_v3_64node_512gpu.sh CHECKPOINT_PATH TOKENIZER_DIR DATA_PATH [flags]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CHECKPOINT_PATH=$1; TOKENIZER_MODEL=$2; DATA_PATH=$3; shift 3
GPUS_PER_NODE=${GPUS_PER_NODE:-8}; NNODES=${NNODES:-64}; NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-localhost}; MASTER_PORT=${MASTER_PORT:-6000}
export CUDA_DEVICE_MAX_CONNECTIONS=1

DISTRIBUTED_ARGS=(--nproc_per_node "$GPUS_PER_NODE" --nnodes "$NNODES" --node_rank "$NODE_RANK"
                  --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT")
# Megatron-LM's model conf (examples/post_training/modelopt/conf, core_v0.19.0)
MODEL_ARGS=(--num-attention-heads 128 --num-layers 61 --hidden-size 7168 --ffn-hidden-size 18432 --kv-channels 128
            --multi-latent-attention --kv-lora-rank 512 --v-head-dim 128 --q-lora-rank 1536
            --qk-head-dim 128 --qk-layernorm --qk-pos-emb-head-dim 64 --seq-length 4096
            --position-embedding-type rope --rotary-percent 1.0 --mscale 1.0 --mscale-all-dim 1.0
            --normalization RMSNorm --swiglu --untie-embeddings-and-output-weights
            --disable-bias-linear
            --max-position-embeddings 163840 --rotary-base 10000 --rotary-scaling-factor 40
            --make-vocab-size-divisible-by 1280 --mtp-num-layers 1 --mtp-loss-scaling-factor 0.1)
MOE_ARGS=(--num-experts 256 --moe-layer-freq [0]*3+[1]*58 --moe-ffn-hidden-size 2048
          --moe-shared-expert-intermediate-size 2048 --moe-router-topk 8 --moe-router-num-groups 8
          --moe-router-group-topk 4 --moe-router-pre-softmax --moe-router-score-function sigmoid
          --moe-router-topk-scaling-factor 2.5 --moe-router-enable-expert-bias
          --moe-router-bias-update-rate 1e-3 --moe-router-dtype fp32 --moe-aux-loss-coeff 1e-4
          --moe-router-load-balancing-type seq_aux_loss --moe-token-dispatcher-type alltoall
          --moe-grouped-gemm --moe-permute-fusion)
DATA_ARGS=(--data-path "$DATA_PATH" --split 99990,8,2 --tokenizer-type HuggingFaceTokenizer
           --tokenizer-model "$TOKENIZER_MODEL")
TRAINING_ARGS=(--micro-batch-size 1 --global-batch-size 4096 --lr 1e-4 --train-iters 500000
               --lr-decay-style cosine --min-lr 1e-5 --weight-decay 0.1 --lr-warmup-iters 2000
               --clip-grad 1.0 --bf16 --recompute-granularity full --recompute-method uniform
               --recompute-num-layers 1)
MODEL_PARALLEL_ARGS=(--tensor-model-parallel-size 1 --pipeline-model-parallel-size 16
                     --pipeline-model-parallel-layout "Et*3|(tttt|)*14ttmL"
                     --expert-model-parallel-size 32 --use-distributed-optimizer)
LOGGING_ARGS=(--log-interval 1 --save-interval 1000 --eval-interval 1000 --eval-iters 10
              --save "$CHECKPOINT_PATH" --load "$CHECKPOINT_PATH" --ckpt-format torch_dist
              --tensorboard-dir "$CHECKPOINT_PATH/tensorboard" --log-params-norm
              --log-num-zeros-in-grad --log-memory-to-tensorboard --async-save
              --use-persistent-ckpt-worker --dist-ckpt-strictness log_all)

exec torchrun "${DISTRIBUTED_ARGS[@]}" "$ROOT/pretrain_gpt_moe.py" "${MODEL_ARGS[@]}" \
    "${MOE_ARGS[@]}" "${DATA_ARGS[@]}" "${TRAINING_ARGS[@]}" "${MODEL_PARALLEL_ARGS[@]}" \
    "${LOGGING_ARGS[@]}" "$@"
