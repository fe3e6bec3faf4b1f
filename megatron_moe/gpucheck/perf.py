"""The GPU kit's performance section: one MoE model trained by four systems side by side.

``bash scripts/gpu_check.sh --sections perf OUTDIR`` (docs/gpu.md, "The performance section"):
for each shape (``SHAPES``: Mixtral-like, 8 experts top-2 with a large FFN; Qwen3-MoE-like
fine-grained, many small experts top-8), the same model, micro-batch, sequence and micro-batches
per optimizer step (gradient accumulation), world size 1, bf16, is trained for a few iterations (an
iteration is one optimizer step) by

* ``ours``: this project's ``pretrain()`` with every speed option its parser accepts (probed at run
  time: grouped experts, SDPA attention, the fused permute; ``speed_options``),
* ``stock``: the same ``pretrain()`` with megatron-core's local path as it comes (the expert loop
  ``SequentialMLP``, the unfused local attention),
* ``torchtitan``: its Qwen3 MoE model (``_build_qwen3_moe_layers``; Mixtral-like is that model
  without the q/k norms), its FSDP2 mixed-precision wrapping at world size 1, its loss, optimizer
  container, LR scheduler and grad clipping, in the order of its ``Trainer.train_step`` with its
  defaults (on CUDA the forward and backward replayed as one CUDA graph), on our synthetic batch
  instead of its data stack,
* ``transformers``: ``MixtralForCausalLM`` / ``Qwen3MoeForCausalLM`` from a config, fp32 weights
  under bf16 autocast (what its Trainer does with ``bf16=True``), AdamW, grad clipping,

each in its own process with a time limit (a failing row reports its error; the others still run).
Every row counts FLOPs with the one formula (megatron_moe/flops.py) from the shape, and reports
tokens/s, MFU against the card's bf16 dense peak, peak allocated memory, and per iteration the
kernel launches and host syncs (torch.profiler on CUDA) or, on the CPU, the aten op calls and the
host reads that would block on a GPU. Each row's parameter count must equal the shape's: the proof
that the four systems trained the same model. Speed targets are reported, never asserted.

``--cpu`` runs the same section at toy sizes (the suite does: tests/test_gpu_kit.py); its figures
say nothing about GPU speed.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import importlib.util
import io
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import time
import traceback

from megatron_moe.gpucheck.host_time import HostProfile, format_breakdown
from megatron_moe.gpucheck.process import module_command, run_module

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SYSTEMS = ("ours", "ours-graphed", "ours-eager", "ours-per-expert", "stock", "torchtitan",
           "transformers")
# Megatron-style (layers, hidden, heads, query groups, head dim, expert FFN, experts, top-k,
# vocabulary, sequence, micro-batch, micro-batches per optimizer step, q/k RMSNorm as Qwen3). Every
# layer is MoE, no shared experts, untied embeddings, RoPE theta 1e6, RMSNorm eps 1e-6, SwiGLU, no
# biases. Several micro-batches per step, as Megatron users train (global batch = micro-batch x
# micro-batches x data parallel) and torchtitan's trainer accumulates: the work per parameter
# (optimizer step, gradient norm and clipping, the bf16 copy, zeroing) is paid once per step. At one
# micro-batch it was 36 of the fine-grained model's 101 ms per iteration (2026-11-29 H200 profile,
# 2.6B parameters for 8k tokens), a share a real run's global batch of millions of tokens never has.
SHAPES = {
    # ~2.3B parameters, ~0.7B active: Mixtral's 8 experts top-2 with FFN 3.5x hidden
    "mixtral": {"gpu": dict(layers=6, hidden=2048, heads=16, groups=4, head_dim=128, ffn=7168,
                            experts=8, topk=2, vocab=32000, seq=2048, batch=8, microbatches=4,
                            qk_norm=False),
                "cpu": dict(layers=2, hidden=64, heads=4, groups=2, head_dim=16, ffn=224,
                            experts=8, topk=2, vocab=512, seq=64, batch=2, microbatches=2,
                            qk_norm=False)},
    # Qwen3-30B-A3B's layer (128 experts of 768, top-8, 32 query heads of 128, 4 groups), 4 of
    # them: ~2.6B parameters. Batch 4: the stock local attention keeps the full score matrices.
    "finegrained": {"gpu": dict(layers=4, hidden=2048, heads=32, groups=4, head_dim=128,
                                ffn=768, experts=128, topk=8, vocab=32000, seq=2048, batch=4,
                                microbatches=4, qk_norm=True),
                    "cpu": dict(layers=2, hidden=64, heads=4, groups=2, head_dim=16, ffn=16,
                                experts=64, topk=8, vocab=512, seq=64, batch=2, microbatches=2,
                                qk_norm=True)},
}
# iterations: warm-up (left out), timed (median), profiled (counted, not timed)
ITERS = {"gpu": dict(warmup=3, timed=4, profiled=1), "cpu": dict(warmup=1, timed=2, profiled=1)}
# seconds each row may take at most (GPU, CPU), start-up included; the runner also keeps the whole
# section inside its budget (on the GPU 540 s: the section fits one 10-minute device call)
ROW_CAP_S = {"ours": (90, 300), "ours-graphed": (80, 300), "ours-eager": (60, 300),
             "ours-per-expert": (60, 300),
             "stock": (100, 300),
             "torchtitan": (70, 300),
             # 4 micro-batches per step: the Mixtral-like step is ~5 s (13k tokens/s on the H200)
             "transformers": (110, 300)}
SECTION_BUDGET_S = {"gpu": 540.0, "cpu": 1500.0}
# the speed options of "ours", in order; in each group the first set the parser accepts is used
# (on the local path --moe-grouped-gemm selects torch grouped_mm experts and --attention-backend
# flash SDPA, --moe-single-grouped-weight one parameter per expert linear per layer; an older
# build refuses them: then the option is left out and reported).
# --moe-permute-fusion (kernels/, Triton on CUDA) is not among them, by measurement: on the H200
# (docs/gpu_runs/2026-11-28-h200, the kit's training-fusion check) it trained the kit's model at
# x0.86 of megatron-core's unfused permute (22165 vs 25684 tokens/s)
SPEED_CANDIDATES = ((("--moe-grouped-gemm",), ("--moe-torch-grouped-gemm",)),
                    (("--moe-single-grouped-weight",),),
                    (("--attention-backend", "flash"),),
                    (("--cross-entropy-loss-fusion",),))
# "ours-eager": ours with megatron-core's torch.compile fusions off (on CUDA the local path takes
# them by Megatron's defaults: bias + SwiGLU, bias-dropout-add; and the fused cross-entropy asked
# for above), so the report measures what they bring (models/builder.py _fusion_selectors)
EAGER_OPTIONS = ("--no-bias-swiglu-fusion", "--no-bias-dropout-fusion")
EAGER_ON_CPU = "the compiled fusions apply on CUDA only: on the CPU ours is eager"
# "ours-per-expert": ours with one parameter per expert linear (without --moe-single-grouped-weight),
# so the report measures what the single grouped weight brings on the device; on the CPU
# bench/single_grouped_weight.py measures it (ops, Python calls, host time)
SINGLE_WEIGHT_OPTION = "--moe-single-grouped-weight"
PER_EXPERT_ON_CPU = "measured on the CPU by bench/single_grouped_weight.py; this row is CUDA only"
# "ours-graphed": ours with Megatron-LM's full-iteration CUDA graph (training/cuda_graph.py: the
# forward and backward captured once after 2 eager iterations, inside the meter's warm-up, then
# replayed), as torchtitan's row captures its step; on the CPU tests/test_cuda_graph.py proves the
# region reads nothing on the host
GRAPH_WARMUP = 2
GRAPH_OPTIONS = ("--cuda-graph-impl", "full_iteration", "--cuda-graph-warmup-steps",
                 str(GRAPH_WARMUP), "--no-check-for-nan-in-loss-and-grad")
# the graphed row's losses against ours' (same batch and seed), relative: bit-equal before the
# capture (eager), within GRAPH_FIRST_REPLAY_RTOL at the first replayed iteration, within
# GRAPH_LOSS_RTOL after it. A replay does not round as the eager iteration does (measured below),
# and the models memorise the one batch at lr 3e-4, which grows any difference: on the H200
# (2026-11-29) 1.6e-4 at the first replay and 1.6% four iterations later (Mixtral-like, loss 10.8
# -> 3.8), 1e-4 throughout (fine-grained). Replays that did not train would leave the loss where
# the capture found it, tens of percent from ours' by the end.
GRAPH_FIRST_REPLAY_RTOL = 1e-3
GRAPH_LOSS_RTOL = 5e-2
GRAPHED_ON_CPU = "CUDA graphs are CUDA only: on the CPU tests/test_cuda_graph.py checks the region"
CUDA_ONLY_ROWS = {"ours-graphed": GRAPHED_ON_CPU, "ours-eager": EAGER_ON_CPU,
                  "ours-per-expert": PER_EXPERT_ON_CPU}
TARGETS = {"mixtral": dict(mfu=0.40), "finegrained": dict(mfu=0.25),
           "vs_torchtitan": 1.0, "vs_stock": 5.0}
LR, MIN_LR, WEIGHT_DECAY, BETAS, CLIP = 3e-4, 3e-5, 0.1, (0.9, 0.95), 1.0
# profiler event names: CUDA runtime/driver calls that launch a kernel or block the host. A CUDA
# graph replay (torchtitan's default forward and backward) is one launch call for all the kernels
# it captured: counted here as one, and reported apart as graph launches
GRAPH_LAUNCH_EVENTS = ("cudaGraphLaunch",)
LAUNCH_EVENTS = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx",
                 "cudaLaunchCooperativeKernel") + GRAPH_LAUNCH_EVENTS
SYNC_EVENTS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")
# aten ops that read a device value on the host (they block the host on CUDA)
HOST_READ_OPS = ("aten::_local_scalar_dense", "aten::nonzero")
GROUPED_OPS = ("aten::_grouped_mm", "aten::grouped_mm")   # see count_events


TORCHTITAN = "0.3.0"   # the pinned release (megatron_moe/gpucheck/wheels.py PERF_WHEELS)


class RowSkipped(Exception):
    """A row that cannot run here, with the reason (reported; a failure only on the GPU)."""


# --- the shape, as each system spells it -------------------------------------------------------
def _count(n):
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"


def expected_params(s):
    """Parameters of the shape's model (the count every system's model must have)."""
    h, q, kv = s["hidden"], s["heads"] * s["head_dim"], s["groups"] * s["head_dim"]
    attn = h * q + 2 * h * kv + q * h + (2 * s["head_dim"] if s["qk_norm"] else 0)
    moe = s["experts"] * 3 * h * s["ffn"] + s["experts"] * h
    return 2 * s["vocab"] * h + s["layers"] * (attn + moe + 2 * h) + h


def flops_args(s):
    """The shape as megatron_moe/flops.py reads it."""
    import types

    return types.SimpleNamespace(
        num_layers=s["layers"], hidden_size=s["hidden"], num_attention_heads=s["heads"],
        seq_length=s["seq"], ffn_hidden_size=s["ffn"], vocab_size=s["vocab"],
        padded_vocab_size=s["vocab"], swiglu=True, num_experts=s["experts"],
        moe_router_topk=s["topk"], moe_ffn_hidden_size=s["ffn"], moe_layer_freq=1,
        kv_channels=s["head_dim"], group_query_attention=True, num_query_groups=s["groups"],
        moe_shared_expert_intermediate_size=None)


def megatron_argv(s, gpu, iters):
    argv = (f"--num-layers {s['layers']} --hidden-size {s['hidden']} "
            f"--num-attention-heads {s['heads']} --group-query-attention "
            f"--num-query-groups {s['groups']} --kv-channels {s['head_dim']} "
            f"--ffn-hidden-size {s['ffn']} --num-experts {s['experts']} "
            f"--moe-ffn-hidden-size {s['ffn']} --moe-router-topk {s['topk']} "
            f"--seq-length {s['seq']} --max-position-embeddings {s['seq']} "
            f"--micro-batch-size {s['batch']} "
            f"--global-batch-size {s['batch'] * s['microbatches']} "
            # NullTokenizer adds its end-of-document id: vocab - 1 + 1 = the shape's vocabulary
            f"--vocab-size {s['vocab'] - 1} --make-vocab-size-divisible-by 128 "
            "--swiglu --normalization RMSNorm --norm-epsilon 1e-6 --position-embedding-type rope "
            "--rotary-base 1000000 --untie-embeddings-and-output-weights --disable-bias-linear "
            "--hidden-dropout 0 --attention-dropout 0 --moe-router-load-balancing-type none "
            "--moe-token-dispatcher-type alltoall --tokenizer-type NullTokenizer --mock-data "
            f"--lr {LR} --min-lr {MIN_LR} --lr-warmup-iters 1 --lr-decay-style cosine "
            f"--weight-decay {WEIGHT_DECAY} --adam-beta1 {BETAS[0]} --adam-beta2 {BETAS[1]} "
            f"--clip-grad {CLIP} --train-iters {iters} --log-interval 1 "
            "--eval-interval 1000000 --eval-iters 1 --seed 1234 --bf16").split()
    argv += ["--distributed-backend", "nccl" if gpu else "gloo"]
    return argv + (["--qk-layernorm"] if s["qk_norm"] else [])


def speed_options(argv):
    """The speed options of ``SPEED_CANDIDATES`` that this project's parser accepts with ``argv``
    (the first accepted set of each group), and the groups none of whose sets it accepted."""
    from megatron_moe.arguments import parse_args

    chosen, refused = [], []
    for group in SPEED_CANDIDATES:
        for flags in group:
            try:
                with contextlib.redirect_stderr(io.StringIO()):
                    parse_args(list(argv) + chosen + list(flags), world_size=1,
                               check_data_paths=False)
            except (SystemExit, ValueError):
                continue
            chosen += list(flags)
            break
        else:
            refused.append(" | ".join(" ".join(f) for f in group))
    return chosen, refused


def synthetic_batch(s):
    """The one batch every system trains on: (batch, seq + 1) seeded random token ids."""
    import torch

    g = torch.Generator().manual_seed(1234)
    return torch.randint(0, s["vocab"], (s["batch"], s["seq"] + 1), generator=g)


# --- timing and counting, the same for every system --------------------------------------------
class Meter:
    """Runs the iterations: ``warmup`` untimed, ``timed`` each between device syncs (their median
    is the iteration time), then ``profiled`` under torch.profiler (counted, not timed), then one
    under cProfile (host time by package, megatron_moe/gpucheck/host_time.py; not timed)."""

    HOST_PROFILED = 1

    def __init__(self, gpu, warmup, timed, profiled):
        self.gpu, self.warmup, self.timed, self.profiled = gpu, warmup, timed, profiled
        self.total = warmup + timed + profiled + self.HOST_PROFILED
        self.times, self.losses, self.counts, self.prof = [], [], {}, None
        self.host = None

    def _sync(self):
        if self.gpu:
            import torch

            torch.cuda.synchronize()

    def step(self, fn):
        """One iteration: ``fn()`` trains it and returns its loss (a float)."""
        from torch.profiler import ProfilerActivity, profile

        i = len(self.losses)
        if i == self.warmup + self.timed:
            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.gpu else [])
            self.prof = profile(activities=acts)
            self._sync()
            self.prof.start()
        self._sync()
        host = HostProfile() if i == self.total - self.HOST_PROFILED else contextlib.nullcontext()
        t0 = time.perf_counter()
        with host:
            loss = fn()
        self._sync()
        if isinstance(host, HostProfile):
            self.host = host.breakdown()
            print(format_breakdown(self.host), file=sys.stderr, flush=True)
        if self.warmup <= i < self.warmup + self.timed:
            self.times.append(time.perf_counter() - t0)
        self.losses.append(float(loss) if loss is not None else float("nan"))
        if i == self.total - 1 - self.HOST_PROFILED and self.prof is not None:
            self.prof.stop()
            self.counts = count_events(self.prof, self.profiled, self.gpu)
            if self.gpu:   # where the device time goes, into the section's log (stderr)
                ka = self.prof.key_averages()
                # device busy per iteration (kernels' self time summed), against the timed
                # iteration: how far the host keeps the device fed
                self.counts["device_s_per_iter"] = device_seconds(ka) / self.profiled
                print(f"device busy {self.counts['device_s_per_iter'] * 1e3:.1f} ms per "
                      f"iteration", file=sys.stderr, flush=True)
                print(ka.table(sort_by="self_device_time_total", row_limit=25,
                               max_name_column_width=70),
                      file=sys.stderr, flush=True)
        return loss

    def figures(self):
        host = {} if self.host is None else dict(host_s_per_iter=self.host["total_s"],
                                                 host_calls_per_iter=self.host["calls"],
                                                 host_by_package_s=self.host["by_package_s"],
                                                 host_top=self.host["top"])
        return dict(iter_s=statistics.median(self.times) if self.times else None,
                    iter_s_all=self.times, losses=self.losses, **self.counts, **host)


def device_seconds(key_averages):
    """Seconds the device ran kernels and copies: the device-side events only (an aten op's row
    also carries its kernels' time, so summing every row counts them twice), as the profiler's
    own "Self CUDA time total"."""
    from torch.autograd import DeviceType

    return sum(e.self_device_time_total for e in key_averages
               if e.device_type == DeviceType.CUDA) / 1e6


def count_events(prof, iters, gpu):
    """Per-iteration counts from a profile of ``iters`` iterations. Aten ops and host reads leave
    out those nested in ``aten::_grouped_mm``: on the CPU torch runs it as one ``mm`` per group
    after reading each offset on the host (``item``), which a CUDA grouped GEMM does not, so the
    CPU counts would charge grouped experts the loop they replace."""
    ops = reads = 0
    by = {}
    for e in prof.events():
        by[e.name] = by.get(e.name, 0) + 1
        if not e.name.startswith("aten::"):
            continue
        parent = e.cpu_parent
        while parent is not None and parent.name not in GROUPED_OPS:
            parent = parent.cpu_parent
        if parent is None:
            ops += 1
            reads += e.name in HOST_READ_OPS
    per = lambda n: n / iters  # noqa: E731
    out = dict(aten_ops_per_iter=per(ops), host_reads_per_iter=per(reads))
    if gpu:
        out.update(launches_per_iter=per(sum(by.get(k, 0) for k in LAUNCH_EVENTS)),
                   graph_launches_per_iter=per(sum(by.get(k, 0) for k in GRAPH_LAUNCH_EVENTS)),
                   syncs_per_iter=per(sum(by.get(k, 0) for k in SYNC_EVENTS)))
    return out


def memory_figures(gpu):
    if gpu:
        import torch

        return dict(peak_allocated=torch.cuda.max_memory_allocated())
    # no device allocator on the CPU: the process's peak resident set (interpreter and libraries
    # included), labelled as such in the report
    return dict(max_rss=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)


# --- the systems --------------------------------------------------------------------------------
def _init_dist(gpu):
    import torch
    import torch.distributed as dist

    from megatron_moe.runtime.local_ranks import free_port

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0",
                      WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    if gpu:
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if gpu else "gloo", rank=0, world_size=1)


def row_megatron(s, gpu, meter, stock, eager=False, per_expert=False, graphed=False):
    """``pretrain()`` of pretrain_gpt_moe.py on the synthetic batch, each iteration through the
    meter (its ``Trainer.train_step`` wrapped)."""
    import torch
    from megatron.core.enums import ModelType

    import pretrain_gpt_moe
    from megatron_moe.gpucheck import checks
    from megatron_moe.training import loop as T

    argv = megatron_argv(s, gpu, meter.total)
    options, refused = ([], []) if stock else speed_options(argv)
    if eager:
        options = [o for o in options if o != "--cross-entropy-loss-fusion"] + list(EAGER_OPTIONS)
    if per_expert:
        options = [o for o in options if o != SINGLE_WEIGHT_OPTION]
    if graphed:
        options = options + list(GRAPH_OPTIONS)
    # stock names megatron-core's local attention: auto is this package's SDPA on CUDA
    stock_attention = ["--attention-backend", "local"] if stock else []
    batch = synthetic_batch(s)

    class Fixed(torch.utils.data.Dataset):  # the synthetic batch, sample after sample
        def __len__(self):
            return 1 << 30

        def __getitem__(self, i):
            t = batch[i % batch.shape[0]]
            return dict(tokens=t[:-1].clone(), labels=t[1:].clone(),
                        loss_mask=torch.ones(s["seq"]), position_ids=torch.arange(s["seq"]))

    def datasets(num_samples):
        return Fixed(), None, None
    datasets.is_distributed = True
    # production mode: the strict device checks are test machinery (on a CPU build a torch
    # function mode over every call) that the other systems' rows do not pay
    checks.init_process("gpu" if gpu else "cpu", strict_devices=False)
    orig = T.Trainer.train_step
    params = {}

    def train_step(self, data_iterator):
        if not params:
            params["n"] = sum(p.numel() for chunk in self.model for p in chunk.parameters())
        out = []

        def one():
            out.append(orig(self, data_iterator))
            return out[0][0].get("lm loss")
        meter.step(one)
        return out[0]
    T.Trainer.train_step = train_step
    from megatron_moe.compat import multi_tensor
    from megatron_moe.compat import optimizer as optimizer_compat
    from megatron_moe.moe import layer as moe_layer

    # stock keeps megatron-core's no-apex optimizer fallbacks as they come: the gradient norm,
    # scale and copy loops (compat/multi_tensor.py) and torch Adam's foreach path
    # (fuse_torch_adam); and its dispatcher's own functions (no exchange bound in the MoE layer's
    # stages: megatron-core's chunk sort, which copies even an identity order)
    replaced = ((multi_tensor, "install", lambda: []),
                (optimizer_compat, "fuse_torch_adam", lambda optimizer: 0),
                (moe_layer, "dispatcher_bindings", lambda exchange, dropless_topk=0: {}))
    originals = [(module, name, getattr(module, name)) for module, name, _ in replaced]
    if stock:
        for module, name, stand_in in replaced:
            setattr(module, name, stand_in)
    try:
        with contextlib.redirect_stdout(sys.stderr):  # the training log goes to the section log
            T.pretrain(datasets, pretrain_gpt_moe.model_provider, ModelType.encoder_or_decoder,
                       pretrain_gpt_moe.forward_step, argv=argv + stock_attention + options)
    finally:
        T.Trainer.train_step = orig
        for module, name, original in originals:
            setattr(module, name, original)
    how = ("megatron-core local path as it comes: SequentialMLP expert loop, unfused local "
           "attention, its chunk sort, no-apex gradient norm and torch Adam's foreach path" if stock
           else "speed options: " + (" ".join(options) or "none")
           + ("; refused by the parser: " + ", ".join(refused) if refused else ""))
    return dict(params=params.get("n"), how=how, options=options, refused_options=refused)


def _titan_cpu_device():
    """torchtitan picks its device type at import ("cuda" when it sees no accelerator): on a CPU
    run point it at the CPU before any of its modules binds the name."""
    import torch

    import torchtitan.tools.utils as tu

    if not torch.cuda.is_available():
        tu.device_type, tu.device_module = "cpu", torch.cpu


def row_torchtitan(s, gpu, meter, eager=False):
    """torchtitan's Qwen3 MoE model and training step (torchtitan/trainer.py ``train_step`` and
    ``_forward_backward_body`` at world size 1 without pipeline parallelism, its defaults: the
    forward and backward captured in one CUDA graph on CUDA, gradients zeroed in place), our
    batch. ``eager``: its ``training.disable_cuda_graphs`` (the runner's retry, ``run_section``)."""
    import torch

    if importlib.util.find_spec("torchtitan") is None:
        raise RowSkipped(f"torchtitan is not installed here: scripts/gpu_wheels.sh carries "
                         f"torchtitan=={TORCHTITAN} and its imported dependencies to the GPU "
                         f"machine; for the CPU mode install them (docs/gpu.md)")
    from megatron_moe.compat.torchtitan import bridge_fsdp_mesh_dims

    bridged = bridge_fsdp_mesh_dims()   # before any torchtitan module: torch 2.11 (see there)
    _init_dist(gpu)
    _titan_cpu_device()
    import spmd_types as spmd
    from torchtitan.components.loss import CrossEntropyLoss
    from torchtitan.components.optimizer import OptimizersContainer, ParamGroupConfig
    from torchtitan.components.optimizer.lr_scheduler import LRSchedulersContainer
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.distributed.cudagraph import cudagraph_teardown, wrap_with_cuda_graph
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.qwen3 import (_EMBEDDING_INIT, _LINEAR_INIT, _build_qwen3_moe_layers,
                                         _qwen3_norm, parallelize_qwen3)
    from torchtitan.models.qwen3.model import Qwen3Model

    torch.autograd.set_multithreading_enabled(False)   # as its init_distributed does
    layers = _build_qwen3_moe_layers(
        n_layers=s["layers"], dim=s["hidden"], n_heads=s["heads"], n_kv_heads=s["groups"],
        head_dim=s["head_dim"], moe_hidden_dim=s["ffn"], num_experts=s["experts"],
        top_k=s["topk"], attn_backend="flex", moe_comm_backend="standard",
        rope=CosSinRoPE.Config(dim=s["head_dim"], max_seq_len=s["seq"], theta=1e6))
    for layer in layers:
        # causal SDPA (its flash/cuDNN kernels on CUDA): one document per sequence needs no
        # document mask, and flex attention would spend the row's time in torch.compile
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
        layer.moe.load_balance_coeff = None   # no balancing in any system (its bias update hook)
        if not s["qk_norm"]:
            layer.attention.qk_norm = None    # Mixtral-like: no q/k norms
    config = Qwen3Model.Config(
        vocab_size=s["vocab"], dim=s["hidden"], norm=_qwen3_norm(s["hidden"]),
        tok_embeddings=Embedding.Config(num_embeddings=s["vocab"], embedding_dim=s["hidden"],
                                        param_init=_EMBEDDING_INIT),
        lm_head=Linear.Config(in_features=s["hidden"], out_features=s["vocab"],
                              param_init=_LINEAR_INIT),
        layers=layers)
    dims = ParallelDims(dp_replicate=1, dp_shard=-1, cp=1, tp=1, pp=1, ep=1, world_size=1)
    parallelism = ParallelismConfig()
    # its defaults: bf16 params / fp32 reduce, CUDA graphs on
    training = TrainingConfig(disable_cuda_graphs=eager)
    dist_utils.set_spmd_backend(parallelism.spmd_backend)
    with torch.device("meta"):
        model = config.build()
    # its FSDP2 wrapping: bf16 compute copies of fp32 parameters (training.mixed_precision_param)
    model = parallelize_qwen3(model, parallel_dims=dims, training=training,
                              parallelism=parallelism, compile_config=CompileConfig(),
                              ac_config=None, dump_folder=os.environ.get("TMPDIR", "/tmp"))
    device = torch.device("cuda" if gpu else "cpu")
    model.to_empty(device=device)
    torch.manual_seed(1234)   # the seed of the other rows (its Trainer leaves it unset)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.train()
    optimizers = OptimizersContainer.Config(param_groups=[ParamGroupConfig(
        pattern=".*", optimizer_name="AdamW", optimizer_kwargs=dict(
            lr=LR, betas=BETAS, eps=1e-8, weight_decay=WEIGHT_DECAY))]).build(model_parts=[model])
    # the Megatron rows' schedule: one warm-up step, cosine decay to MIN_LR over the run
    schedulers = LRSchedulersContainer.Config(
        warmup_steps=1, decay_type="cosine", min_lr_factor=MIN_LR / LR).build(
        optimizers=optimizers, training_steps=meter.total)
    loss_fn = CrossEntropyLoss.Config().build(compile_config=CompileConfig())
    context = dist_utils.get_spmd_context(parallel_dims=dims)
    batch = synthetic_batch(s)
    inputs, labels = batch[:, :-1].to(device), batch[:, 1:].to(device)
    # its train_step divides each micro-batch's loss sum by the tokens of the whole step
    valid = torch.tensor(labels.numel() * s["microbatches"], device=device)
    params = list(model.parameters())

    def forward_backward(inputs, labels, global_valid_tokens, extra_kwargs):
        with context():
            pred = model(inputs, **extra_kwargs)
            loss, _ = loss_fn(pred, labels, global_valid_tokens)
            del pred
            with spmd.no_typecheck():
                loss.backward()
        return loss
    # its Trainer: on CUDA the first call runs eagerly on a side stream, the second captures the
    # graph, later calls replay it (on the CPU it warns and stays eager)
    graphed = not training.disable_cuda_graphs and gpu
    fwd_bwd = wrap_with_cuda_graph(forward_backward) if graphed else forward_backward

    def one():
        # gradients must keep their addresses for a captured graph: zeroed, not freed
        optimizers.zero_grad(set_to_none=training.disable_cuda_graphs)
        # its gradient accumulation: one forward and backward (a graph replay) per micro-batch
        losses = [fwd_bwd(inputs, labels, valid, {}).detach()
                  for _ in range(s["microbatches"])]
        dist_utils.clip_grad_norm_(params, CLIP, foreach=True)
        optimizers.step()
        schedulers.step()
        # its train_step reads the step's loss (the micro-batches' sum) for logging as well
        return torch.stack(losses).sum().item()
    for _ in range(meter.total):
        meter.step(one)
    if graphed:   # its graphs go before the process group does (a failed run just exits)
        cudagraph_teardown()
    how = (f"torchtitan {importlib.metadata.version('torchtitan')} Qwen3 MoE, FSDP2 bf16 params "
           "/ fp32 reduce at world size 1, SDPA, grouped_mm experts, fused AdamW, forward and "
           + ("backward in one CUDA graph (its default)" if graphed else "backward eager")
           + f"; torch {torch.__version__}"
           + (" without DataParallelMeshDims (bridged: megatron_moe/compat/torchtitan.py)"
              if bridged else ""))
    return dict(params=sum(p.numel() for p in params), how=how, cuda_graph=graphed,
                bridged_fsdp_mesh_dims=bridged)


def row_transformers(s, gpu, meter):
    """``MixtralForCausalLM`` / ``Qwen3MoeForCausalLM`` from a config: fp32 weights, bf16
    autocast, its own loss (``labels=``), AdamW, grad clipping."""
    import torch
    import transformers

    common = dict(vocab_size=s["vocab"], hidden_size=s["hidden"], num_hidden_layers=s["layers"],
                  num_attention_heads=s["heads"], num_key_value_heads=s["groups"],
                  head_dim=s["head_dim"], max_position_embeddings=s["seq"], rms_norm_eps=1e-6,
                  tie_word_embeddings=False, output_router_logits=False, attention_dropout=0.0,
                  num_experts_per_tok=s["topk"], use_cache=False, rope_theta=1e6,
                  # transformers 5 reads rope_parameters; older releases rope_theta
                  rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    if s["qk_norm"]:
        cfg = transformers.Qwen3MoeConfig(num_experts=s["experts"], moe_intermediate_size=s["ffn"],
                                          intermediate_size=s["ffn"], norm_topk_prob=True,
                                          decoder_sparse_step=1, mlp_only_layers=[], **common)
        cls = transformers.Qwen3MoeForCausalLM
    else:
        cfg = transformers.MixtralConfig(num_local_experts=s["experts"],
                                         intermediate_size=s["ffn"], router_jitter_noise=0.0,
                                         **common)
        cls = transformers.MixtralForCausalLM
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(1234)
    device = torch.device("cuda" if gpu else "cpu")
    model = cls(cfg).to(device)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, weight_decay=WEIGHT_DECAY,
                            fused=gpu)
    ids = synthetic_batch(s)[:, :-1].to(device)
    params = list(model.parameters())

    def one():
        opt.zero_grad(set_to_none=True)
        losses = []
        for _ in range(s["microbatches"]):   # gradient accumulation: the step's mean loss
            with torch.autocast(device.type, dtype=torch.bfloat16):
                loss = model(input_ids=ids, labels=ids).loss / s["microbatches"]
            loss.backward()
            losses.append(loss.detach())
        torch.nn.utils.clip_grad_norm_(params, CLIP)
        opt.step()
        return torch.stack(losses).sum().item()
    for _ in range(meter.total):
        meter.step(one)
    return dict(params=sum(p.numel() for p in params),
                how=f"transformers {transformers.__version__} {cls.__name__}, "
                    f"{cfg._attn_implementation} attention, experts "
                    f"{getattr(cfg, '_experts_implementation', None) or 'default'}, fp32 weights "
                    "under bf16 autocast, AdamW")


def run_row(system, shape, mode, eager=False):
    """One row in this process: the figures of ``system`` training ``shape`` (``eager``: see
    ``row_torchtitan``)."""
    gpu = mode == "gpu"
    s = SHAPES[shape][mode]
    n = ITERS[mode]
    meter = Meter(gpu, n["warmup"], n["timed"], n["profiled"])
    if system in ("ours", "stock"):
        out = row_megatron(s, gpu, meter, stock=system == "stock")
    elif system in CUDA_ONLY_ROWS:
        if not gpu:
            raise RowSkipped(CUDA_ONLY_ROWS[system])
        out = row_megatron(s, gpu, meter, stock=False, eager=system == "ours-eager",
                           per_expert=system == "ours-per-expert",
                           graphed=system == "ours-graphed")
    elif system == "torchtitan":
        out = row_torchtitan(s, gpu, meter, eager=eager)
    elif system == "transformers":
        out = row_transformers(s, gpu, meter)
    else:
        raise ValueError(f"unknown system {system!r}; choose from {SYSTEMS}")
    out.update(meter.figures())
    out.update(memory_figures(gpu))
    return out


# --- the runner ---------------------------------------------------------------------------------
def _row_process(system, shape, cpu, result, log, limit_s, eager=False):
    module = "megatron_moe.gpucheck.perf"
    args = ["row", system, shape, "--result", result] + (["--cpu"] if cpu else []) + \
        (["--eager"] if eager else [])
    log.write(f"\n===== perf row {shape}/{system} (limit {limit_s:.0f}s): "
              f"{' '.join(module_command(module, args))}\n")
    log.flush()
    why, took = run_module(module, main, args, log, limit_s, ROOT, cpu)
    log.write(f"===== perf row {shape}/{system}: {why} in {took:.1f}s\n")
    log.flush()
    data = None
    if os.path.exists(result):
        with open(result) as f:
            data = json.load(f)
    if data is None:
        data = dict(error=f"no result: {why}")
    data.update(wall_s=took, ended=why)
    return data


def verdict(shape, mode, rows, peak_tflops):
    """The shape's check from its rows: (ok, summary, figures, skipped). ok: every row trained
    the shape's model (its parameter count) to finite losses; speed is reported, not judged."""
    gpu = mode == "gpu"
    s = SHAPES[shape][mode]
    from megatron_moe.flops import num_floating_point_operations

    # one iteration is one optimizer step: every micro-batch's tokens and FLOPs
    flops = num_floating_point_operations(flops_args(s), s["batch"] * s["microbatches"])
    tokens = s["batch"] * s["microbatches"] * s["seq"]
    want = expected_params(s)
    ok, parts, problems = True, [], []
    skipped_rows = []
    for name, r in rows.items():
        if r.get("skipped"):   # a failure on the GPU, where the kit carries every system
            ok &= not gpu
            (problems if gpu else skipped_rows).append(f"{name}: {r['skipped']}")
            continue
        if r.get("error"):
            ok = False
            problems.append(f"{name}: {r['error']}")
            continue
        it = r.get("iter_s")
        r["tokens_per_s"] = tokens / it if it else None
        r["model_tflops"] = flops / it / 1e12 if it else None
        r["mfu"] = r["model_tflops"] / peak_tflops if it and peak_tflops else None
        r["same_model"] = r.get("params") == want
        finite = bool(r.get("losses")) and all(math.isfinite(x) for x in r["losses"])
        if not r["same_model"]:
            ok = False
            problems.append(f"{name}: {r.get('params')} parameters, the shape has {want}")
        if not finite:
            ok = False
            problems.append(f"{name}: non-finite loss {r.get('losses')}")
    # the graphed row replays what ours runs eagerly on the same batch and seed: its losses must
    # agree (bf16 tolerance), the proof that the replays trained
    graphed, eager = rows.get("ours-graphed") or {}, rows.get("ours") or {}
    if graphed.get("losses") and eager.get("losses"):
        diffs = [abs(a - b) / max(abs(b), 1e-12)
                 for a, b in zip(graphed["losses"], eager["losses"])]
        graphed["max_rel_loss_diff_vs_ours"] = diff = max(diffs)
        before, first = diffs[:GRAPH_WARMUP], diffs[GRAPH_WARMUP:GRAPH_WARMUP + 1]
        if any(before) or not all(d <= GRAPH_FIRST_REPLAY_RTOL for d in first) \
                or not diff <= GRAPH_LOSS_RTOL:
            ok = False
            problems.append(
                "ours-graphed: losses differ from ours' by " + ", ".join(f"{d:.2e}" for d in diffs)
                + f" relative (allowed: 0 in the {GRAPH_WARMUP} eager iterations, "
                f"{GRAPH_FIRST_REPLAY_RTOL} at the first replay, {GRAPH_LOSS_RTOL} after)")
    ratios = {}
    ours = (rows.get("ours") or {}).get("tokens_per_s")
    for peer in ("torchtitan", "stock", "transformers", "ours-graphed", "ours-eager",
                 "ours-per-expert"):
        theirs = (rows.get(peer) or {}).get("tokens_per_s")
        ratios[f"ours/{peer}"] = ours / theirs if ours and theirs else None
    for name, r in rows.items():
        if r.get("error") or r.get("skipped"):
            parts.append(f"{name} {'FAILED' if r.get('error') else 'skipped'}")
            continue
        mfu = f", MFU {100 * r['mfu']:.1f}%" if r.get("mfu") is not None else ""
        mem = (f", peak {r['peak_allocated'] / 2**30:.1f} GiB" if r.get("peak_allocated")
               else "")
        ev = (f", {r['launches_per_iter']:.0f} launches, {r['syncs_per_iter']:.0f} syncs/it"
              if gpu and r.get("launches_per_iter") is not None else
              f", {r.get('aten_ops_per_iter', 0):.0f} aten ops, "
              f"{r.get('host_reads_per_iter', 0):.0f} host reads/it")
        fell_back = " (eager: its CUDA graph run failed)" if r.get("cuda_graph_error") else ""
        parts.append(f"{name}{fell_back} {r['tokens_per_s']:.0f} tok/s{mfu}{mem}{ev}")
    rs = ", ".join(f"{k} x{v:.2f}" for k, v in ratios.items() if v is not None)
    summary = (f"{s['experts']} experts top-{s['topk']}, {_count(want)} params, "
               f"{s['microbatches']}x{s['batch']}x{s['seq']} tokens: " + "; ".join(parts)
               + (f"; {rs}" if rs else ""))
    if problems:
        summary += "; PROBLEMS: " + "; ".join(problems)
    targets = {}
    if gpu:
        mfu = (rows.get("ours") or {}).get("mfu")
        targets = dict(mfu=dict(target=TARGETS[shape]["mfu"], got=mfu,
                                met=None if mfu is None else mfu >= TARGETS[shape]["mfu"]),
                       vs_torchtitan=dict(target=TARGETS["vs_torchtitan"],
                                          got=ratios["ours/torchtitan"],
                                          met=None if ratios["ours/torchtitan"] is None else
                                          ratios["ours/torchtitan"] >= TARGETS["vs_torchtitan"]),
                       vs_stock=dict(target=TARGETS["vs_stock"], got=ratios["ours/stock"],
                                     met=None if ratios["ours/stock"] is None else
                                     ratios["ours/stock"] >= TARGETS["vs_stock"]))
    skipped = [] if gpu else [
        "MFU and the speed targets: toy sizes on a CPU say nothing about GPU speed",
        "peak allocated memory (torch.cuda.max_memory_allocated): no CUDA; the process's peak "
        "resident set is reported instead (max_rss, interpreter and libraries included)",
        "kernel launches and cudaStreamSynchronize per iteration: no CUDA; aten op calls and "
        "host reads (ops that block on a GPU: " + ", ".join(HOST_READ_OPS) + ") per iteration "
        "are reported instead"] + [f"row {x}" for x in skipped_rows]
    figures = dict(shape=s, expected_params=want, flops_per_iter=flops, tokens_per_iter=tokens,
                   bf16_peak_tflops=peak_tflops, rows=rows, ratios=ratios, targets=targets)
    return ok, summary, figures, skipped


def run_section(cpu, work, log, budget_s, shapes=None, systems=None):
    """Every row of every shape, each in its own process; returns ``{"checks": [...]}`` as the
    kit's sections do (one check per shape: ``perf-<shape>``)."""
    mode = "cpu" if cpu else "gpu"
    shapes = list(shapes or SHAPES)
    systems = list(systems or SYSTEMS)
    t0 = time.monotonic()
    peak = None
    if not cpu:
        from megatron_moe.gpucheck.checks import bf16_peak_tflops

        try:
            name = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                                  capture_output=True, text=True, timeout=30).stdout.strip()
            peak = bf16_peak_tflops(name.splitlines()[0]) if name else None
        except (OSError, subprocess.SubprocessError, IndexError):
            peak = None
    checks = []
    todo = [(sh, sy) for sh in shapes for sy in systems]
    rows = {sh: {} for sh in shapes}
    for i, (shape, system) in enumerate(todo):
        left = budget_s - (time.monotonic() - t0)
        reserve = 5.0 * (len(todo) - i - 1)
        if left - reserve < 5:
            rows[shape][system] = dict(error=f"not run: the section's {budget_s:.0f} s budget "
                                             "was spent")
            continue
        if cpu and system in CUDA_ONLY_ROWS:   # no process: see CUDA_ONLY_ROWS
            rows[shape][system] = dict(skipped=CUDA_ONLY_ROWS[system])
            continue
        limit = min(ROW_CAP_S[system][1 if cpu else 0], left - reserve)
        result = os.path.join(work, f"perf_{shape}_{system}.json")
        row = _row_process(system, shape, cpu, result, log, limit)
        left = budget_s - (time.monotonic() - t0)
        if system == "torchtitan" and not cpu and row.get("error") and left - reserve >= limit:
            # its default CUDA graph of the forward and backward failed (or something else did):
            # once more without it, reported as such, rather than no torchtitan figure at all
            retry = _row_process(system, shape, cpu, result.replace(".json", "_eager.json"),
                                 log, limit, eager=True)
            if not retry.get("error"):
                retry["cuda_graph_error"] = row["error"]
                retry["how"] = (f"{retry.get('how', '')}; ran eager because its default CUDA "
                                f"graph run failed: {row['error']}")
                row = retry
            else:
                row["error"] += f" | eager retry: {retry['error']}"
        rows[shape][system] = row
    for shape in shapes:
        ok, summary, figures, skipped = verdict(shape, mode, rows[shape], peak)
        checks.append(dict(name=f"perf-{shape}", status="PASS" if ok else "FAIL",
                           summary=summary, figures=figures, skipped=skipped))
    return {"checks": checks, "info": {}}


