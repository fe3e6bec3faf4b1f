"""Weights & Biases logging on the ``wandb`` library: Megatron-LM's flags and writer.

``--wandb-project`` (on), ``--wandb-exp-name`` (the run's name), ``--wandb-save-dir`` (default:
``--save``/wandb) and ``--wandb-entity``, as in Megatron-LM (megatron/training/global_vars.py
``_set_wandb_writer``): one run, ``wandb.init(dir, name, project, config=args[, entity])``, on
the last rank (the rank that holds the loss and writes TensorBoard; Megatron-LM's choice), so the
other ranks never import wandb. W&B gets exactly the scalars TensorBoard gets (loss, learning
rate, grad norm, tokens/s, expert load, validation loss, megatron-core's MoE aux losses): the
training loop writes to one ``add_scalar`` writer, which fans out to both.

Without ``--wandb-project`` this module never imports wandb. ``WANDB_MODE=offline`` keeps the run
on disk (``wandb sync`` uploads it later).
"""

from __future__ import annotations

import os


def add_arguments(parser):
    g = parser.add_argument_group("wandb")
    g.add_argument("--wandb-project", default=None,
                   help="The wandb project name; logs the TensorBoard scalars to W&B (last rank).")
    g.add_argument("--wandb-exp-name", default=None, help="The wandb experiment (run) name.")
    g.add_argument("--wandb-save-dir", default=None,
                   help="Path to save the wandb results locally (default: --save/wandb).")
    g.add_argument("--wandb-entity", default=None,
                   help="The wandb entity name (team or user owning the project).")


def validate_args(args):
    others = [f for f in ("wandb_exp_name", "wandb_save_dir", "wandb_entity")
              if getattr(args, f, None) is not None]
    if not getattr(args, "wandb_project", None):
        if others:
            raise ValueError(f"--{others[0].replace('_', '-')} needs --wandb-project")
        return
    if args.wandb_exp_name == "":
        raise ValueError("--wandb-exp-name: please specify the wandb experiment name")
    if not args.wandb_save_dir and not getattr(args, "save", None):
        raise ValueError("--wandb-project needs --wandb-save-dir or --save (runs are kept in "
                         "SAVE/wandb)")


class WandbWriter:
    """TensorBoard's ``add_scalar(tag, value, step)`` onto a wandb run: the scalars of one
    iteration go out as one ``run.log(row, step=iteration)``."""

    def __init__(self, run):
        self.run = run
        self._step = None
        self._row = {}

    def add_scalar(self, tag, value, global_step=None, *args, **kwargs):
        if global_step != self._step:
            self.flush()
            self._step = global_step
        self._row[tag] = float(value)

    def flush(self):
        if self._row:
            self.run.log(self._row, step=self._step)
            self._row = {}

    def close(self):
        self.flush()
        self.run.finish()


class ScalarWriters:
    """One ``add_scalar`` for several writers (TensorBoard's SummaryWriter, WandbWriter)."""

    def __init__(self, writers):
        self.writers = list(writers)

    def add_scalar(self, *args, **kwargs):
        for w in self.writers:
            w.add_scalar(*args, **kwargs)

    def flush(self):
        for w in self.writers:
            w.flush()

    def close(self):
        for w in self.writers:
            w.close()


def _config(args) -> dict:
    """The run's config: the flags with plain values (Megatron-LM passes vars(args))."""
    plain = (bool, int, float, str, type(None))
    return {k: v for k, v in vars(args).items()
            if isinstance(v, plain) or isinstance(v, (list, tuple))
            and all(isinstance(x, plain) for x in v)}


def build_writer(args, tensorboard_writer=None):
    """The training loop's writer on this rank: TensorBoard and/or W&B, or None."""
    writer = tensorboard_writer
    if getattr(args, "wandb_project", None):
        import wandb  # only here: without --wandb-project wandb is never imported

        save_dir = args.wandb_save_dir or os.path.join(args.save, "wandb")
        os.makedirs(save_dir, exist_ok=True)
        kwargs = dict(dir=save_dir, name=args.wandb_exp_name, project=args.wandb_project,
                      config=_config(args))
        if args.wandb_entity:
            kwargs["entity"] = args.wandb_entity
        wb = WandbWriter(wandb.init(**kwargs))
        writer = wb if writer is None else ScalarWriters([writer, wb])
    return writer
