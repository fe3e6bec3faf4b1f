"""Loader: a Hugging Face checkpoint directory (config.json + safetensors shards).

Nothing is read up front but the shards' headers (names, to check that every tensor has its
place and none is missing). The tensors it returns give each megatron-core parameter on demand
(``read(name)``: its HF tensors read with safetensors' ``safe_open``, one tensor at a time, and
merged), in any order: the Megatron saver asks for them while its checkpoint is being written
(streaming import, docs/hf.md). Iterating yields (name, tensor) in the model's order.
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


class HFTensors:
    """megatron-core parameters made from the HF shards on demand (see the module doc)."""

    def __init__(self, load_dir, files, rules, source, initialised):
        self.rules = {rule.meg: rule for rule in rules}
        self.source = source            # HF name in a rule -> HF tensor on disk (upcycling)
        self.initialised = initialised  # rule.meg -> tensor made here (upcycled routers)
        self.where = {}                 # HF tensor on disk -> shard path
        self.load_dir = load_dir
        self.bytes_read = 0
        from safetensors import safe_open

        from megatron_moe.hf.families import IGNORED_HF_SUFFIXES

        wanted = {source(n) for rule in rules for n in rule.hf} - {None}
        for shard in files:
            path = os.path.join(load_dir, shard)
            with safe_open(path, framework="pt") as f:  # the header only
                for key in f.keys():
                    if key.endswith(IGNORED_HF_SUFFIXES):
                        continue
                    if key not in wanted:
                        raise SystemExit(f"{path}: tensor {key} has no place in this model "
                                         f"({len(wanted)} tensors expected from config.json)")
                    self.where[key] = path
        missing = sorted(wanted - set(self.where))
        if missing:
            raise SystemExit(f"--load-dir {load_dir}: {len(missing)} tensor(s) missing, "
                             f"e.g. {missing[:3]}")

    def _get(self, name, index=None):
        from safetensors import safe_open

        # opened per tensor: a shard's mapping is released as soon as its tensor is read;
        # a stacked tensor's slice (one gpt-oss expert) is read alone
        with safe_open(self.where[name], framework="pt") as f:
            tensor = f.get_tensor(name) if index is None else f.get_slice(name)[index]
        self.bytes_read += tensor.numel() * tensor.element_size()
        return tensor

    def read(self, meg_name):
        if meg_name in self.initialised:
            return self.initialised[meg_name]
        rule = self.rules[meg_name]
        index = rule.stacked[0] if rule.stacked else None
        return rule.merge([self._get(self.source(n), index) for n in rule.hf])

    def __len__(self):
        return len(self.rules)

    def __iter__(self):
        for name in self.rules:
            yield name, self.read(name)


def load_checkpoint(args):
    """Returns (metadata, HFTensors: random access by megatron name, iterable in model order)."""
    from megatron_moe.hf.families import (ConversionError, family_for_config, rules_for,
                                          upcycle_config, upcycle_source)

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
    import torch

    # upcycled routers: drawn now, in model order (small: experts x hidden per layer)
    gen = torch.Generator().manual_seed(args.seed)
    std = cfg.get("initializer_range", 0.02)
    initialised = {rule.meg: torch.empty(spec.num_experts, spec.hidden).normal_(0.0, std,
                                                                             generator=gen)
                   for rule in rules if any(source(n) is None for n in rule.hf)}
    return metadata, HFTensors(args.load_dir, files, rules, source, initialised)
