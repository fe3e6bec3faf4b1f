"""Saver: a Hugging Face checkpoint directory that transformers' from_pretrained loads.

Writes config.json, safetensors shards of at most --max-shard-size (transformers' names on disk,
e.g. block_sparse_moe.experts.3.w1.weight) and model.safetensors.index.json. A shard is written
and freed as soon as it is full, so besides the source model only one shard is held.
"""

from __future__ import annotations

import json
import os
import re

_DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
           "float16": "float16", "fp16": "float16"}


def add_arguments(parser):
    group = parser.add_argument_group("Hugging Face saver")
    group.add_argument("--hf-family", default=None,
                       choices=["mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3", "gpt_oss"],
                       help="Architecture to write (default: the one imported from, else guessed "
                            "from the model: sinks/quick-GEGLU -> gpt_oss, MLA -> deepseek_v3, QK "
                            "layernorm -> qwen3_moe, "
                            "shared experts / QKV bias -> qwen2_moe, else mixtral)")
    group.add_argument("--hf-config-template", default=None,
                       help="config.json to start from (token ids, names, ...) when the checkpoint "
                            "no longer carries its HF config (it was trained further here); its "
                            "architecture fields must agree with the checkpoint's")
    group.add_argument("--max-shard-size", default="5GB",
                       help="Largest shard, e.g. 5GB, 500MB (transformers' default 5GB)")
    group.add_argument("--save-dtype", default=None, choices=sorted(_DTYPES),
                       help="Default: the imported config's dtype, else the training precision")


def parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B)?\s*", text, re.I)
    if not m:
        raise SystemExit(f"--max-shard-size: cannot read {text!r} (e.g. 5GB, 500MB)")
    unit = (m.group(2) or "B").upper()
    scale = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
             "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}[unit]
    return int(float(m.group(1)) * scale)


class ShardWriter:
    """Accumulates tensors and writes model-XXXXX-of-YYYYY.safetensors shards (the total is known
    only at the end, so shards are renamed then) plus the index."""

    def __init__(self, save_dir, max_bytes):
        self.dir, self.max = save_dir, max_bytes
        self.buffer, self.bytes, self.files, self.weight_map, self.total = {}, 0, [], {}, 0

    def add(self, name, tensor):
        size = tensor.numel() * tensor.element_size()
        if self.buffer and self.bytes + size > self.max:
            self.flush()
        self.buffer[name] = tensor
        self.bytes += size
        self.total += size

    def flush(self):
        from safetensors.torch import save_file

        if not self.buffer:
            return
        tmp = os.path.join(self.dir, f"model-{len(self.files) + 1:05d}.safetensors.tmp")
        save_file(self.buffer, tmp, metadata={"format": "pt"})
        self.files.append((tmp, list(self.buffer)))
        self.buffer, self.bytes = {}, 0

    def close(self):
        self.flush()
        n = len(self.files)
        for i, (tmp, names) in enumerate(self.files, 1):
            final = f"model-{i:05d}-of-{n:05d}.safetensors"
            os.replace(tmp, os.path.join(self.dir, final))
            self.weight_map.update({k: final for k in names})
        index = {"metadata": {"total_size": self.total},
                 "weight_map": dict(sorted(self.weight_map.items()))}
        with open(os.path.join(self.dir, "model.safetensors.index.json"), "w") as f:
            json.dump(index, f, indent=2)
            f.write("\n")
        return n


# fields of a generated config that may differ from a template's without changing the model
_FREE = {"torch_dtype", "dtype", "initializer_range", "use_cache", "attention_dropout",
         "router_aux_loss_coef", "router_jitter_noise", "max_position_embeddings", "architectures",
         "max_window_layers", "sliding_window", "use_sliding_window"}


