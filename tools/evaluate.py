#!/usr/bin/env python
"""Loss and perplexity of a GPT-MoE checkpoint on a .bin/.idx dataset, on demand.

    python tools/evaluate.py --load CKPT --use-checkpoint-args                 # the run's valid split
    torchrun --nproc_per_node 2 tools/evaluate.py --load CKPT --use-checkpoint-args \
        --expert-model-parallel-size 2 --data-path other_text_document --split 0,100,0 --eval-iters 20

Prints the training log's validation line (``validation loss at iteration N | lm loss value: ...
| lm loss PPL: ... |``) computed exactly as training computes it: the same datasets (megatron-core
GPTDataset, the run's --split, --seed and sample counts), the same batches (--micro-batch-size,
--global-batch-size, --eval-iters, default: the checkpoint's), the same forward step and the same
averaging. With the run's flags it reproduces the line the run printed after saving that
checkpoint (the first evaluation of a run starts at validation sample 0, as this tool does).
"""

from __future__ import annotations

import argparse
import math
import os
import sys

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def add_evaluate_args(parser):
    g = parser.add_argument_group("evaluation")
    g.add_argument("--eval-split", default="valid", choices=["valid", "test"],
                   help="Which split of --data-path / --split to evaluate (or --valid-data-path / "
                        "--test-data-path).")
    from megatron_moe.inference.ring_memory_args import add_ring_memory_args

    add_ring_memory_args(parser)  # the ring's hooks sit on the layers: evaluation streams too
    return parser


def _validate(args):
    from megatron_moe.inference.ring_memory_args import validate_ring_memory_args
    from tools.generate import validate_inference_layout

    validate_inference_layout(args)
    validate_ring_memory_args(args)
    if args.eval_iters < 1:
        raise ValueError(f"--eval-iters must be >= 1 (got {args.eval_iters})")


def num_samples(args):
    """Samples per split, sized as the training run sized them (so the shuffled order, which
    depends on the count, is the run's) and at least what this evaluation reads."""
    from megatron_moe.data.gpt import train_valid_test_num_samples

    run = args.checkpoint_args if args.use_checkpoint_args and args.checkpoint_args else args
    counts = train_valid_test_num_samples(run)
    need = args.eval_iters * args.eval_global_batch_size
    if counts[1] < need:
        counts[1] = need
    counts[2] = max(counts[2], need)
    return counts


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if "-h" in argv or "--help" in argv:
        p = argparse.ArgumentParser(prog="evaluate.py", description=__doc__.split("\n\n")[0],
                                    epilog="Every pretrain_gpt_moe.py flag is accepted as well "
                                           "(--data-path, --split, --eval-iters, --micro-batch-size, "
                                           "--global-batch-size, parallel layout, ...).")
        p.add_argument("--load", required=True)
        p.add_argument("--use-checkpoint-args", action="store_true")
        add_evaluate_args(p)
        p.parse_args(["--help"])

    from megatron_moe.compat import install_megatron_core_stubs, quiet_known_warnings

    quiet_known_warnings()
    install_megatron_core_stubs()
    from megatron_moe.inference.arguments import parse_inference_args

    args = parse_inference_args(argv, add_evaluate_args, prog="evaluate.py", need_data=True,
                                keep_batch_size=True, validate_tool=_validate)
    return evaluate(args)["exit_code"]


def evaluate(args) -> dict:
    """Run the evaluation; returns {'lm loss', 'ppl', 'iteration', 'exit_code', 'model'}."""
    from megatron.core.enums import ModelType  # noqa: F401

    import pretrain_gpt_moe
    from megatron_moe.inference.engine import setup_model, single_process_port
    from megatron_moe.training.loop import (
        Trainer, TrainingError, TrainingHooks, _build_datasets, _iterator, print_rank_last,
    )

    single_process_port()
    model, _, iteration = setup_model(args)
    from megatron_moe.inference.ring_memory_args import attach_ring_memory

    ring = attach_ring_memory(model, args)
    try:
        train_ds, valid_ds, test_ds = _build_datasets(
            args, lambda _: pretrain_gpt_moe.train_valid_test_datasets_provider(num_samples(args)))
    except TrainingError as exc:
        print_rank_last(f"evaluate.py: error: {exc}")
        return {"exit_code": 1}
    dataset = valid_ds if args.eval_split == "valid" else test_ds
    data_iter = _iterator(args, dataset, 0, args.eval_micro_batch_size)
    if data_iter is None:
        print_rank_last(f"evaluate.py: error: the {args.eval_split} split is empty (check --split "
                        f"or --{args.eval_split}-data-path)")
        return {"exit_code": 1}
    hooks = TrainingHooks(args, [model])
    trainer = Trainer(args, [model], None, None, pretrain_gpt_moe.forward_step, hooks)
    losses = trainer.evaluate(data_iter)
    trainer._log_eval(f"iteration {iteration}", losses, iteration)
    loss = losses.get("lm loss")
    tokens = args.eval_iters * args.eval_global_batch_size * args.seq_length
    print_rank_last(f" {args.eval_split} split: {args.eval_iters} iterations x "
                    f"{args.eval_global_batch_size} samples x {args.seq_length} tokens = {tokens} "
                    f"tokens | lm loss {loss:.6f} | perplexity {math.exp(min(20.0, loss)):.4f}")
    hooks.close()
    if ring is not None:
        print_rank_last(ring.summary())
        ring.close()
    return {"lm loss": loss, "ppl": math.exp(min(20.0, loss)), "iteration": iteration,
            "exit_code": 0, "model": model}


if __name__ == "__main__":
    sys.exit(main())
