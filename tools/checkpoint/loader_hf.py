"""Loader: a Hugging Face checkpoint directory (config.json + safetensors shards).

Shards are read one at a time, one tensor at a time (safetensors ``safe_open``); a megatron-core
tensor is emitted as soon as every HF tensor it is made of has been read (q/k/v, gate/up may sit in
different shards) and the HF tensors are dropped. What is held is one tensor plus the parts of
groups still incomplete, never a whole shard, let alone the model.
"""

from __future__ import annotations

import json
import os


def add_arguments(parser):
    group = parser.add_argument_group("Hugging Face loader")
    group.add_argument("--hf-config", default=None,
                       help="config.json to use instead of <load-dir>/config.json")
    group.add_argument("--upcycle-num-experts", type=int, default=None,
                       help="Upcycle a dense Mistral/Llama checkpoint into a Mixtral MoE: every "
                            "expert a copy of the layer's MLP, the router initialised (normal, "
                            "std = initializer_range, --seed)")
    group.add_argument("--upcycle-topk", type=int, default=2)
    group.add_argument("--seed", type=int, default=1234, help="Router initialisation when upcycling")


def _shards(load_dir):
    index = os.path.join(load_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        files = sorted(set(weight_map.values()))
    elif os.path.isfile(os.path.join(load_dir, "model.safetensors")):
        files = ["model.safetensors"]
    else:
        raise SystemExit(f"--load-dir {load_dir}: no model.safetensors.index.json or "
                         f"model.safetensors (only safetensors checkpoints are read)")
    for name in files:
        if not os.path.isfile(os.path.join(load_dir, name)):
            raise SystemExit(f"{index}: shard {name} is missing")
    return files


def load_checkpoint(args):
    """Returns (metadata, iterator of (megatron name, tensor))."""
    from megatron_moe.hf.families import (IGNORED_HF_SUFFIXES, ConversionError,
                                          family_for_config, rules_for, upcycle_config,
                                          upcycle_source)

    config_path = args.hf_config or os.path.join(args.load_dir, "config.json")
    if not os.path.isfile(config_path):
        raise SystemExit(f"--load-dir: {config_path} does not exist")
    with open(config_path) as f:
        cfg = json.load(f)
    source = lambda name: name  # noqa: E731  HF tensor a converted tensor is read from
    try:
        if args.upcycle_num_experts:
            cfg = upcycle_config(cfg, args.upcycle_num_experts, args.upcycle_topk)
            source = upcycle_source
        family = family_for_config(cfg)
        spec = family.spec_from_config(cfg)
        flags = family.flags_from_config(cfg)
    except (ConversionError, KeyError) as exc:
        raise SystemExit(f"{config_path}: {exc}") from None
    rules = rules_for(spec)
    files = _shards(args.load_dir)
    metadata = dict(family=family.name, spec=spec, hf_config=cfg, megatron_flags=flags,
                    megatron_args=None, source=os.path.abspath(args.load_dir))

    def tensors():
        import torch
        from safetensors import safe_open
        from tqdm import tqdm

        by_source = {}  # HF tensor on disk -> [(rule, name in the rule)]; upcycling: one feeds many
        for rule in rules:
            for name in rule.hf:
                by_source.setdefault(source(name), []).append((rule, name))
        initialised = by_source.pop(None, [])  # upcycled routers: nothing to read
        gen = torch.Generator().manual_seed(args.seed)
        std = cfg.get("initializer_range", 0.02)
        for rule, _ in initialised:
            shape = (spec.num_experts, spec.hidden)
            yield rule.meg, torch.empty(shape).normal_(0.0, std, generator=gen)
        pending = {}  # rule.meg -> {hf name: tensor}
        done = {rule.meg for rule, _ in initialised}
        for shard in tqdm(files, desc="reading HF shards", unit="shard"):
            path = os.path.join(args.load_dir, shard)
            with safe_open(path, framework="pt") as f:
                for key in f.keys():
                    if key.endswith(IGNORED_HF_SUFFIXES):
                        continue
                    users = by_source.get(key)
                    if users is None:
                        raise SystemExit(f"{path}: tensor {key} has no place in a "
                                         f"{family.architecture} with this config.json")
                    tensor = f.get_tensor(key)
                    for rule, name in users:
                        parts = pending.setdefault(rule.meg, {})
                        parts[name] = tensor
                        if len(parts) == len(rule.hf):
                            del pending[rule.meg]
                            done.add(rule.meg)
                            yield rule.meg, rule.merge([parts[n] for n in rule.hf])
        missing = [source(n) for rule in rules if rule.meg not in done for n in rule.hf
                   if n not in pending.get(rule.meg, {})]
        if missing:
            raise SystemExit(f"--load-dir {args.load_dir}: {len(missing)} tensor(s) missing, "
                             f"e.g. {sorted(set(missing))[:3]}")

    return metadata, tensors()
