"""Host (Python) work our own code adds to a training iteration: ours vs the code paths before the
host-call fixes, in one run, with ratios.

    python bench/host_calls.py [--experts 4,16,64] [--iters 20]

The model is tests/test_host_calls.py's (1 rank, bf16, grouped experts, 2 layers, 2 micro-batches,
torch's fused Adam pre-hook forced on as on CUDA), trained by the real pretrain() loop. "before" is
the same run with tests/_host_calls_cases.py's mutations, which put back what the code did before:
a ``nn.Module.__getattr__`` call per expert for each weight and hook read and a Python call per
expert weight to test its DDP ``main_grad`` (per layer per micro-batch), and the fused Adam
pre-hook's walk over every parameter before every step.

Per expert count and variant: the Python calls made in or from megatron_moe/ in iteration 3
(exact: what the fixes remove, and what a GPU run keeps of them, since these calls launch nothing)
and the median wall ms of the later iterations. On a CPU build every op also runs on the host, so
the wall time includes the model's arithmetic; on the H200 (docs/gpu.md) the device was busy 16%
of the wall clock, i.e. the step was host time. Variants run alternately, ``--repeats`` times, so
load from other jobs hits both alike; comm/strict.py's per-op device checks (test machinery) off.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

BEFORE = ("experts_by_getattr", "main_grad_test_per_weight", "adam_walk_every_step")


def _argv(experts, iters):
    return ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
            "--micro-batch-size 2 --global-batch-size 4 --lr 1e-3 --mock-data "
            "--tokenizer-type NullTokenizer --vocab-size 128 --swiglu --disable-bias-linear "
            f"--num-experts {experts} --moe-ffn-hidden-size 16 --moe-router-topk 2 "
            "--moe-token-dispatcher-type alltoall --moe-grouped-gemm --bf16 "
            f"--log-interval 1000 --eval-interval 100000 --eval-iters 1 --train-iters {iters}").split()


def main(argv=None):
    from megatron_moe.runtime.local_ranks import run_distributed
    from tests import _host_calls_cases as C

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--experts", default="4,16,64")
    p.add_argument("--iters", type=int, default=20, help="training iterations per run")
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args(argv)
    print(f"{'experts':>7} {'calls/it ours':>13} {'before':>7} {'ratio':>6} "
          f"{'ms/it ours':>10} {'before':>7} {'ratio':>6}")
    for experts in map(int, args.experts.split(",")):
        runs = {"ours": [], "before": []}
        for repeat in range(args.repeats):
            order = ("ours", "before") if repeat % 2 == 0 else ("before", "ours")
            for name in order:
                runs[name].append(run_distributed(
                    C.count, 1, _argv(experts, args.iters), 3,
                    None if name == "ours" else BEFORE, timeout_s=900,
                    env={"MEGATRON_MOE_STRICT_DEVICES": "0"})[0])
        calls = {n: sum(r[0]["calls"].values()) for n, r in runs.items()}
        ms = {n: 1000 * statistics.median(s for r in rs for s in r["seconds"])
              for n, rs in runs.items()}
        print(f"{experts:7d} {calls['ours']:13d} {calls['before']:7d} "
              f"{calls['before'] / calls['ours']:6.2f} {ms['ours']:10.2f} {ms['before']:7.2f} "
              f"{ms['before'] / ms['ours']:6.2f}", flush=True)


if __name__ == "__main__":
    main()
