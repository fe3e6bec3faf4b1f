#!/usr/bin/env bash
# Kimi-K2 (1.04T parameters, 32B active) on 64 nodes x 8 GPUs (512 GPUs, NCCL), 80 GB each.
# gpu-memory-gb: 80
# MLA with 64 heads, 384 routed experts (top-8) + 1 shared, 1 dense layer. Kimi-K2 was trained with
# MuonClip (Muon + QK-clip); Megatron-LM's Kimi-K2 conf sets no optimizer, so this runs Adam (the
# memory estimate below is Adam's). Muon: append --optimizer muon --muon-momentum 0.95 (megatron-core
# >= 0.19 with emerging-optimizers; with --use-distributed-optimizer and --bf16 megatron-core's
# layer-wise distributed Muon); --qk-clip is refused here, so it is Muon without the QK-clip.
# Mapping: TP=1, PP=16 (layout Et*3|(tttt|)*14ttL: the 61 layers unevenly, embedding and
# loss stages lighter), EP=32, DP=32 with the distributed optimizer, full recompute (uniform, 1).
# Per GPU (python tools/report_theoretical_memory.py <these flags> --world-size 512): ~46.9 GB (stage 1: 0.6B non-expert + 2.1B expert parameters)
# (the most loaded stage; a 80 GB card's budget is 90% minus 3 GB).
#   NNODES=64 NODE_RANK=0..63 MASTER_ADDR=host0 \
#   bash examples/train_kimi_k2_64node_512gpu.sh CHECKPOINT_PATH TOKENIZER_DIR DATA_PATH [flags]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CHECKPOINT_PATH=$1; TOKENIZER_MODEL=$2; DATA_PATH=$3; shift 3
GPUS_PER_NODE=${GPUS_PER_NODE:-8}; NNODES=${NNODES:-64}; NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-localhost}; MASTER_PORT=${MASTER_PORT:-6000}
export CUDA_DEVICE_MAX_CONNECTIONS=1

DISTRIBUTED_ARGS=(--nproc_per_node "$GPUS_PER_NODE" --nnodes "$NNODES" --node_rank "$NODE_RANK"
                  --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT")
# Megatron-LM's model conf (examples/post_training/modelopt/conf, core_v0.19.0)
MODEL_ARGS=(--num-attention-heads 64 --num-layers 61 --hidden-size 7168 --ffn-hidden-size 18432 --kv-channels 128
            --multi-latent-attention --kv-lora-rank 512 --v-head-dim 128 --q-lora-rank 1536
            --qk-head-dim 128 --qk-layernorm --qk-pos-emb-head-dim 64 --seq-length 4096
            --position-embedding-type rope --rotary-percent 1.0 --mscale 1.0 --mscale-all-dim 1.0
            --normalization RMSNorm --swiglu --untie-embeddings-and-output-weights
            --disable-bias-linear
            --max-position-embeddings 131072 --rotary-base 50000 --rotary-scaling-factor 32
            --make-vocab-size-divisible-by 1 --padded-vocab-size 163840)
MOE_ARGS=(--num-experts 384 --moe-layer-freq [0]*1+[1]*60 --moe-ffn-hidden-size 2048
          --moe-shared-expert-intermediate-size 2048 --moe-router-topk 8 --moe-router-pre-softmax
          --moe-router-score-function sigmoid --moe-router-topk-scaling-factor 2.827
          --moe-router-enable-expert-bias --moe-router-bias-update-rate 1e-3
          --moe-router-dtype fp32 --moe-aux-loss-coeff 1e-4
          --moe-router-load-balancing-type seq_aux_loss --moe-token-dispatcher-type alltoall
          --moe-grouped-gemm --moe-permute-fusion)
DATA_ARGS=(--data-path "$DATA_PATH" --split 99990,8,2 --tokenizer-type HuggingFaceTokenizer
           --tokenizer-model "$TOKENIZER_MODEL" --trust-remote-code)
TRAINING_ARGS=(--micro-batch-size 1 --global-batch-size 4096 --lr 1e-4 --train-iters 500000
               --lr-decay-style cosine --min-lr 1e-5 --weight-decay 0.1 --lr-warmup-iters 2000
               --clip-grad 1.0 --bf16 --recompute-granularity full --recompute-method uniform
               --recompute-num-layers 1)
MODEL_PARALLEL_ARGS=(--tensor-model-parallel-size 1 --pipeline-model-parallel-size 16
                     --pipeline-model-parallel-layout "Et*3|(tttt|)*14ttL"
                     --expert-model-parallel-size 32 --use-distributed-optimizer)
LOGGING_ARGS=(--log-interval 1 --save-interval 1000 --eval-interval 1000 --eval-iters 10
              --save "$CHECKPOINT_PATH" --load "$CHECKPOINT_PATH" --ckpt-format torch_dist
              --tensorboard-dir "$CHECKPOINT_PATH/tensorboard" --log-params-norm
              --log-num-zeros-in-grad --log-memory-to-tensorboard --async-save
              --use-persistent-ckpt-worker --dist-ckpt-strictness log_all)

exec torchrun "${DISTRIBUTED_ARGS[@]}" "$ROOT/pretrain_gpt_moe.py" "${MODEL_ARGS[@]}" \
    "${MOE_ARGS[@]}" "${DATA_ARGS[@]}" "${TRAINING_ARGS[@]}" "${MODEL_PARALLEL_ARGS[@]}" \
    "${LOGGING_ARGS[@]}" "$@"
