# GPU image for clusters: NVIDIA's PyTorch container 25.09 (Python 3.12, CUDA, NCCL, Transformer
# Engine, apex) + megatron-moe. On Python 3.12 pip resolves the newest megatron-core in pyproject's
# range (0.19.x): the "Python 3.12 / newest megatron-core" leg of the tested matrix (README).
FROM nvcr.io/nvidia/pytorch:25.09-py3
WORKDIR /workspace/megatron-moe
COPY . .
# NVIDIA apex and Transformer Engine come with this base image (apex is not on PyPI: the "apex"
# there is an unrelated web toolkit; outside NGC build apex from github.com/NVIDIA/apex, and take
# Transformer Engine from `pip install transformer-engine[pytorch]`, which builds against the
# installed torch and CUDA). The README's install command; the base image's torch, TE and apex
# satisfy the pins and are kept.
# No "|| true": a failed install fails the build.
RUN pip install --no-cache-dir -e .
# Refuse to produce an image whose Python / megatron-core pair is outside the tested matrix.
RUN python -c "import sys, megatron.core as m; from packaging.version import Version as V; \
v = V(m.__version__); ok = sys.version_info[:2] == (3, 12) and V('0.19') <= v < V('0.20'); \
print('Python', sys.version.split()[0], 'megatron-core', v); sys.exit(0 if ok else 'untested pair')" \
 && python -c "import megatron_moe.training.loop, pretrain_gpt_moe"
ENV CUDA_DEVICE_MAX_CONNECTIONS=1
CMD ["bash"]
