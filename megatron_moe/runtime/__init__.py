"""A process's life around the model: launch (torchrun / Slurm variables), process groups and node
topology, global state, signals, helper processes, and local multi-rank runs (tests, benches)."""
