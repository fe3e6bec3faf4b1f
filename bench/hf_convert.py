#!/usr/bin/env python
"""Peak memory and time of tools/checkpoint/convert.py on a random Mixtral, both directions.

    python bench/hf_convert.py [--layers 8] [--hidden 512] [--experts 8] [--shard-mb 20] [--work-dir DIR]

Every measured step runs in its own process (peak RSS = ru_maxrss of that one child: the
kernel's high-water mark of resident pages, file-backed mappings included):
* ``imports``: a process that only imports what the converter imports (torch, megatron-core,
  our checkpointing, safetensors) and starts its one-rank gloo group: the floor.
* ``setup``: the converter importing a 2-layer, 64-wide model of the same family (<1 MiB of
  weights): imports, argument parsing, the meta-device model, megatron-core's save planning, the
  writer; what a conversion costs before it holds any weights. The floor of the bound.
* ``hf->megatron`` / ``megatron->hf``: the converter.
* peer ``transformers``: ``AutoModelForCausalLM.from_pretrained`` of the same HF directory (what a
  converter built on transformers must at least do: hold the model), for scale.
Printed: the model size, its shard count, the largest shard and the largest layer; per step the
peak RSS, the part above ``imports``, that part in model sizes and in shard sizes, the ratio to
the transformers peer; and the streaming import's bound, setup + largest input shard + one
layer, with whether its peak is within it (exit status 1 if not). The model must have at least
8 shards.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_MEASURE = """
import resource, subprocess, sys, time
t = time.time()
rc = subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
if rc.returncode:
    sys.exit(rc.stderr[-2000:])
print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, time.time() - t)
"""

_IMPORTS = """
from megatron_moe.hf import megatron_side
megatron_side.init_single_process()
import megatron_moe.training.checkpointing, safetensors.torch, tqdm
"""

_PEER = """
import sys, torch
from transformers import AutoModelForCausalLM
AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32)
"""


def measure(cmd):
    """(peak RSS in MB, seconds) of ``cmd`` run as the only child of a fresh process."""
    out = subprocess.run([sys.executable, "-c", _MEASURE] + cmd, capture_output=True, text=True,
                         cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"), timeout=3600)
    if out.returncode:
        raise SystemExit(f"{' '.join(cmd[:6])} ...: {out.stderr}")
    kb, seconds = out.stdout.split()
    return int(kb) / 1024, float(seconds)  # ru_maxrss is in KiB on Linux: MiB


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--shard-mb", type=int, default=20)
    p.add_argument("--work-dir", default=None)
    args = p.parse_args(argv)
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM

    work = args.work_dir or tempfile.mkdtemp(prefix="hf_convert_bench_")
    hf, meg, back = (os.path.join(work, n) for n in ("hf", "meg", "back"))
    torch.manual_seed(0)
    cfg = MixtralConfig(vocab_size=8000, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                        num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=4,
                        num_local_experts=args.experts, num_experts_per_tok=2,
                        max_position_embeddings=256)
    tiny = MixtralForCausalLM(MixtralConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=4, num_local_experts=args.experts,
        num_experts_per_tok=2, max_position_embeddings=256))
    tiny.save_pretrained(os.path.join(work, "tiny"))
    del tiny
    model = MixtralForCausalLM(cfg)
    model_mb = sum(t.numel() * t.element_size() for t in model.state_dict().values()) / 2**20
    layer_mb = max(sum(t.numel() * t.element_size() for k, t in model.state_dict().items()
                       if k.startswith(f"model.layers.{i}.")) for i in range(args.layers)) / 2**20
    model.save_pretrained(hf, max_shard_size=f"{args.shard_mb}MB")
    del model
    shards = [os.path.join(hf, f) for f in os.listdir(hf) if f.endswith(".safetensors")]
    if len(shards) < 8:
        raise SystemExit(f"{len(shards)} shards: use a larger model or a smaller --shard-mb (>= 8)")
    shard_mb = max(os.path.getsize(f) for f in shards) / 2**20
    convert = [sys.executable, "tools/checkpoint/convert.py", "--model-type", "GPT"]
    rows = [("imports", measure([sys.executable, "-c", _IMPORTS])),
            ("setup", measure(convert + ["--loader", "hf", "--saver", "megatron", "--load-dir",
                                         os.path.join(work, "tiny"), "--save-dir",
                                         os.path.join(work, "tiny_meg"),
                                         "--target-expert-parallel-size", "2"])),
            ("transformers (peer)", measure([sys.executable, "-c", _PEER, hf])),
            ("hf->megatron", measure(convert + ["--loader", "hf", "--saver", "megatron",
                                                "--load-dir", hf, "--save-dir", meg,
                                                "--target-expert-parallel-size", "2"])),
            ("megatron->hf", measure(convert + ["--loader", "megatron", "--saver", "hf",
                                                "--load-dir", meg, "--save-dir", back,
                                                "--max-shard-size", f"{args.shard_mb}MB"]))]
    floor = rows[0][1][0]
    setup = rows[1][1][0]
    peer = rows[2][1][0] - floor
    print(f"model {model_mb:.0f} MiB fp32 in {len(shards)} shards (largest {shard_mb:.1f} MiB, "
          f"--shard-mb {args.shard_mb}), largest layer {layer_mb:.1f} MiB, work dir {work}")
    print(f"{'step':22s} {'peak MiB':>8s} {'above imports':>14s} {'x model':>8s} {'x shard':>8s} "
          f"{'vs peer':>8s} {'seconds':>8s}")
    results = {}
    for name, (peak, seconds) in rows:
        above = peak - floor
        print(f"{name:22s} {peak:8.0f} {above:14.0f} {above / model_mb:8.2f} "
              f"{above / shard_mb:8.1f} {above / peer:8.2f} {seconds:8.1f}")
        results[name] = dict(peak_mb=peak, above_imports_mb=above, seconds=seconds)
    bound = setup + shard_mb + layer_mb
    peak = results["hf->megatron"]["peak_mb"]
    within = peak <= bound
    print(f"streaming import: peak {peak:.0f} MiB for a {model_mb:.0f} MiB model, {peak - setup:.0f} "
          f"MiB above setup; bound = setup {setup:.0f} + largest shard {shard_mb:.1f} + one layer "
          f"{layer_mb:.1f} = {bound:.0f} MiB: {'within' if within else 'EXCEEDED'}")
    print(json.dumps(dict(model_mb=model_mb, shards=len(shards), largest_shard_mb=shard_mb,
                          layer_mb=layer_mb, bound_mb=bound, within_bound=within,
                          results=results)))
    if not within:
        raise SystemExit(1)
    return results


if __name__ == "__main__":
    main()