def _from_template(path, generated):
    """The template config with the generated one's values checked against it."""
    from megatron_moe.hf.families import _rope_parameters

    with open(path) as f:
        template = json.load(f)
    for key, value in generated.items():
        if key in _FREE:
            continue
        if key == "rope_theta":
            have = float(_rope_parameters(template, value)["rope_theta"])
        elif key == "rope_scaling":  # the template may spell it rope_parameters (transformers 5)
            rope = _rope_parameters(template, None)
            have = {k: rope.get("rope_type") if k == "type" else rope.get(k) for k in value}
        elif key == "head_dim":
            have = template.get("head_dim") or template["hidden_size"] // template["num_attention_heads"]
        elif key == "num_experts" and key not in template:  # transformers >= 5 (Qwen3-MoE)
            have = template.get("num_local_experts")
        else:
            have = template.get(key)
        if have != value and not (key == "mlp_only_layers" and not have and not value):
            raise SystemExit(f"--hf-config-template {path}: {key} is {have!r}, the checkpoint "
                             f"has {value!r}")
    return template


def save_checkpoint(metadata, tensors, args):
    import torch
    from tqdm import tqdm

    from megatron_moe.hf.families import FAMILIES, ConversionError, rules_for

    spec = metadata["spec"]
    family = FAMILIES[args.hf_family or metadata["family"]]
    if spec.family != family.name:
        spec.family = family.name
    cfg = metadata.get("hf_config")
    if cfg is None or cfg.get("model_type") != family.name:
        try:
            family.check_args(metadata["megatron_args"])
        except ConversionError as exc:
            raise SystemExit(str(exc)) from None
        cfg = family.config_from_args(metadata["megatron_args"], spec, metadata["dtype"])
        if args.hf_config_template:
            cfg = _from_template(args.hf_config_template, cfg)
        for key, value in (metadata.get("special_tokens") or {}).items():
            cfg.setdefault(key, value)  # the training tokenizer's (a template's own win)
    dtype_name = _DTYPES[args.save_dtype or cfg.get("torch_dtype") or cfg.get("dtype")
                         or metadata.get("dtype", "float32")]
    dtype = getattr(torch, dtype_name)
    rules = {r.meg: r for r in rules_for(spec)}

    os.makedirs(args.save_dir, exist_ok=True)
    for old in os.listdir(args.save_dir):  # stale shards of an earlier export would be loaded too
        if re.fullmatch(r"model(-\d{5}-of-\d{5})?\.safetensors(\.tmp)?", old):
            os.remove(os.path.join(args.save_dir, old))
    writer = ShardWriter(args.save_dir, parse_size(args.max_shard_size))
    stacks = {}  # HF name -> {slice index: tensor} of a stacked tensor still being gathered
    for name, tensor in tqdm(tensors, total=len(rules), desc="writing HF shards", unit="t"):
        rule = rules.pop(name)
        for hf_name, part in zip(rule.hf, rule.split(tensor)):
            # own, contiguous storage: safetensors refuses views that share memory
            part = part.to(dtype).clone(memory_format=torch.contiguous_format)
            if rule.stacked is None:
                writer.add(hf_name, part)
                continue
            index, count = rule.stacked
            slices = stacks.setdefault(hf_name, {})
            slices[index] = part
            if len(slices) == count:  # all experts of the layer: one stacked tensor
                writer.add(hf_name, torch.stack([slices[i] for i in range(count)]))
                del stacks[hf_name]
    if rules or stacks:
        raise SystemExit(f"{len(rules) + len(stacks)} tensor(s) never arrived from the loader, "
                         f"e.g. {sorted(rules)[:3] + sorted(stacks)[:3]}")
    n = writer.close()
    with open(os.path.join(args.save_dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
        f.write("\n")
    generation = {k: cfg[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")
                  if cfg.get(k) is not None}
    generation_path = os.path.join(args.save_dir, "generation_config.json")
    if generation:  # what transformers' generate() reads its stop token from
        with open(generation_path, "w") as f:
            json.dump(dict(generation, _from_model_config=True), f, indent=2, sort_keys=True)
            f.write("\n")
    elif os.path.exists(generation_path):  # an earlier export's
        os.remove(generation_path)
    print(f"saved {len(writer.weight_map)} tensors in {n} shard(s) + config.json "
          f"({family.architecture}, {dtype_name}) to {args.save_dir}")