def write_reports(outdir, checks, mode):
    """OUTDIR/perf_report.json and OUTDIR/perf_report.md: one table per shape."""
    with open(os.path.join(outdir, "perf_report.json"), "w") as f:
        json.dump(dict(mode=mode, checks=checks), f, indent=1, default=str)
    gpu = mode == "gpu"
    lines = [f"# MoE training side by side ({mode} mode)", ""]
    if not gpu:
        lines += ["Toy sizes on a CPU: these figures prove the section runs; they say nothing "
                  "about GPU speed.", ""]
    for c in checks:
        fig = c["figures"]
        s = fig.get("shape", {})
        lines += [f"## {c['name']}: {c['status']}", "",
                  f"{s.get('layers')} layers, hidden {s.get('hidden')}, {s.get('experts')} experts "
                  f"of {s.get('ffn')} top-{s.get('topk')}, {s.get('heads')} heads "
                  f"({s.get('groups')} groups of {s.get('head_dim')}), vocabulary {s.get('vocab')},"
                  f" micro-batch {s.get('batch')} x sequence {s.get('seq')}, "
                  f"{s.get('microbatches', 1)} micro-batches per optimizer step (an iteration); "
                  f"{_count(fig.get('expected_params', 0))} parameters; "
                  f"{fig.get('flops_per_iter', 0) / 1e9:.4g} model GFLOP per iteration "
                  "(megatron_moe/flops.py)", ""]
        if gpu:
            head = ("| system | tokens/s | MFU | peak allocated GiB | launches/it | syncs/it | "
                    "host reads/it | params equal | how |")
        else:
            head = ("| system | tokens/s | max RSS MiB | aten ops/it | host reads/it | "
                    "params equal | how |")
        lines += [head, "|" + "---|" * (head.count("|") - 1)]
        for name, r in fig.get("rows", {}).items():
            if r.get("error") or r.get("skipped"):
                why = "FAILED: " + str(r["error"]) if r.get("error") else "skipped: " + \
                    str(r["skipped"])
                lines.append(f"| {name} | {why.replace('|', '/')[:300]} |")
                continue
            tok = f"{r['tokens_per_s']:.0f}" if r.get("tokens_per_s") else "-"
            how = str(r.get("how", "")).replace("|", "/")
            if gpu:
                mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") is not None else "-"
                mem = (f"{r['peak_allocated'] / 2**30:.2f}" if r.get("peak_allocated")
                       else "-")
                graphs = (f" ({r['graph_launches_per_iter']:.0f} CUDA graph)"
                          if r.get("graph_launches_per_iter") else "")
                lines.append(f"| {name} | {tok} | {mfu} | {mem} | "
                             f"{r.get('launches_per_iter', 0):.0f}{graphs} | "
                             f"{r.get('syncs_per_iter', 0):.0f} | "
                             f"{r.get('host_reads_per_iter', 0):.0f} | {r.get('same_model')} | "
                             f"{how} |")
            else:
                rss = f"{r['max_rss'] / 2**20:.0f}" if r.get("max_rss") else "-"
                lines.append(f"| {name} | {tok} | {rss} | {r.get('aten_ops_per_iter', 0):.0f} |"
                             f" {r.get('host_reads_per_iter', 0):.0f} | {r.get('same_model')} |"
                             f" {how} |")
        host = [(name, r) for name, r in fig.get("rows", {}).items() if r.get("host_by_package_s")]
        if host:
            lines += ["", "Host time per iteration, ms, by package (one iteration under cProfile, "
                      "C time charged to its Python caller; megatron_moe/gpucheck/host_time.py):",
                      ""]
            for name, r in host:
                parts = ", ".join(f"{k} {v * 1e3:.1f}" for k, v in r["host_by_package_s"].items())
                calls = r.get("host_calls_per_iter")
                lines.append(f"* {name}: {r['host_s_per_iter'] * 1e3:.1f} ({parts})"
                             + (f"; {calls:.0f} Python calls" if calls else ""))
        rs = fig.get("ratios", {})
        lines += ["", "Ratios of tokens/s: " + ", ".join(
            f"{k} {'x%.2f' % v if v is not None else '-'}" for k, v in rs.items()), ""]
        for k, t in fig.get("targets", {}).items():
            got = "-" if t["got"] is None else f"{t['got']:.3g}"
            lines.append(f"* target {k} >= {t['target']}: got {got}, "
                         f"{'met' if t['met'] else 'NOT met' if t['met'] is False else 'unknown'}")
        if c.get("skipped"):
            lines += ["", "Skipped here: " + "; ".join(c["skipped"])]
        lines.append("")
    with open(os.path.join(outdir, "perf_report.md"), "w") as f:
        f.write("\n".join(lines))


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m megatron_moe.gpucheck.perf")
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("row", help="one system on one shape, in this process")
    r.add_argument("system", choices=SYSTEMS)
    r.add_argument("shape", choices=list(SHAPES))
    r.add_argument("--result", required=True)
    r.add_argument("--cpu", action="store_true")
    r.add_argument("--eager", action="store_true",
                   help="torchtitan: its training.disable_cuda_graphs (forward and backward eager)")
    a = p.parse_args(argv)
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    try:
        out = run_row(a.system, a.shape, "cpu" if a.cpu else "gpu", eager=a.eager)
    except RowSkipped as exc:
        out = dict(skipped=str(exc))
    except BaseException:  # a crash is this row's result; the runner goes on with the others
        tb = traceback.format_exc()
        print(tb, file=sys.stderr, flush=True)
        lines = [l.strip() for l in tb.strip().splitlines() if l.strip()]
        out = dict(error=" | ".join(lines[-3:])[:600])
    with open(a.result, "w") as f:
        json.dump(out, f, default=str)
    with contextlib.suppress(Exception):
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
