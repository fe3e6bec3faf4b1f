"""The GPU check's sections, one process each (``python -m megatron_moe.gpucheck.checks SECTION``).

Each section runs the project's own pieces (kernels/, pretrain(), offload/, tools/generate.py,
ring memory, tools/report_theoretical_memory.py, megatron_moe/flops.py) at the sizes of its mode
(``GPU``: training shapes on one CUDA device over NCCL; ``CPU``: toy sizes over gloo) and
records each named check into a JSON file after every check, so a crash or a timeout keeps what
was measured. The runner (``megatron_moe.gpucheck.run``) prints and reports them.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import io
import json
import math
import os
import re
import statistics
import subprocess
import sys
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# The checks of each section, in order (the runner reports a missing one as FAIL).
SECTIONS = {
    "kernels": ["environment", "kernels"],  # one process: the environment is recorded first
    "training": ["training-bf16", "training-fusion", "training-experts"],
    # its own process and time cap: on the first GPU run the bf16 model's 55 iterations used the
    # whole training cap and these two never ran
    "resume": ["training-resume", "training-fp16"],
    "offload": ["offload"],
    "inference": ["inference-gpu-vs-cpu", "inference-ring-memory"],
    "syncs": ["training-syncs"],
    # megatron_moe/gpucheck/perf.py: four systems side by side, one process per row (its own
    # device call on the GPU: not in the GPU run's default sections)
    "perf": ["perf-mixtral", "perf-finegrained"],
}
# Set to "skip-bind" to plant the offload fault into the host K=2 run itself (the offload check
# must then FAIL: the mutation test of the kit, tests/test_gpu_check.py).
PLANT_ENV = "MEGATRON_MOE_GPU_CHECK_PLANT"

# bf16 dense (no sparsity) tensor-core peaks, TFLOP/s, by device name (NVIDIA data sheets)
BF16_PEAK_TFLOPS = (("H200", 989.4), ("H100 NVL", 835.0), ("H100 PCIe", 756.0), ("H100", 989.4),
                    ("H800", 989.4), ("A100", 312.0), ("A800", 312.0), ("L40S", 362.1),
                    ("B200", 2250.0))

# --- model sizes per mode ----------------------------------------------------------------------
COMMON = ("--disable-bias-linear --hidden-dropout 0 --attention-dropout 0 --mock-data "
          "--tokenizer-type NullTokenizer --moe-token-dispatcher-type alltoall "
          "--moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-2 --clip-grad 1.0 "
          "--weight-decay 0.1 --lr-decay-style cosine --log-interval 1 --eval-interval 1000000 "
          "--eval-iters 1 --seed 1234 "
          # as Megatron-LM's GPT examples: no [s, s] mask per sample, the attention's own causal
          # mask (torch SDPA's flash path; the kit's runs of 2026-11-28 had no mask either)
          "--no-create-attention-mask-in-dataloader").split()
# ~1B parameters (16 layers, hidden 1024, 32 experts of 512, top-8, sequence 2048)
BIG = {"gpu": ("--num-layers 16 --hidden-size 1024 --num-attention-heads 16 --ffn-hidden-size 4096 "
               "--seq-length 2048 --max-position-embeddings 2048 --num-experts 32 "
               "--moe-ffn-hidden-size 512 --moe-router-topk 8 --swiglu --normalization RMSNorm "
               "--untie-embeddings-and-output-weights --micro-batch-size 2 --global-batch-size 8 "
               "--vocab-size 32000 --lr 3e-4 --min-lr 3e-5 --lr-warmup-iters 5"),
       "cpu": ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --ffn-hidden-size 128 "
               "--seq-length 64 --max-position-embeddings 64 --num-experts 8 "
               "--moe-ffn-hidden-size 32 --moe-router-topk 2 --swiglu --normalization RMSNorm "
               "--untie-embeddings-and-output-weights --micro-batch-size 2 --global-batch-size 4 "
               "--vocab-size 512 --lr 3e-3 --min-lr 3e-4 --lr-warmup-iters 1")}
SMALL = {"gpu": ("--num-layers 6 --hidden-size 1024 --num-attention-heads 16 --seq-length 1024 "
                 "--max-position-embeddings 1024 --num-experts 16 --moe-ffn-hidden-size 1024 "
                 "--moe-router-topk 4 --micro-batch-size 2 --global-batch-size 4 "
                 "--vocab-size 32000 --lr 3e-4 --min-lr 3e-5 --lr-warmup-iters 2"),
         "cpu": ("--num-layers 4 --hidden-size 32 --num-attention-heads 4 --seq-length 32 "
                 "--max-position-embeddings 32 --num-experts 4 --moe-ffn-hidden-size 32 "
                 "--moe-router-topk 2 --micro-batch-size 2 --global-batch-size 4 "
                 "--vocab-size 256 --lr 3e-3 --min-lr 3e-4 --lr-warmup-iters 1")}
# offload and inference: 8 layers (ring memory K=2 of 8), small enough for the ssd tier's traffic
MID = {"gpu": ("--num-layers 8 --hidden-size 512 --num-attention-heads 8 --seq-length 512 "
               "--max-position-embeddings 512 --num-experts 16 --moe-ffn-hidden-size 1024 "
               "--moe-router-topk 2 --micro-batch-size 4 --global-batch-size 8 "
               "--vocab-size 32000 --lr 3e-4 --min-lr 3e-5 --lr-warmup-iters 2"),
       "cpu": SMALL["cpu"]}
# the first H100 run: the bf16 model ran 3.5-4.5 s per iteration (host-bound, docs/gpu.md), so 40
# + 15 iterations took 232 s of the training cap of 240
ITERS = {"gpu": dict(big=30, fusion=10, loop=8, resume=8, fp16=12, offload=6, infer=10, syncs=8),
         "cpu": dict(big=6, fusion=4, loop=4, resume=4, fp16=4, offload=3, infer=4, syncs=4)}
# the experts as two grouped GEMMs (megatron_moe/moe/grouped_experts.py): without Transformer
# Engine megatron-core's expert loop left the first H100 run host-bound at 0.9% MFU
GROUPED = "--moe-grouped-gemm"   # on the local path (no TE): torch grouped_mm experts
KERNEL_SHAPES = {"gpu": [(16384, 4096, 64, 8), (16384, 4096, 8, 2)],
                 "cpu": [(256, 64, 16, 4), (256, 64, 8, 2)]}
WARMUP_ITERS = {"gpu": 5, "cpu": 1}  # iterations left out of tokens/s


class Recorder:
    """Writes ``{"checks": [...], "info": {...}}`` to ``path`` after every record."""

    def __init__(self, path, mode):
        self.path, self.mode = path, mode
        self.data = {"checks": [], "info": {}}

    def info(self, **kw):
        self.data["info"].update(kw)
        self._write()

    def record(self, name, ok, summary, figures=None, skipped=(), status=None):
        status = status or ("PASS" if ok else "FAIL")
        self.data["checks"].append(dict(name=name, status=status, summary=summary,
                                        figures=figures or {}, skipped=list(skipped)))
        self._write()
        print(f"[{name}] {status} {summary}", flush=True)

    def _write(self):
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.data, f, indent=1, default=_jsonable)
        os.replace(tmp, self.path)


def _jsonable(x):
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    return str(x)


def _version_str(v):
    return ".".join(map(str, v)) if isinstance(v, (tuple, list)) else str(v)


def _gpu(mode):
    return mode == "gpu"


def _sync():
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


# --- process setup ---------------------------------------------------------------------------------
def init_process(mode, deterministic=False, strict_devices=True):
    """World size 1: NCCL on the GPU (gloo on the CPU), the CPU shims where no CUDA, strict device
    mode on unless ``strict_devices`` is False (megatron_moe/comm/strict.py: every collective
    checked as NCCL needs it; on a CPU build every torch call also passes its provenance mode, test
    machinery a timed run leaves out)."""
    if deterministic:  # megatron-core's deterministic settings (Megatron-LM --deterministic-mode)
        os.environ.setdefault("NCCL_ALGO", "Ring")
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    import torch
    import torch.distributed as dist

    from megatron_moe.runtime.local_ranks import free_port

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0",
                      WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    os.environ.setdefault("TQDM_DISABLE", "1")
    backend = "nccl" if _gpu(mode) else "gloo"
    if _gpu(mode):
        torch.cuda.set_device(0)
    else:
        torch.set_num_threads(1)
    dist.init_process_group(backend, rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=300))
    from megatron_moe.compat import apply_cpu_shims, quiet_known_warnings

    quiet_known_warnings()
    apply_cpu_shims()
    if strict_devices:
        from megatron_moe.comm import strict

        strict.enable()
    return backend


def _argv(mode, size, iters, *extra):
    backend = "nccl" if _gpu(mode) else "gloo"
    return (size[mode].split() + COMMON + ["--train-iters", str(iters),
                                           "--distributed-backend", backend]
            + [str(x) for x in extra])


class _Lines(io.TextIOBase):
    """stdout tee that keeps the lines (the training log is parsed, as an operator reads it)."""

    def __init__(self, out):
        self.out, self.lines, self._buf = out, [], ""

    def write(self, text):
        self._buf += text
        *done, self._buf = self._buf.split("\n")
        self.lines += done
        return self.out.write(text)

    def flush(self):
        self.out.flush()


def _field(line, name):
    m = re.search(re.escape(name) + r":\s*([-+0-9.eEinfa]+)", line)
    return float(m.group(1)) if m else None


def train(argv, probe=None, trace=None):
    """One pretrain() of pretrain_gpt_moe.py in this process. Returns history, per-iteration times
    (the log line's), its TFLOP/s field, loss scales, the allocator's peak over the run (CUDA), the
    offload manager's stats (when offloading), the probe's counters and the trace's records
    (ExpertTrace: the experts' grads and weights per iteration)."""
    import torch
    from megatron.core.enums import ModelType

    import pretrain_gpt_moe
    from megatron_moe import offload as offload_mod
    from megatron_moe.training import loop as T

    got = {}
    orig_install = offload_mod.install

    def install(args, model_chunks, optimizer=None):
        mgr = orig_install(args, model_chunks, optimizer)
        if mgr is not None:
            got["mgr"] = mgr
            orig_close = mgr.close

            def close():
                got["stats"] = mgr.stats()
                return orig_close()
            mgr.close = close
            if probe is not None:
                probe.attach(mgr)
        return mgr

    import gc

    from megatron_moe.compat.moe_metrics import drop_moe_metric, moe_metric_values

    for name in list(moe_metric_values()):  # sized by the previous run's layer count
        drop_moe_metric(name)
    gc.collect()
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    tee = _Lines(sys.stdout)
    offload_mod.install = install
    undo_trace = trace.patch(T.TrainingHooks) if trace is not None else (lambda: None)
    t0 = time.perf_counter()
    try:
        with contextlib.redirect_stdout(tee):
            res = T.pretrain(pretrain_gpt_moe.train_valid_test_datasets_provider,
                             pretrain_gpt_moe.model_provider, ModelType.encoder_or_decoder,
                             pretrain_gpt_moe.forward_step, argv=argv)
    finally:
        offload_mod.install = orig_install
        undo_trace()
    wall = time.perf_counter() - t0
    its = [l for l in tee.lines if "elapsed time per iteration (ms):" in l]
    out = dict(history=res["history"], wall_s=wall,
               iter_ms=[_field(l, "elapsed time per iteration (ms)") for l in its],
               tflops_log=[_field(l, "throughput per GPU (TFLOP/s/GPU)") for l in its],
               loss_scale=[_field(l, "loss scale") for l in its],
               skipped=sum(int(_field(l, "number of skipped iterations") or 0) for l in its),
               stats=got.get("stats", {}))
    if cuda:
        _sync()
        out["peak_allocated"] = torch.cuda.max_memory_allocated() - base
        out["peak_allocated_abs"] = torch.cuda.max_memory_allocated()
    if probe is not None:
        out["probe"] = probe.counts()
    if trace is not None:
        out["trace"] = trace.records()
    return out


def _steady_ms(run, warmup):
    ms = [x for x in run["iter_ms"] if x is not None]
    ms = ms[warmup:] or ms
    return statistics.median(ms) if ms else float("nan")


def _falls(losses):
    """The loss falls: the mean of the last third below the mean of the first third."""
    xs = [x for x in losses if x is not None]
    n = max(1, len(xs) // 3)
    return len(xs) >= 2 and all(math.isfinite(x) for x in xs) and \
        statistics.fmean(xs[-n:]) < statistics.fmean(xs[:n])


def bf16_peak_tflops(name):
    for key, tf in BF16_PEAK_TFLOPS:
        if key in name:
            return tf
    return None


def _estimate(argv):
    """tools/report_theoretical_memory.py's estimate and the FLOP count for these flags."""
    from megatron_moe.flops import num_floating_point_operations
    from megatron_moe.models.builder import have_transformer_engine
    from tools import report_theoretical_memory as rtm

    # without Transformer Engine the run builds megatron-core's local layers, its attention
    # as --attention-backend resolves there (auto: torch SDPA with CUDA, unfused on CPU)
    local = [] if have_transformer_engine() else ["--transformer-impl", "local"]
    args, _ = rtm.parse(list(argv) + ["--world-size", "1"] + local)
    est = rtm.estimate(args)
    return dict(estimate_bytes=est["total"], params=est["nonexpert_params"] + est["expert_params"],
                flops_per_iter=num_floating_point_operations(args, args.global_batch_size),
                tokens_per_iter=args.global_batch_size * args.seq_length)


# --- sections ----------------------------------------------------------------------------------
def section_environment(rec, mode, work):
    import torch
    import triton

    import megatron.core as mc

    fig = dict(python=sys.version.split()[0], torch=torch.__version__, triton=triton.__version__,
               megatron_core=mc.__version__, megatron_core_path=os.path.dirname(mc.__file__),
               cuda_runtime=torch.version.cuda, cuda_available=torch.cuda.is_available())
    skipped = []
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        fig.update(gpu=p.name, sm_count=p.multi_processor_count,
                   memory_gib=round(p.total_memory / 2**30, 2),
                   capability=f"sm_{p.major}{p.minor}", bf16_peak_tflops=bf16_peak_tflops(p.name),
                   nccl=_version_str(torch.cuda.nccl.version()))
        try:
            fig["driver"] = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True, text=True, timeout=30).stdout.strip()
        except (OSError, subprocess.SubprocessError) as exc:
            fig["driver"] = f"unknown ({exc})"
    else:
        skipped.append("GPU name, SM count, memory, driver, NCCL: no CUDA device here")
    from packaging.version import Version

    ok_mc = Version("0.16.1") <= Version(mc.__version__) < Version("0.20")
    wheel_error = os.environ.get("GPU_CHECK_WHEELS_ERROR")
    fig["wheels"] = os.environ.get("GPU_CHECK_WHEELS", "").split() or None  # scripts/gpu_check.sh
    ok = ok_mc and (torch.cuda.is_available() or not _gpu(mode)) and not wheel_error
    rec.info(**fig)
    summary = (f"{fig.get('gpu', 'no GPU')} sm={fig.get('sm_count', '-')} "
               f"mem={fig.get('memory_gib', '-')}GiB driver={fig.get('driver', '-')} "
               f"cuda={fig['cuda_runtime']} torch={fig['torch']} triton={fig['triton']} "
               f"megatron-core={fig['megatron_core']}")
    if not ok_mc:
        summary += " (megatron-core outside the tested range >=0.16.1,<0.20)"
    if wheel_error:
        summary += f" ({wheel_error})"
    if _gpu(mode) and not torch.cuda.is_available():
        summary += " (GPU mode but torch sees no CUDA device)"
    rec.record("environment", ok, summary, fig, skipped)


def section_kernels(rec, mode, work):
    section_environment(rec, mode, work)
    import torch
    from megatron.core.transformer.moe import moe_utils as mu

    import kernels
    from bench.dispatch import make_inputs, timeit  # the dispatch bench's inputs and timer
    from kernels import reference as ref
    from megatron_moe.compat.dispatch import mcore_permute

    dev = torch.device("cuda" if _gpu(mode) else "cpu")
    dtype = torch.bfloat16
    tol = dict(rtol=1e-2, atol=1e-2)   # bf16 weighted sums: the CPU Triton tests' tolerance
    ok, parts, fig = True, [], {}
    reps = 9 if _gpu(mode) else 3
    for T, h, E, k in KERNEL_SHAPES[mode]:
        tag = f"{T}x{h} E{E} top{k}"
        tokens, rmap, probs, idx, _ = make_inputs(T, h, E, k, dtype, torch.float32, dev)
        N = T * k
        backend = kernels.get_backend(tokens)
        want_backend = "triton" if _gpu(mode) else "torch"
        y = torch.randn(N, h, generator=torch.Generator().manual_seed(1)).to(dtype).to(dev)
        g = torch.randn(T, h, generator=torch.Generator().manual_seed(2)).to(dtype).to(dev)
        # hierarchical all-to-all layout: 2 nodes x 4 local ranks, uneven blocks
        sizes = torch.multinomial(torch.ones(8), N, replacement=True,
                                  generator=torch.Generator().manual_seed(3)).bincount(
                                      minlength=8).tolist()
        got = _dispatch_outputs(kernels, tokens, rmap, probs, y, g, N, sizes)
        # the reference on host copies: the CPU ``torch`` backend at GPU sizes (bit-identical to
        # kernels/reference.py and to megatron-core's unpermute, tests/test_kernels.py), the
        # reference module itself at the CPU mode's toy sizes (it loops over rows in Python)
        host = [t.cpu() for t in (tokens, rmap, probs, y, g)]
        if _gpu(mode):
            with kernels.use_backend("torch"):
                want = _dispatch_outputs(kernels, *host, N, sizes)
        else:
            want = _dispatch_outputs(ref, *host, N, sizes)
        got = {k: (v.cpu() if torch.is_tensor(v) else v) for k, v in got.items()}
        perm_exact = all(torch.equal(got[k], want[k]) for k in ("xp", "pp", "si"))
        unperm_err = (got["u"].float() - want["u"].float()).abs().max().item()
        unperm_ok = torch.allclose(got["u"].float(), want["u"].float(), **tol)
        grad_ok = torch.allclose(got["ga"].float(), want["ga"].float(), **tol) and \
            torch.allclose(got["gb"], want["gb"], **tol)
        hier_exact = torch.equal(got["hy"], want["hy"]) and got["hs"] == want["hs"] and \
            torch.equal(got["back"], got["xp"])
        xp, si = got["xp"].to(dev), got["si"].to(dev)
        del got, want, host
        # speed against megatron-core's own permute/unpermute (fused=False) on the same device
        perm_t = timeit({"mcore": lambda: mcore_permute(tokens, rmap, probs=probs,
                                                        num_out_tokens=N),
                         "ours": lambda: kernels.permute(tokens, rmap, probs=probs,
                                                         num_out_tokens=N)}, reps, dev)
        unperm_t = timeit({"mcore": lambda: mu.unpermute(y, si, tokens.shape, routing_map=rmap),
                           "ours": lambda: kernels.unpermute(y, si, tokens.shape,
                                                             routing_map=rmap)}, reps, dev)
        r_perm = perm_t["mcore"][0] / perm_t["ours"][0]
        r_unperm = unperm_t["mcore"][0] / unperm_t["ours"][0]
        syncs = _host_syncs(kernels, tokens, rmap, probs, N) if _gpu(mode) else None
        this = (perm_exact and unperm_ok and grad_ok and hier_exact and backend == want_backend
                and not syncs)
        ok &= this
        fig[tag] = dict(backend=backend, host_syncs=syncs,
                        permute_exact=perm_exact, unpermute_max_abs_err=unperm_err,
                        unpermute_close=unperm_ok, roundtrip_grads_close=grad_ok,
                        hierarchical_exact=hier_exact,
                        permute_ms=perm_t["ours"][0] * 1e3, mcore_permute_ms=perm_t["mcore"][0] * 1e3,
                        unpermute_ms=unperm_t["ours"][0] * 1e3,
                        mcore_unpermute_ms=unperm_t["mcore"][0] * 1e3,
                        permute_speed_vs_mcore=r_perm, unpermute_speed_vs_mcore=r_unperm)
        parts.append(f"{tag}: {backend} permute {'exact' if perm_exact else 'DIFFERS'}, "
                     f"unpermute err {unperm_err:.2g}{'' if unperm_ok else ' TOO LARGE'}, "
                     f"grads {'close' if grad_ok else 'DIFFER'}, hierarchical "
                     f"{'exact' if hier_exact else 'DIFFERS'}, vs mcore permute x{r_perm:.2f} "
                     f"unpermute x{r_unperm:.2f}"
                     + ("" if syncs is None else f", host syncs: {syncs or 'none'}")
                     + ("" if backend == want_backend else f" (backend {backend}, "
                                                           f"expected {want_backend})"))
        del tokens, rmap, probs, y, g, xp
    skipped = [] if _gpu(mode) else ["the Triton kernels on CUDA (CPU mode runs the torch backend; "
                                     "the interpreter tests cover the Triton code)",
                                     "host syncs by torch.cuda.set_sync_debug_mode (needs CUDA; "
                                     "tests/test_kernels_sync.py emulates it)"]
    rec.record("kernels", ok, "; ".join(parts), fig, skipped)


def _host_syncs(kernels, tokens, rmap, probs, N):
    """The calls megatron-core's dispatcher makes (permute with num_out_tokens, unpermute with and
    without probs, backward) under torch.cuda.set_sync_debug_mode("error"): None when nothing
    blocked the host, else the error (tests/test_kernels_sync.py's claim, on a real device)."""
    import torch

    a = tokens.detach().requires_grad_()
    b = probs.detach().requires_grad_()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        y, _, idx = kernels.permute(a, rmap, num_out_tokens=N)
        o1 = kernels.unpermute(y, idx, a.shape, routing_map=rmap)
        o2 = kernels.unpermute(y, idx, a.shape, probs=b, routing_map=rmap)
        (o1.float().sum() + o2.float().square().sum()).backward()
        return None
    except RuntimeError as exc:
        return _last(str(exc), 1)
    finally:
        torch.cuda.set_sync_debug_mode(0)
        torch.cuda.synchronize()


def _dispatch_outputs(impl, tokens, rmap, probs, y, g, N, sizes):
    """permute, unpermute, the round trip's gradients and the hierarchical layout (forward and
    back) through ``impl`` (``kernels`` or ``kernels.reference``), on the inputs' device."""
    perm = getattr(impl, "permute", None) or impl.mcore_permute
    unperm = getattr(impl, "unpermute", None) or impl.mcore_unpermute
    xp, pp, si = perm(tokens, rmap, probs=probs, num_out_tokens=N)
    u = unperm(y, si, tokens.shape, routing_map=rmap)
    a = tokens.detach().requires_grad_()
    b = probs.detach().requires_grad_()
    x2, p2, s2 = perm(a, rmap, probs=b, num_out_tokens=N)
    unperm(x2 * p2.unsqueeze(-1).to(x2.dtype), s2, a.shape, routing_map=rmap).backward(g)
    hy, hs = impl.hierarchical_layout(xp, sizes, 2, 4)
    back, _ = impl.hierarchical_layout(hy, hs, 2, 4, inverse=True)
    return dict(xp=xp, pp=pp, si=si, u=u, ga=a.grad, gb=b.grad, hy=hy, hs=list(hs), back=back)


def section_training(rec, mode, work):
    import torch

    init_process(mode)  # timed: megatron-core's deterministic settings only where resume needs them
    it = ITERS[mode]
    warm = WARMUP_ITERS[mode]
    gpu = _gpu(mode)
    skipped_mem = [] if gpu else ["peak GPU memory (torch.cuda.max_memory_allocated): no CUDA"]

    # 1. bf16 ~1B MoE with the fused permute: loss, tokens/s, TFLOP/s, MFU, memory vs estimate
    argv = _argv(mode, BIG, it["big"], "--bf16", "--moe-permute-fusion", "--log-throughput", GROUPED)
    est = _estimate(argv)
    try:
        run = train(argv)
        losses = run["history"]["lm_loss"]
        ms = _steady_ms(run, warm)
        tok_s = est["tokens_per_iter"] / (ms / 1e3)
        tflops = est["flops_per_iter"] / (ms / 1e3) / 1e12
        peak = bf16_peak_tflops(torch.cuda.get_device_name(0)) if gpu else None
        fig = dict(params=est["params"], iterations=len(losses), first_loss=losses[0],
                   last_loss=losses[-1], losses=losses, iter_ms=ms, tokens_per_s=tok_s,
                   model_tflops=tflops, log_line_tflops=run["tflops_log"][-1],
                   flops_per_iter=est["flops_per_iter"], mfu=(tflops / peak if peak else None),
                   bf16_peak_tflops=peak, estimate_bytes=est["estimate_bytes"],
                   peak_allocated=run.get("peak_allocated"), strict_devices=True)
        ok = _falls(losses) and run["tflops_log"][-1] is not None
        mem = (f", peak allocated {run['peak_allocated'] / 2**30:.2f} GiB vs estimate "
               f"{est['estimate_bytes'] / 2**30:.2f} GiB" if gpu else "")
        mfu = f" MFU {100 * fig['mfu']:.1f}%" if fig["mfu"] else ""
        rec.record("training-bf16", ok,
                   f"{est['params'] / 1e6:.1f}M params, loss {losses[0]:.3f} -> {losses[-1]:.3f}"
                   f" in {len(losses)} it, {tok_s:.0f} tokens/s, {tflops:.3g} model TFLOP/s{mfu}"
                   f"{mem}", fig,
                   skipped_mem + ([] if peak or not gpu else ["MFU: no bf16 peak known for "
                                                              "this GPU"]) +
                   ([] if gpu else ["MFU: no GPU peak on the CPU"]))
        fused_ms, grouped_first, fused_tok = ms, losses[0], tok_s
    except (Exception, SystemExit):
        _crashed(rec, "training-bf16")
        fused_ms = grouped_first = None
        fused_tok = float("nan")

    # 2. tokens/s with --moe-permute-fusion off (same model, same data)
    try:
        run = train(_argv(mode, BIG, it["fusion"], "--bf16", GROUPED))
        off_ms = _steady_ms(run, warm)
        ok = fused_ms is not None and _falls(run["history"]["lm_loss"])
        off_tok = est["tokens_per_iter"] / (off_ms / 1e3)
        rec.record("training-fusion", ok,
                   f"tokens/s fusion on {fused_tok:.0f} vs off {off_tok:.0f}: x{fused_tok / off_tok:.2f}",
                   dict(on_tokens_per_s=fused_tok, off_tokens_per_s=off_tok,
                        ratio=fused_tok / off_tok, off_losses=run["history"]["lm_loss"]))
    except (Exception, SystemExit):
        _crashed(rec, "training-fusion")

    # 3. tokens/s of megatron-core's expert loop (SequentialMLP) against the grouped GEMMs
    try:
        run = train(_argv(mode, BIG, it["loop"], "--bf16", "--moe-permute-fusion"))
        loop_ms = _steady_ms(run, min(warm, it["loop"] - 2))
        # the same init and data: the first iteration's loss (before any update) must agree, a
        # grouped kernel that mis-reads a token group (silently, on misaligned memory) cannot
        first = abs(run["history"]["lm_loss"][0] - grouped_first) if grouped_first else float("nan")
        ok = fused_ms is not None and _falls(run["history"]["lm_loss"]) and first < 1e-3
        l_tok = est["tokens_per_iter"] / (loop_ms / 1e3)
        rec.record("training-experts", ok,
                   f"tokens/s grouped GEMMs {fused_tok:.0f} vs expert loop {l_tok:.0f}: "
                   f"x{fused_tok / l_tok:.2f}; first-iteration loss |diff| {first:.2g} (< 1e-3)",
                   dict(grouped_tokens_per_s=fused_tok, loop_tokens_per_s=l_tok, ratio=fused_tok / l_tok,
                        first_loss_abs_diff=first,
                        loop_losses=run["history"]["lm_loss"]))
    except (Exception, SystemExit):
        _crashed(rec, "training-experts")


def section_resume(rec, mode, work):
    import torch

    init_process(mode, deterministic=True)
    it = ITERS[mode]
    # 1. save and resume: iterations n/2+1..n after a load equal the uninterrupted run's
    torch.use_deterministic_algorithms(True, warn_only=True)
    # without TE, --attention-backend auto is torch SDPA on CUDA, whose flash/efficient backward
    # is deterministic only under warn_only=False: bit-exact resume takes megatron-core's local
    # attention (deterministic with the cuBLAS workspace setting); the whole section does, as
    # megatron-core pins the backend per process (NVTE_* variables, asserted by the next model)
    from megatron_moe.models.builder import have_transformer_engine

    attn = [] if have_transformer_engine() else ["--attention-backend", "local"]
    n = it["resume"]
    ckpt = os.path.join(work, "resume_ckpt")
    try:
        straight = train(_argv(mode, SMALL, n, "--bf16", "--moe-permute-fusion", *attn))
        train(_argv(mode, SMALL, n, "--bf16", "--moe-permute-fusion", "--save", ckpt,
                    "--save-interval", n // 2, "--exit-interval", n // 2, *attn))
        resumed = train(_argv(mode, SMALL, n, "--bf16", "--moe-permute-fusion", "--load", ckpt,
                              *attn))
        a = straight["history"]["lm_loss"][n // 2:]
        b = resumed["history"]["lm_loss"]
        same = a == b and len(b) == n - n // 2
        diff = max((abs(x - y) for x, y in zip(a, b)), default=float("nan"))
        rec.record("training-resume", same,
                   f"iterations {n // 2 + 1}..{n} after a load {'equal' if same else 'DIFFER from'}"
                   f" the uninterrupted run (max |diff| {diff:.3g})",
                   dict(straight=a, resumed=b, max_abs_diff=diff))
    except (Exception, SystemExit):
        _crashed(rec, "training-resume")
    finally:
        torch.use_deterministic_algorithms(False)

    # 2. fp16 with dynamic loss scaling
    try:
        run = train(_argv(mode, SMALL, it["fp16"], "--fp16", "--initial-loss-scale", "65536",
                          "--moe-permute-fusion", *attn))
        losses = run["history"]["lm_loss"]
        ok = _falls(losses)
        rec.record("training-fp16", ok,
                   f"loss {losses[0]:.3f} -> {losses[-1]:.3f}, loss scale {run['loss_scale'][0]:g}"
                   f" -> {run['loss_scale'][-1]:g}, {run['skipped']} skipped iterations",
                   dict(losses=losses, loss_scale=run["loss_scale"], skipped=run["skipped"]))
    except (Exception, SystemExit):
        _crashed(rec, "training-fp16")


class ArenaProbe:
    """A forward pre-hook on every offloaded experts module (it runs after the offload manager's
    bind on the MoE layer): each expert parameter must then live in the device slot arena. Counts
    calls (proof it ran) and violations (a parameter outside the arena)."""

    def __init__(self):
        self.calls, self.violations, self._hooks = 0, 0, []

    def attach(self, mgr):
        arena = mgr.arena

        def spans():
            # the arena allocates a slot's storage at its first acquire: read the slots in use now
            out = []
            for i in range(arena.slots):
                try:
                    tensors = arena.slot(i).values()
                except RuntimeError:   # never acquired: holds no storage yet
                    continue
                out += [(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size())
                        for t in tensors]
            return out

        def hook(module, args):
            self.calls += 1
            live = spans()
            for p in module.parameters():
                ptr = p.data_ptr()
                if not any(lo <= ptr < hi for lo, hi in live) or \
                        p.device.type != arena.device.type:
                    self.violations += 1
        for layer in mgr.layers:   # the manager's bind is the MoE layer's pre-hook, so this
            self._hooks.append(layer.mlp.experts.register_forward_pre_hook(hook))  # runs after it

    def counts(self):
        return dict(calls=self.calls, violations=self.violations)


class ExpertTrace:
    """Where an offloaded run leaves resident training, per iteration (the offload check's
    diagnosis when losses differ): after each optimizer step, the norm of each MoE layer's expert
    grads in DDP's buffer (main_grad, what the step read); at the first experts forward of each
    iteration, a sample of each layer's expert weights as that forward sees them (the first
    ``SAMPLE`` elements of every expert parameter: after the offload manager's bind and copy
    wait, so a stale copy or a lost update shows). Installed for one run through the training
    loop's hooks (``patch``); the same in resident and offloaded runs."""

    SAMPLE = 256

    def __init__(self):
        self.grad_norms, self.weights, self._hooks, self._layers = [], [], [], []
        self._want_weights = True

    def patch(self, hooks_cls):
        """Wrap ``hooks_cls`` (the loop's TrainingHooks) for one run; returns the undo."""
        names = ("__init__", "after_optimizer_step")
        own = {k: hooks_cls.__dict__.get(k) for k in names}  # None: inherited
        orig_init, orig_after = hooks_cls.__init__, hooks_cls.after_optimizer_step
        trace = self

        def init(hooks, args, model, optimizer=None):
            orig_init(hooks, args, model, optimizer)
            trace.attach(model)

        def after(hooks, update_successful, grad_norm):
            trace.after_step()
            return orig_after(hooks, update_successful, grad_norm)
        hooks_cls.__init__, hooks_cls.after_optimizer_step = init, after

        def undo():
            for k in names:
                if own[k] is None:
                    delattr(hooks_cls, k)
                else:
                    setattr(hooks_cls, k, own[k])
            for h in self._hooks:
                h.remove()
            self._hooks = []
        return undo

    def attach(self, model):
        from megatron_moe.offload.manager import moe_layers

        self._layers = [list(experts.parameters()) for _, experts in moe_layers(model)]
        for i, (_, experts) in enumerate(moe_layers(model)):
            self._hooks.append(experts.register_forward_pre_hook(self._weights_hook(i)))

    def _weights_hook(self, i):
        import torch

        def hook(module, args):
            if not self._want_weights:
                return
            if i == 0:
                self.weights.append({})
            with torch.no_grad():  # one host read per layer
                self.weights[-1][i] = torch.cat([p.detach().reshape(-1)[:self.SAMPLE].float()
                                                 for p in module.parameters()]).cpu()
            if i == len(self._layers) - 1:
                self._want_weights = False
        return hook

    def after_step(self):
        import torch

        with torch.no_grad():  # one host read per layer
            self.grad_norms.append([
                float(torch.stack([p.main_grad.float().norm() for p in ps
                                   if getattr(p, "main_grad", None) is not None]).norm())
                for ps in self._layers])
        self._want_weights = True

    def records(self):
        return dict(grad_norms=self.grad_norms,
                    weights=[[w[i] for i in sorted(w)] for w in self.weights])

    @staticmethod
    def compare(run, ref):
        """Short figures: the first iteration whose expert grads (any layer) differ from the
        reference run's, and the largest |weight difference| the forward of each iteration sees."""
        a, b = run.get("trace"), ref.get("trace")
        if not a or not b:
            return None
        first_grad, layers = None, []
        for it, (ga, gb) in enumerate(zip(a["grad_norms"], b["grad_norms"]), 1):
            differ = [i for i, (x, y) in enumerate(zip(ga, gb)) if x != y]
            if differ:
                first_grad = dict(iteration=it, layers=differ,
                                  norms=[round(x, 5) for x in ga], resident=[round(y, 5) for y in gb])
                break
        w_diff = [max(float((x - y).abs().max()) for x, y in zip(wa, wb))
                  for wa, wb in zip(a["weights"], b["weights"])]
        return dict(first_expert_grad_diff=first_grad, max_weight_diff_per_forward=w_diff)


def plant_skip_bind(layer_index=1):
    """The planted fault: MoE layer ``layer_index`` skips its bind to the device slot once (its
    experts then compute on the host buffer, or on an ssd placeholder). Returns an undo."""
    from megatron_moe.offload import manager

    orig = manager._Layer.bind
    state = {"skipped": 0}

    def bind(self, tensors, *rest):
        if self.index == layer_index and tensors is self.slot_views and not state["skipped"]:
            state["skipped"] += 1
            return None
        return orig(self, tensors, *rest)
    manager._Layer.bind = bind

    def undo():
        manager._Layer.bind = orig
        return state["skipped"]
    return undo


# The offload check's criterion. On the CPU offloaded and resident runs step the experts with the
# same arithmetic (torch's per-tensor CPU Adam), so every iteration is bit-equal. On CUDA they do
# not: resident experts step with torch's fused CUDA Adam (compat/optimizer.fuse_torch_adam), the
# offloaded ones on the host (host tier: torch's fused CPU Adam; ssd: its per-tensor CPU Adam),
# and no two of these round alike (measured on the H200, torch 2.11: after one AdamW step of
# 4M fp32 parameters 27% differ by 1-2 ulp between the fused CUDA kernel and either CPU path).
# Megatron's warmup starts at lr 0, so step 1 changes no weight and iterations 1-2 compute on the
# initial weights: bit-equal. From step 2 on the runs differ by rounding: in fp32 the 1-ulp
# differences stay at that level (the H200 run: losses equal, grad norms within 4e-7 relative);
# in bf16 the model copy turns a few of them into 1-ulp bf16 flips (2^-8), which move top-k
# routing decisions, so the drift grows with the iterations (H200: grad norm within 0.04%, 0.4%,
# 0.6%, 2.4% at iterations 3-6, loss within 2e-4 relative). The bounds below leave room over
# those figures and stay far below what a lost gradient does (the first H200 run's DDP hook bug:
# grad norm 23% low from iteration 2, loss 3e-3 high by iteration 6; experts without gradients
# take a layer's expert grad norm to 0).
OFFLOAD_EXACT_ITERS = 2
OFFLOAD_TOLERANCE = {"fp32": dict(loss=1e-5, grad_norm=1e-4, layer_grad=1e-3),
                     "bf16": dict(loss=1e-3, grad_norm=5e-2, layer_grad=0.5)}


def offload_criterion(mode, precision):
    """What the offload check demands of an offloaded run against its resident one: bit-equal
    through ``exact_iters`` (None: every iteration, the CPU), then relative differences within
    ``tolerance`` (loss, grad norm, each MoE layer's expert grad norm)."""
    if not _gpu(mode):
        return dict(exact_iters=None, tolerance=None)
    return dict(exact_iters=OFFLOAD_EXACT_ITERS, tolerance=OFFLOAD_TOLERANCE[precision])


def _rel(x, y):
    """|x - y| / |y|; inf where that is not finite (a NaN must not pass a tolerance)."""
    if x == y:
        return 0.0
    r = abs(x - y) / abs(y) if y else float("inf")
    return r if math.isfinite(r) else float("inf")


def offload_verdict(r, ref, criterion):
    """(passed, one line) of an offloaded run ``r`` against the resident run ``ref`` under
    ``criterion`` (offload_criterion): a crash fails; the arena probe must have run and seen
    every expert parameter in the arena; losses, grad norms and (traced runs) each layer's expert
    grad norm and the weights each forward saw bit-equal through the exact iterations, within the
    tolerance after them."""
    if r.get("error"):
        return False, f"crashed ({r['error']})"
    exact, tol = criterion["exact_iters"], criterion["tolerance"]
    la, lb = r["history"]["lm_loss"], ref["history"]["lm_loss"]
    ga, gb = r["history"].get("grad_norm", []), ref["history"].get("grad_norm", [])
    n = len(lb)
    exact = n if exact is None else min(exact, n)
    ta, tb = r.get("trace"), ref.get("trace")
    layers_a = ta["grad_norms"] if ta else []
    layers_b = tb["grad_norms"] if tb else []
    problems = []
    if len(la) != n:
        problems.append(f"{len(la)} losses vs {n}")
    # the exact iterations: the grad norms carry the first sign of a gradient lost on its way to
    # the optimizer (the first H200 run's were lower from iteration 2, its losses equal until 3)
    for it in range(1, exact + 1):
        bad = [name for name, a, b in (("loss", la, lb), ("grad norm", ga, gb))
               if len(a) >= it and len(b) >= it and a[it - 1] != b[it - 1]]
        if len(layers_a) >= it and len(layers_b) >= it and layers_a[it - 1] != layers_b[it - 1]:
            bad.append("expert grads")
        if ta and tb and len(ta["weights"]) >= it and len(tb["weights"]) >= it and any(
                bool((x != y).any()) for x, y in zip(ta["weights"][it - 1], tb["weights"][it - 1])):
            bad.append("expert weights")
        if bad:
            problems.append(f"iteration {it} (exact) {', '.join(bad)} differ")
            break
    worst = dict(loss=0.0, grad_norm=0.0, layer_grad=0.0)
    for it in range(exact + 1, n + 1):
        pairs = [("loss", la, lb), ("grad_norm", ga, gb)]
        for key, a, b in pairs:
            if len(a) >= it and len(b) >= it:
                worst[key] = max(worst[key], _rel(a[it - 1], b[it - 1]))
        if len(layers_a) >= it and len(layers_b) >= it:
            worst["layer_grad"] = max([worst["layer_grad"]] + [
                _rel(x, y) for x, y in zip(layers_a[it - 1], layers_b[it - 1])])
    if tol is not None:
        for key, limit in tol.items():
            if worst[key] > limit:
                problems.append(f"{key.replace('_', ' ')} rel diff {worst[key]:.2g} > {limit:g}")
    pr = r.get("probe") or {}
    if not (pr.get("calls", 0) > 0 and pr.get("violations", 1) == 0):
        problems.append(f"probe {pr.get('calls')} binds checked, {pr.get('violations')} "
                        "outside the arena")
    if exact >= n:
        what = "bit-equal in every iteration"
    else:
        what = (f"bit-equal through iteration {exact}, then within rounding: max rel diff loss "
                f"{worst['loss']:.2g} (<= {tol['loss']:g}), grad norm {worst['grad_norm']:.2g} "
                f"(<= {tol['grad_norm']:g}), layer expert grads {worst['layer_grad']:.2g} "
                f"(<= {tol['layer_grad']:g})")
    maxdiff = max((abs(x - y) for x, y in zip(la, lb)), default=float("nan"))
    text = (f"{what}; losses {'equal' if la == lb else f'max |diff| {maxdiff:.3g}'}, probe "
            f"{pr.get('calls')} binds checked, {pr.get('violations')} outside the arena")
    if problems:
        return False, "FAILED: " + "; ".join(problems) + f" ({text})"
    return True, text


def section_offload(rec, mode, work):
    init_process(mode)
    n = ITERS[mode]["offload"]
    gpu = _gpu(mode)
    plant_all = os.environ.get(PLANT_ENV, "") == "skip-bind"
    base = ["--bf16"] if gpu else []
    host = ["--moe-expert-offload", "host", "--moe-offload-cache-layers", "2",
            "--moe-offload-debug-nan-fill"]
    ssd = ["--moe-expert-offload", "ssd", "--moe-offload-cache-layers", "2",
           "--moe-offload-debug-nan-fill", "--moe-offload-dir", os.path.join(work, "ssd"),
           "--moe-offload-host-cache-gb", "1.0" if gpu else "0.0001"]

    def run(extra, plant=False, precision=base):
        probe = ArenaProbe() if "--moe-expert-offload" in extra else None
        undo = plant_skip_bind() if plant else None
        try:
            out = train(_argv(mode, MID, n, *precision, *extra), probe=probe,
                        trace=None if plant else ExpertTrace())
            out["error"] = None
        except BaseException as exc:  # a crash is an outcome here (SystemExit from a NaN loss too)
            out = dict(error=_last(traceback.format_exc()) or repr(exc))
        finally:
            if undo is not None:
                out["planted_skips"] = undo()
        return out

    try:
        resident = run([])
        if resident.get("error"):
            raise RuntimeError(resident["error"])
        h = run(host, plant=plant_all)
        # the ssd tier keeps fp32 master weights as the parameters themselves and refuses
        # --bf16 at parse time: it is compared with an fp32 resident run
        resident32 = run([], precision=[]) if base else resident
        if resident32.get("error"):
            raise RuntimeError(resident32["error"])
        s = run(ssd, precision=[])
        planted = run(host, plant=True)
        bf16, fp32 = offload_criterion(mode, "bf16" if base else "fp32"), \
            offload_criterion(mode, "fp32")
        ok_h, why_h = offload_verdict(h, resident, bf16)
        ok_s, why_s = offload_verdict(s, resident32, fp32)
        caught, why_p = offload_verdict(planted, resident, bf16)
        caught = not caught and planted.get("planted_skips", 0) == 1
        fig = dict(resident_losses=resident["history"]["lm_loss"],
                   criterion=dict(host=bf16, ssd=fp32))
        diagnosis = []
        for name, r, ref in (("host", h, resident), ("ssd", s, resident32)):
            st = r.get("stats", {})
            trace = ExpertTrace.compare(r, ref)
            fig[name] = dict(losses=r.get("history", {}).get("lm_loss"), error=r.get("error"),
                             grad_norms=r.get("history", {}).get("grad_norm"),
                             resident_grad_norms=ref.get("history", {}).get("grad_norm"),
                             manager_device_peak=st.get("device_peak"),
                             resident_expert_bytes=st.get("resident"),
                             hidden_copy_fraction=st.get("hidden"), copy_s=st.get("copy_s"),
                             wait_s=st.get("wait_s"), probe=r.get("probe"),
                             grad_hooks_renewed=st.get("grad_hooks_renewed"), trace=trace,
                             peak_allocated=r.get("peak_allocated"))
            if trace and (trace["first_expert_grad_diff"] or any(trace["max_weight_diff_per_forward"])):
                g = trace["first_expert_grad_diff"]
                diagnosis.append(
                    f"{name}: expert grads first differ at iteration "
                    f"{g['iteration'] if g else '-'} (layers {g['layers'] if g else '-'}), "
                    "max |expert weight diff| seen by each iteration's forward "
                    f"{[float(f'{x:.2g}') for x in trace['max_weight_diff_per_forward']]}")
        fig["resident_peak_allocated"] = resident.get("peak_allocated")
        fig["resident_fp32_losses"] = resident32["history"]["lm_loss"]
        fig["resident_fp32_peak_allocated"] = resident32.get("peak_allocated")
        fig["planted"] = dict(detected=caught, how=why_p, skips=planted.get("planted_skips"))
        mem = ""
        if gpu and h.get("peak_allocated") and resident.get("peak_allocated"):
            mem = (f"; allocator peak K=2 host {h['peak_allocated'] / 2**20:.0f} MiB vs "
                   f"resident {resident['peak_allocated'] / 2**20:.0f} MiB (bf16), ssd "
                   f"{(s.get('peak_allocated') or 0) / 2**20:.0f} MiB vs resident "
                   f"{(resident32.get('peak_allocated') or 0) / 2**20:.0f} MiB (fp32)")
        hid = fig["host"]["hidden_copy_fraction"]
        summary = (f"host K=2: {why_h}; ssd K=2: {why_s}{mem}; copy hidden "
                   f"{100 * hid:.0f}% (host)" if hid is not None else
                   f"host K=2: {why_h}; ssd K=2: {why_s}{mem}")
        summary += f"; planted skipped bind {'DETECTED' if caught else 'NOT DETECTED'} ({why_p})"
        if diagnosis:
            summary += "; " + "; ".join(diagnosis)
        if plant_all:
            summary += f"; {PLANT_ENV}=skip-bind planted into the host run"
        rec.record("offload", ok_h and ok_s and caught, summary, fig,
                   [] if gpu else ["device peaks by the CUDA allocator and CUDA-stream copy "
                                   "overlap: no CUDA (the manager's own byte count is reported)"])
    except (Exception, SystemExit):
        _crashed(rec, "offload")


PROMPTS = ["1 2 3 4 5 6 7 8", "10 11 12 13"]


def _parse_tool_output(text):
    """tools/generate.py's printout -> [(text, log probs)] per prompt."""
    blocks = [b.strip("\n") for b in text.split("-" * 80)[1:-1]]
    out = []
    for b in blocks:
        lines = b.strip().splitlines()
        lp = next((l for l in lines if l.startswith("log probs: ")), None)
        out.append((lines[0], [float(x) for x in lp.split()[2:]] if lp else None))
    return out


def section_inference(rec, mode, work):
    import torch

    init_process(mode)
    gpu = _gpu(mode)
    ckpt = os.path.join(work, "infer_ckpt")
    ntok = 16 if gpu else 6
    # an fp32 checkpoint: GPU and CPU greedy then agree token for token (TF32 is off in torch)
    train(_argv(mode, MID, ITERS[mode]["infer"], "--save", ckpt))
    torch.backends.cuda.matmul.allow_tf32 = False
    from megatron_moe.inference.engine import TextGenerator, setup_model
    from megatron_moe.inference.arguments import parse_inference_args
    from megatron_moe.inference.ring_memory import RingMemory
    from tools.generate import add_text_generate_args, validate_generation_args

    tool_argv = ["--load", ckpt, "--use-checkpoint-args", "--num-tokens-to-generate", str(ntok),
                 "--return-log-probs", "--prompts", *PROMPTS]
    args = parse_inference_args(tool_argv, add_text_generate_args, prog="generate.py",
                                validate_tool=validate_generation_args)
    model, tokenizer, _ = setup_model(args)
    gen = TextGenerator(model, tokenizer, args)

    def generate():
        _sync()
        t0 = time.perf_counter()
        res = gen.generate(PROMPTS, tokens_to_generate=ntok, return_log_probs=True)
        _sync()
        dt = time.perf_counter() - t0
        return res, sum(len(r.tokens) for r in res) / dt

    def peak_during(fn):
        if not torch.cuda.is_available():
            return fn() + (None,)
        import gc

        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        out = fn()
        return out + (torch.cuda.max_memory_allocated(),)  # all the process holds: weights too

    generate()  # warm-up (kernels compiled, caches sized)
    res, tok_s, _ = peak_during(generate)
    # the same checkpoint greedy on the CPU: the tool itself, CUDA hidden
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONPATH=os.pathsep.join(
        [ROOT] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    for k in ("MASTER_PORT", "MASTER_ADDR", "RANK", "WORLD_SIZE", "LOCAL_RANK",
              "LOCAL_WORLD_SIZE"):
        env.pop(k, None)
    try:
        p = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "generate.py"), *tool_argv],
                           capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
        cpu = _parse_tool_output(p.stdout) if p.returncode == 0 else []
        if p.returncode != 0:
            raise RuntimeError(f"tools/generate.py on the CPU exited {p.returncode}: "
                               f"{_last(p.stderr)}")
        same_text = [r.text for r in res] == [c[0] for c in cpu]
        lp_diff = max(abs(a - b) for r, c in zip(res, cpu) for a, b in zip(r.log_probs, c[1]))
        ok = same_text and len(cpu) == len(PROMPTS) and lp_diff < 1e-3
        rec.record("inference-gpu-vs-cpu", ok,
                   f"greedy {ntok} tokens x {len(PROMPTS)} prompts on "
                   f"{'the GPU' if gpu else 'the CPU (in process)'}: tokens "
                   f"{'equal' if same_text else 'DIFFER'} to tools/generate.py on the CPU, max "
                   f"|log prob diff| {lp_diff:.2g} (tolerance 1e-3); {tok_s:.1f} tokens/s",
                   dict(texts=[r.text for r in res], cpu_texts=[c[0] for c in cpu],
                        max_log_prob_diff=lp_diff, tokens_per_s=tok_s))
    except (Exception, SystemExit):
        _crashed(rec, "inference-gpu-vs-cpu")

    # ring memory with K=2 against resident, same model, same process
    try:
        def best_of(n):  # the fastest of n generations (after a warm-up): tokens/s, peak
            runs = [peak_during(generate) for _ in range(n)]
            return runs[0][0], max(r[1] for r in runs), max(r[2] or 0 for r in runs) or None

        res0, tok0, peak0 = best_of(3)
        ring = RingMemory(model, slots=2, debug=True)
        generate()
        res2, tok2, peak2 = best_of(3)
        st = ring.stats()
        ring.close()
        same = [r.tokens for r in res2] == [r.tokens for r in res0] and \
            [r.log_probs for r in res2] == [r.log_probs for r in res0]
        frac = st["peak_device_bytes"] / max(1, st["streamed_bytes"])
        layers = args.num_layers
        mem = (f"; allocator peak during generation {peak2 / 2**20:.1f} MiB vs resident "
               f"{peak0 / 2**20:.1f} MiB" if peak0 is not None else "")
        rec.record("inference-ring-memory", same and st["peak_device_bytes"] > 0,
                   f"K=2 of {layers} layers: tokens {'equal' if same else 'DIFFER'}, device "
                   f"weight bytes {frac:.3f} of streamed (K/N = {2 / layers:.3f}){mem}; "
                   f"{tok2:.1f} vs {tok0:.1f} tokens/s (x{tok2 / tok0:.2f})",
                   dict(stats=st, fraction=frac, k_over_n=2 / layers, tokens_per_s=tok2,
                        resident_tokens_per_s=tok0, peak_allocated=peak2,
                        resident_peak_allocated=peak0),
                   [] if gpu else ["device memory by the CUDA allocator: no CUDA (the arena's "
                                   "own byte count is reported)"])
    except (Exception, SystemExit):
        _crashed(rec, "inference-ring-memory")


def section_syncs(rec, mode, work):
    """Host syncs per training iteration (megatron_moe/gpucheck/syncs.py): the SMALL model with
    grouped experts and the fused permute, a log line every 4th iteration; in the iterations without
    one our code must not sync at all, megatron-core's alltoall dispatcher syncs once per MoE layer
    and micro-batch for its split sizes (docs/gpu.md, "Host syncs")."""
    from megatron_moe.gpucheck.syncs import SyncCounter
    from megatron_moe.training import loop as T

    init_process(mode)
    n, log_every = ITERS[mode]["syncs"], 4 if _gpu(mode) else 2
    extra = ["--bf16"] if _gpu(mode) else []
    # the MoE hot path alone: result validation (Megatron's default --rerun-mode validate_results)
    # adds one read of ours and one of megatron-core's per iteration (docs/gpu.md, host syncs)
    argv = _argv(mode, SMALL, n, "--moe-permute-fusion", GROUPED, "--rerun-mode", "disabled",
                 *extra)
    argv[argv.index("--log-interval") + 1] = str(log_every)
    counter = SyncCounter()
    step, seen = T.Trainer.train_step, []

    def counted_step(self, data_iterator):
        seen.append(len(seen) + 1)
        counter.phase = seen[-1]
        return step(self, data_iterator)

    T.Trainer.train_step = counted_step
    try:
        with counter:
            run = train(argv)
    except (Exception, SystemExit):
        _crashed(rec, "training-syncs")
        return
    finally:
        T.Trainer.train_step = step
    # steady iterations without a log line (the first one builds lazy state)
    quiet = [i for i in seen[1:-1] if i % log_every]
    phases = counter.per_phase()
    per = {k: [phases.get(i, {}).get(k, 0) for i in quiet]
           for k in ("total", "ours", "megatron-core", "other")}
    layers = int(SMALL[mode].split("--num-layers ")[1].split()[0])
    flag = lambda name: int(argv[len(argv) - 1 - argv[::-1].index(name) + 1])  # noqa: E731 (last wins)
    micro = flag("--global-batch-size") // flag("--micro-batch-size")   # world size 1
    fig = dict(iterations=len(seen), quiet_iterations=quiet, syncs_per_iteration=per,
               megatron_core_per_layer_microbatch=(
                   statistics.median(per["megatron-core"]) / (layers * micro) if quiet else None),
               ours_sites=counter.sites(quiet, "ours"), top_sites=counter.sites(quiet),
               log_iteration_syncs={i: phases.get(i, {}).get("total", 0)
                                    for i in seen if i % log_every == 0},
               losses=run["history"]["lm_loss"])
    if not counter.available:
        rec.record("training-syncs", len(seen) == n and len(counter.events) == 0,
                   f"{len(seen)} iterations under the sync counter; no CUDA: nothing to count",
                   fig, ["cudaStreamSynchronize per iteration (torch.cuda.set_sync_debug_mode): "
                         "no CUDA; tests/test_host_syncs.py counts host reads on the CPU"])
        return
    ours = max(per["ours"]) if quiet else None
    ok = bool(quiet) and ours == 0
    rec.record("training-syncs", ok,
               f"syncs per iteration without a log line: {statistics.median(per['total']):.0f} "
               f"(ours {ours}, megatron-core {statistics.median(per['megatron-core']):.0f} = "
               f"{fig['megatron_core_per_layer_microbatch']:.2f} per MoE layer and micro-batch)"
               + (f"; ours at {fig['ours_sites'][:3]}" if ours else ""), fig)


def _crashed(rec, name):
    tb = traceback.format_exc()
    print(tb, flush=True)  # the whole traceback in the log; the last lines in the report
    rec.record(name, False, "crashed: " + _last(tb))


def _last(text, n=3):
    lines = [l for l in str(text).strip().splitlines() if l.strip()]
    return " | ".join(l.strip() for l in lines[-n:])[:600]


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m megatron_moe.gpucheck.checks")
    p.add_argument("section", choices=[s for s in SECTIONS if s != "perf"])
    p.add_argument("--result", required=True)
    p.add_argument("--work", required=True)
    p.add_argument("--cpu", action="store_true")
    a = p.parse_args(argv)
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    mode = "cpu" if a.cpu else "gpu"
    os.makedirs(a.work, exist_ok=True)
    rec = Recorder(a.result, mode)
    globals()["section_" + a.section](rec, mode, a.work)
    try:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
