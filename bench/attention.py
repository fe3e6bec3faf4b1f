"""Core attention forward+backward: ours (SDPADotProductAttention, torch SDPA: --attention-backend
flash with --transformer-impl local) vs megatron-core's local DotProductAttention
(--attention-backend local) on the same inputs, in the same run.

    python bench/attention.py                        # CPU: small shapes, fp32
    python bench/attention.py --seq 4096 --batch 2   # on a GPU: bf16 by default

Per case (causal; causal GQA; gpt-oss's sinks + sliding window with GQA) it checks the outputs
and gradients agree first, then prints the best and median time of forward+backward for both,
the local/ours speed ratio and, on CUDA, each one's peak allocated memory. The timings are
interleaved rep by rep so load from other processes hits both alike.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CASES = {
    # name: (query groups as a fraction of heads, TransformerConfig extras)
    "causal": (1, {}),
    "causal-gqa": (4, {}),
    "sinks-window-gqa": (4, dict(softmax_type="learnable", window_size=(127, 0))),
}


def _init(dev):
    import torch.distributed as dist

    from megatron_moe.compat import apply_cpu_shims
    from megatron_moe.runtime.local_ranks import free_port

    apply_cpu_shims()
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    dist.init_process_group("nccl" if dev.type == "cuda" else "gloo", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=120))
    parallel_state.initialize_model_parallel()
    model_parallel_cuda_manual_seed(1234)


def _pair(name, heads, dtype, dev):
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_moe.models.attention import SDPADotProductAttention

    div, extra = CASES[name]
    config = TransformerConfig(num_layers=1, hidden_size=heads * 64, num_attention_heads=heads,
                               num_query_groups=heads // div, attention_dropout=0.0,
                               params_dtype=dtype, bf16=dtype == torch.bfloat16,
                               masked_softmax_fusion=False, use_cpu_initialization=True, **extra)
    kw = dict(config=config, layer_number=1, attn_mask_type=AttnMaskType.causal,
              attention_type="self")
    local, ours = DotProductAttention(**kw).to(dev), SDPADotProductAttention(**kw).to(dev)
    if isinstance(local.softmax_offset, torch.nn.Parameter):
        with torch.no_grad():
            local.softmax_offset.normal_()
            ours.softmax_offset.copy_(local.softmax_offset)
    return local, ours


def _step(attn, q, k, v, grad):
    out = attn(q, k, v, None)
    out.backward(grad)
    return out


def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    cuda = torch.cuda.is_available()
    p.add_argument("--seq", type=int, default=4096 if cuda else 512)
    p.add_argument("--batch", type=int, default=2 if cuda else 1)
    p.add_argument("--heads", type=int, default=32 if cuda else 8)
    p.add_argument("--dtype", default="bfloat16" if cuda else "float32",
                   choices=["float32", "bfloat16"])
    p.add_argument("--reps", type=int, default=10 if cuda else 3)
    p.add_argument("--cases", default=",".join(CASES))
    args = p.parse_args(argv)
    dev = torch.device("cuda" if cuda else "cpu")
    dtype = getattr(torch, args.dtype)
    _init(dev)
    print(f"device {torch.cuda.get_device_name() if cuda else 'cpu'}, torch {torch.__version__}, "
          f"{args.dtype}, batch {args.batch}, seq {args.seq}, heads {args.heads}, head dim 64")
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    for name in args.cases.split(","):
        local, ours = _pair(name, args.heads, dtype, dev)
        groups = local.num_query_groups_per_partition
        g = torch.Generator(device=dev).manual_seed(0)

        def rand(h):
            return torch.randn(args.seq, args.batch, h, 64, generator=g, device=dev,
                               dtype=dtype).requires_grad_()

        q, k, v = rand(args.heads), rand(groups), rand(groups)
        grad = torch.randn(args.seq, args.batch, args.heads * 64, generator=g, device=dev,
                           dtype=dtype)
        outs, grads = [], []
        for attn in (local, ours):
            outs.append(_step(attn, q, k, v, grad))
            grads.append([t.grad.clone() for t in (q, k, v)])
            for t in (q, k, v):
                t.grad = None
        diff = max([float((outs[0] - outs[1]).detach().abs().max())]
                   + [float((a - b).abs().max()) for a, b in zip(*grads)])
        assert diff < tol * max(1.0, float(outs[0].abs().max())), f"{name}: differ by {diff}"
        times = {"local": [], "ours": []}
        peak = {}
        for _ in range(args.reps):
            for label, attn in (("local", local), ("ours", ours)):
                if cuda:
                    torch.cuda.reset_peak_memory_stats()
                _sync(dev)
                t0 = time.perf_counter()
                _step(attn, q, k, v, grad)
                _sync(dev)
                times[label].append(time.perf_counter() - t0)
                if cuda:
                    peak[label] = torch.cuda.max_memory_allocated() / 2 ** 20
                for t in (q, k, v):
                    t.grad = None
        best = {k: min(t) for k, t in times.items()}
        line = (f"{name:18s} max diff {diff:.2e} | fwd+bwd ms best (median): local "
                f"{best['local'] * 1e3:.2f} ({statistics.median(times['local']) * 1e3:.2f}), ours "
                f"{best['ours'] * 1e3:.2f} ({statistics.median(times['ours']) * 1e3:.2f}) | "
                f"local/ours x{best['local'] / best['ours']:.2f}")
        if cuda:
            line += f" | peak MiB local {peak['local']:.0f} ours {peak['ours']:.0f}"
        print(line, flush=True)


if __name__ == "__main__":
    main()
