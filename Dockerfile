# GPU image for clusters: NVIDIA's PyTorch base (CUDA, NCCL, Transformer Engine, apex) + megatron-moe.
FROM nvcr.io/nvidia/pytorch:25.09-py3
WORKDIR /workspace/megatron-moe
COPY . .
# The base image's torch, TE and apex are kept; only missing Python packages are added.
RUN pip install --no-cache-dir -e ".[viz]" && pip install --no-cache-dir grouped_gemm || true
ENV CUDA_DEVICE_MAX_CONNECTIONS=1
CMD ["bash"]
