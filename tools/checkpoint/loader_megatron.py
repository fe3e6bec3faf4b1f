"""Loader: a Megatron checkpoint of ours (latest_checkpointed_iteration.txt, iter_XXXXXXX/ torch_dist),
saved at any TP/PP/EP layout.

The model is rebuilt unsharded from the checkpoint's stored args and loaded through
megatron_moe.checkpointing.load_checkpoint; dist_checkpointing assembles every tensor from all the
ranks' shards, so every expert of every EP rank is present (the Megatron-Bridge EP>1 export bug
cannot happen here). Tensors are then handed out one rule at a time.
"""

from __future__ import annotations

import os


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


def load_checkpoint(args):
    from megatron_moe.compat import quiet_known_warnings

    quiet_known_warnings()
    from megatron.core import dist_checkpointing

    from megatron_moe.checkpointing import checkpoint_dir, load_checkpoint as load, read_tracker
    from megatron_moe.hf import megatron_side
    from megatron_moe.hf.families import guess_family, rules_for, spec_from_args

    iteration = read_tracker(args.load_dir)
    if iteration is None:
        raise SystemExit(f"--load-dir {args.load_dir}: no latest_checkpointed_iteration.txt")
    ckpt = checkpoint_dir(args.load_dir, iteration)
    common = dist_checkpointing.load_common_state_dict(ckpt)
    stored = common["args"]
    hf = (common.get("extra_state") or {}).get("hf")
    family = getattr(args, "hf_family", None) or (hf or {}).get("family") or guess_family(stored)
    vocab = _true_vocab(stored, hf, args)
    spec = spec_from_args(stored, family, vocab)

    margs = megatron_side.conversion_args(stored)
    margs.load = args.load_dir
    margs.finetune, margs.no_load_optim, margs.no_load_rng = False, True, True
    megatron_side.init_single_process()
    model = megatron_side.build_model(margs)
    load([model], None, None, margs)
    params = megatron_side.parameters(model)
    if spec.vocab > stored.padded_vocab_size:
        raise SystemExit(f"--true-vocab-size {spec.vocab} > the checkpoint's padded vocabulary "
                         f"{stored.padded_vocab_size}")
    metadata = dict(family=family, spec=spec, hf_config=(hf or {}).get("config"),
                    megatron_args=stored, megatron_flags=None, iteration=iteration,
                    dtype="bfloat16" if stored.bf16 else ("float16" if stored.fp16 else "float32"))
    rules = rules_for(spec)
    unused = set(params) - {r.meg for r in rules}
    if unused:
        raise SystemExit(f"{ckpt}: {len(unused)} parameter(s) have no HF counterpart in "
                         f"{family}, e.g. {sorted(unused)[:3]}")

    def tensors():
        for rule in rules:
            t = params.pop(rule.meg)
            if rule.vocab:
                t = t[:spec.vocab]  # drop Megatron's padding rows
            yield rule.meg, t
        megatron_side.finish()

    return metadata, tensors()
