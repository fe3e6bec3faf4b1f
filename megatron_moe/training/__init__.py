"""The training run: the loop (Trainer, logging, loss reduction), checkpoints and W&B."""
