"""Where the time of one training iteration goes on the GPU: the training-bf16 model of the GPU
check (megatron_moe/gpucheck/checks.py, BIG) under torch.profiler for a few iterations after a
warm-up. Writes OUTDIR/gpu_profile.txt: wall vs summed CUDA kernel time (host-bound or not), the
ops by self CPU time and by device time, and the host->device syncs seen (cudaStreamSynchronize,
cudaMemcpy). Run after scripts/gpu_check.sh installed the wheels, or with them on PYTHONPATH:

    python3 scripts/gpu_profile.py OUTDIR [--iters 4] [--warmup 2] [--layers 16]
"""
import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("outdir")
    p.add_argument("--iters", type=int, default=4)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--extra", default="--moe-permute-fusion", help="more training flags")
    p.add_argument("--cpu", action="store_true", help="smoke test: the CPU model sizes, no CUDA")
    a = p.parse_args(argv)
    import torch
    from torch.profiler import ProfilerActivity, profile

    import pretrain_gpt_moe
    from megatron_moe.gpucheck import checks as C

    mode = "cpu" if a.cpu else "gpu"
    C.init_process(mode)
    argv = C._argv(mode, C.BIG, a.iters, "--bf16", *a.extra.split())
    argv[argv.index("--num-layers") + 1] = str(a.layers)
    # micro-batches per iteration at world size 1: forward_step calls per iteration
    flag = lambda name: int(argv[argv.index(name) + 1])  # noqa: E731
    n_mb = flag("--global-batch-size") // flag("--micro-batch-size")
    calls = {"n": 0}
    acts = [ProfilerActivity.CPU] + ([] if a.cpu else [ProfilerActivity.CUDA])
    prof = profile(activities=acts, with_stack=True)
    sync = (lambda: None) if a.cpu else torch.cuda.synchronize
    orig = pretrain_gpt_moe.forward_step
    t = {}

    def forward_step(data_iterator, model):  # megatron-core reads the signature
        if calls["n"] == a.warmup * n_mb:
            sync()
            t["start"] = time.perf_counter()
            prof.start()
        calls["n"] += 1
        return orig(data_iterator, model)
    pretrain_gpt_moe.forward_step = forward_step
    C.train(argv)
    sync()
    wall = time.perf_counter() - t["start"]
    prof.stop()
    ka = prof.key_averages()
    from megatron_moe.gpucheck.perf import device_seconds

    dev = device_seconds(ka)   # device-side events only (aten rows repeat their kernels' time)
    its = a.iters - a.warmup
    lines = [f"profiled {its} iterations of BIG ({a.layers} layers) {a.extra}: wall {wall:.3f} s "
             f"({wall / its * 1e3:.0f} ms/it), summed self device time {dev:.3f} s "
             f"({dev / wall:.0%} of wall)"]
    for name in ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaMemcpyAsync",
                 "cudaLaunchKernel", "cudaEventSynchronize", "aten::item",
                 "aten::_local_scalar_dense"):
        e = next((e for e in ka if e.key == name), None)
        if e is not None:
            lines.append(f"{name}: {e.count} calls, {e.cpu_time_total / 1e3:.1f} ms CPU")
    lines += ["", "== by self CPU time ==",
              ka.table(sort_by="self_cpu_time_total", row_limit=35, max_name_column_width=60),
              "== by self device time ==",
              ka.table(sort_by="self_device_time_total", row_limit=25, max_name_column_width=60),
              "== by self CPU time, grouped by 6 stack frames ==",
              prof.key_averages(group_by_stack_n=6).table(
                  sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60)]
    os.makedirs(a.outdir, exist_ok=True)
    with open(os.path.join(a.outdir, "gpu_profile.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print(lines[0], flush=True)
    print("\n".join(lines[1:8]), flush=True)


if __name__ == "__main__":
    main()
