"""Loader: a Megatron checkpoint of ours (latest_checkpointed_iteration.txt, iter_XXXXXXX/ torch_dist),
saved at any TP/PP/EP layout.

The model is rebuilt unsharded on the meta device from the checkpoint's stored args (names,
shapes and megatron-core's own sharded_state_dict; no memory), then read one parameter at a
time (megatron_side.read_parameter): each is assembled from whichever ranks' shards hold it, so
every expert of every EP rank is present (the Megatron-Bridge EP>1 export bug cannot happen here)
and peak memory is one parameter plus the HF shard being written, not the model.

A Megatron-FSDP checkpoint (``--ckpt-format fsdp_dtensor``) is read the same way, one whole
parameter at a time, by the reader training and the inference tools use for it
(training/fsdp_dtensor_checkpoint.ModelWeights: SwiGLU's stored gate and up halves joined, expert
numbers global).
"""

from __future__ import annotations

import warnings


def add_arguments(parser):
    group = parser.add_argument_group("Megatron loader")
    group.add_argument("--true-vocab-size", type=int, default=None,
                       help="Vocabulary without Megatron's padding (default: the HF config stored "
                            "by an HF import, else the tokenizer's size from the stored args)")


def _true_vocab(stored, hf, args):
    if args.true_vocab_size is not None:
        return args.true_vocab_size
    if hf and hf.get("config"):
        return hf["config"]["vocab_size"]
    if stored.tokenizer_type == "NullTokenizer" and stored.vocab_size:
        return stored.vocab_size + 1  # NullTokenizer's vocab is --vocab-size + eod
    try:
        from megatron_moe.data.tokenizers import build_tokenizer

        return build_tokenizer(stored).vocab_size
    except Exception as exc:  # tokenizer file moved, etc.
        raise SystemExit(f"cannot tell the vocabulary size without padding ({exc}); pass "
                         f"--true-vocab-size") from None


def _special_tokens(stored) -> dict:
    """bos_token_id / eos_token_id of the training tokenizer (its eod is the eos), for the
    exported config.json and generation_config.json; {} when the tokenizer cannot be built
    (files moved: the export says so and writes none)."""
    try:
        from megatron_moe.data.tokenizers import build_tokenizer

        tokenizer = build_tokenizer(stored)
    except Exception as exc:
        print(f"note: the training tokenizer is not readable ({exc}); the export carries no "
              f"bos_token_id/eos_token_id")
        return {}
    out = {}
    for key, attr in (("bos_token_id", "bos"), ("eos_token_id", "eod")):
        try:
            value = getattr(tokenizer, attr)
        except (AttributeError, NotImplementedError, ValueError):
            continue
        if isinstance(value, int) and value >= 0:
            out[key] = value
    return out


def load_checkpoint(args):
    from megatron_moe.compat import quiet_known_warnings

    quiet_known_warnings()
    import torch
    from torch.distributed.checkpoint.api import CheckpointException

    from megatron_moe.training.checkpointing import checkpoint_dir, read_common, read_tracker
    from megatron_moe.hf import megatron_side
    from megatron_moe.hf.families import guess_family, rules_for, spec_from_args

    iteration = read_tracker(args.load_dir)
    if iteration is None:
        raise SystemExit(f"--load-dir {args.load_dir}: no latest_checkpointed_iteration.txt")
    ckpt = checkpoint_dir(args.load_dir, iteration)
    from megatron_moe.training.fsdp_dtensor_checkpoint import ModelWeights, is_fsdp_dtensor

    # Megatron-FSDP's checkpoint: its own reader (one whole tensor per name, no sharded_state_dict)
    fsdp_weights = ModelWeights(ckpt) if is_fsdp_dtensor(ckpt) else None
    common = read_common(ckpt)
    stored = common["args"]
    hf = (common.get("extra_state") or {}).get("hf")
    family = getattr(args, "hf_family", None) or (hf or {}).get("family") or guess_family(stored)
    vocab = _true_vocab(stored, hf, args)
    spec = spec_from_args(stored, family, vocab)

    margs = megatron_side.conversion_args(stored)
    megatron_side.init_single_process()
    with torch.device("meta"):  # names, shapes and sharding only; no weights allocated
        model = megatron_side.build_model(margs)
    sharded = model.sharded_state_dict()
    params = megatron_side.parameters(model)
    if spec.vocab > stored.padded_vocab_size:
        raise SystemExit(f"--true-vocab-size {spec.vocab} > the checkpoint's padded vocabulary "
                         f"{stored.padded_vocab_size}")
    metadata = dict(family=family, spec=spec, hf_config=(hf or {}).get("config"),
                    megatron_args=stored, megatron_flags=None, iteration=iteration,
                    dtype="bfloat16" if stored.bf16 else ("float16" if stored.fp16 else "float32"),
                    special_tokens=_special_tokens(stored))
    rules = rules_for(spec)
    unused = set(params) - {r.meg for r in rules}
    if unused:
        raise SystemExit(f"{ckpt}: {len(unused)} parameter(s) have no HF counterpart in "
                         f"{family}, e.g. {sorted(unused)[:3]}")

    def tensors():
        for rule in rules:
            meta = params[rule.meg]
            try:
                with warnings.catch_warnings():  # torch DCP deprecation notices
                    warnings.simplefilter("ignore")
                    if fsdp_weights is not None:
                        if fsdp_weights.shape(rule.meg) != meta.shape:
                            raise ValueError(f"stored shape {tuple(fsdp_weights.shape(rule.meg))}"
                                             f", the model's {tuple(meta.shape)}")
                        t = fsdp_weights.read([rule.meg])[rule.meg].to(meta.dtype)
                    else:
                        t = megatron_side.read_parameter(ckpt, sharded[rule.meg], meta.shape,
                                                         meta.dtype)
            except (Exception, CheckpointException) as exc:  # DCP's is a BaseException
                raise SystemExit(f"{ckpt}: cannot read {rule.meg} ({type(exc).__name__}: "
                                 f"{str(exc).splitlines()[0][:300] if str(exc) else ''})") from None
            yield rule.meg, (t[:spec.vocab] if rule.vocab else t)  # drop the padding rows
        megatron_side.finish()

    return metadata, tensors()
