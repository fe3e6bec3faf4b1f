"""Rank functions that run the real pretrain() entry point in-process (spawned by run_distributed)."""


def _pretrain(argv):
    import pretrain_gpt_moe
    from megatron.core.enums import ModelType

    from megatron_moe.training.loop import pretrain

    return pretrain(pretrain_gpt_moe.train_valid_test_datasets_provider,
                    pretrain_gpt_moe.model_provider, ModelType.encoder_or_decoder,
                    pretrain_gpt_moe.forward_step, argv=argv)


def run_pretrain(rank, world_size, argv):
    return _pretrain(argv)["history"]


def pretrain_with_step(argv, wrap):
    """pretrain() with ``Trainer.train_step`` replaced by ``wrap(the original)`` for this run (put
    back after it, however it ends); pretrain()'s result."""
    from megatron_moe.training import loop

    step = loop.Trainer.train_step
    loop.Trainer.train_step = wrap(step)
    try:
        return _pretrain(argv)
    finally:
        loop.Trainer.train_step = step



def pretrain_recording(argv, record):
    """pretrain() with ``record(trainer)`` called after every train step; what it returned, in
    order (a test's view of state the loop does not report, read on the host by the test)."""
    out = []

    def wrap(step):
        def train_step(self, data_iterator):
            result = step(self, data_iterator)
            out.append(record(self))
            return result
        return train_step

    pretrain_with_step(argv, wrap)
    return out


def generate_cli(load, prompt="The module", tokens=6, timeout=300):
    """tools/generate.py on one CPU process from a training checkpoint (--use-checkpoint-args):
    (completion text, generated tokens' log probs); AssertionError with its output if it fails."""
    import os

    from megatron_moe.runtime.local_ranks import run_script

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    # the script as __main__ in a process forked from the fork server (torch and megatron-core
    # already imported), not a fresh interpreter
    out = run_script(
        os.path.join(root, "tools", "generate.py"),
        ["--load", load, "--use-checkpoint-args", "--num-tokens-to-generate", str(tokens),
         "--return-log-probs", "--prompts", prompt],
        env=dict(os.environ, PYTHONPATH=root, OMP_NUM_THREADS="1"), timeout_s=timeout)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    blocks = [b.strip("\n") for b in out.stdout.split("-" * 80)[1:-1]]   # between the rulers
    assert len(blocks) == 1 and blocks[0].startswith(prompt), out.stdout[-2000:]
    text, logps = blocks[0].splitlines()[:2]
    return text, [float(v) for v in logps.split(":")[1].split()]
