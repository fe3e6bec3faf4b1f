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
    group.add_argument("--seed", type=int, default=1234,
                       help="Initialisation of upcycled routers and --init-missing-mtp layers")
    group.add_argument("--init-missing-mtp", action="store_true",
                       help="DeepSeek-V3 saved without MTP weights (transformers saves none): "
                            "keep --mtp-num-layers and initialise the MTP layers as megatron-core "
                            "does (normal(0, initializer_range), output projections / sqrt(2 x "
                            "layers), norms 1, expert bias 0; embedding and head shared); "
                            "default: import without MTP")


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


def _tensor_files(load_dir, files) -> dict:
    """HF tensor name -> shard path, from the shards' headers (no tensor is read)."""
    from safetensors import safe_open

    from megatron_moe.hf.families import IGNORED_HF_SUFFIXES

    where = {}
    for shard in files:
        path = os.path.join(load_dir, shard)
        with safe_open(path, framework="pt") as f:  # the header only
            where.update({key: path for key in f.keys() if not key.endswith(IGNORED_HF_SUFFIXES)})
    return where


class HFTensors:
    """megatron-core parameters made from the HF shards on demand (see the module doc)."""

    def __init__(self, load_dir, where, rules, source, initialised):
        self.rules = {rule.meg: rule for rule in rules}
        self.source = source            # HF name in a rule -> HF tensor on disk (upcycling)
        self.initialised = initialised  # rule.meg -> tensor made here (upcycled routers)
        self.where = where              # HF tensor on disk -> shard path
        self.load_dir = load_dir
        self.bytes_read = 0
        wanted = {source(n) for rule in rules for n in rule.hf} - {None}
        for key, path in where.items():
            if key not in wanted:
                raise SystemExit(f"{path}: tensor {key} has no place in this model "
                                 f"({len(wanted)} tensors expected from config.json)")
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

    def read(self, meg_name, shape=None):
        """The parameter ``meg_name``; ``shape`` (the model's) for one initialised here."""
        if meg_name in self.initialised:
            return self.initialised[meg_name](shape)
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
    files = _shards(args.load_dir)
    where = _tensor_files(args.load_dir, files)
    try:
        if args.upcycle_num_experts:
            cfg = upcycle_config(cfg, args.upcycle_num_experts, args.upcycle_topk)
            source = upcycle_source
        family = family_for_config(cfg)
        model_cfg, fresh_mtp = _unsaved_mtp(cfg, family.spec_from_config(cfg), where,
                                            args.load_dir, args.init_missing_mtp)
        spec = family.spec_from_config(model_cfg)
        if fresh_mtp:
            source = _mtp_source(spec.num_layers)
        flags = family.flags_from_config(model_cfg)
    except (ConversionError, KeyError) as exc:
        raise SystemExit(f"{config_path}: {exc}") from None
    rules = rules_for(spec)
    # hf_config stays the file's own (num_nextn_predict_layers included): an export writes it back
    metadata = dict(family=family.name, spec=spec, hf_config=cfg, megatron_flags=flags,
                    megatron_args=None, source=os.path.abspath(args.load_dir))
    import torch

    std = cfg.get("initializer_range", 0.02)
    fresh = [rule.meg for rule in rules if any(source(n) is None for n in rule.hf)]
    if fresh_mtp:  # made when written (streaming), each from its own seed
        initialised = {name: _megatron_init(name, std, spec.num_layers, args.seed + i)
                       for i, name in enumerate(fresh)}
    else:  # upcycled routers: drawn now, in model order (small: experts x hidden per layer)
        gen = torch.Generator().manual_seed(args.seed)
        initialised = {name: _constant(torch.empty(spec.num_experts, spec.hidden).normal_(
            0.0, std, generator=gen)) for name in fresh}
    return metadata, HFTensors(args.load_dir, where, rules, source, initialised)


def _constant(tensor):
    return lambda shape: tensor


def _megatron_init(name, std, num_layers, seed):
    """megatron-core's initialisation of parameter ``name`` (TransformerConfig defaults): norms 1,
    the router's expert bias 0, output projections (linear_proj, linear_fc2) normal(0, std /
    sqrt(2 x num_layers)) = its output_layer_init_method, every other weight normal(0, std) = its
    init_method. Written out here because megatron-core initialises in module constructors,
    i.e. only by building the whole (MTP) layer in memory at once."""
    def make(shape):
        import torch

        if name.endswith(("norm.weight", "layernorm.weight")):
            return torch.ones(shape)
        if name.endswith("expert_bias"):
            return torch.zeros(shape)
        scale = (2.0 * num_layers) ** -0.5 if ".linear_proj." in name or ".linear_fc2." in name \
            else 1.0
        gen = torch.Generator().manual_seed(seed)
        return torch.empty(shape).normal_(0.0, std * scale, generator=gen)

    return make


def _unsaved_mtp(cfg, spec, where, load_dir, init: bool):
    """(config the model is built from, whether its MTP layers are initialised here).

    DeepSeek-V3's config says num_nextn_predict_layers=1 by default, but transformers' model
    has no MTP layers and saves no MTP weights (model.layers.{num_hidden_layers}.*); the
    official checkpoints have them. With none of them on disk the model is imported without MTP
    (no --mtp-num-layers), or with ``init`` (--init-missing-mtp) with freshly initialised MTP
    layers; either is said in one line. With some of them the import stops at the missing ones."""
    if not spec.mtp_layers:
        return cfg, False
    prefix = f"model.layers.{spec.num_layers}."
    if any(name.startswith(prefix) for name in where):
        return cfg, False
    what = (f"{spec.mtp_layers} MTP layer(s) initialised fresh (--init-missing-mtp, --seed)"
            if init else "imported without Multi-Token Prediction (no --mtp-num-layers; "
            "--init-missing-mtp initialises them instead)")
    print(f"note: config.json has num_nextn_predict_layers={spec.mtp_layers} but {load_dir} holds "
          f"no MTP weights ({prefix}*; transformers does not save them): {what}")
    return (cfg, True) if init else (dict(cfg, num_nextn_predict_layers=0), False)


def _mtp_source(num_layers):
    """HF tensor each converted tensor is read from when the MTP layers (model.layers.{L + k})
    are initialised here: their embed_tokens / shared_head.head copies are the model's own
    (megatron-core shares them), everything else of them is made (None)."""
    def source(name):
        parts = name.split(".")
        if name.startswith("model.layers.") and int(parts[2]) >= num_layers:
            if name.endswith(".embed_tokens.weight"):
                return "model.embed_tokens.weight"
            if name.endswith(".shared_head.head.weight"):
                return "lm_head.weight"
            return None
        return name

    return source
