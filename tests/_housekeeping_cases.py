"""Rank functions for tests/test_housekeeping_flags.py (spawned by run_distributed). A ``mutate``
argument breaks the feature inside the spawned rank (a monkeypatch in the test process would not
reach it); the test expects that run to fail its assertions."""


def train_seeing_masks(rank, world_size, argv, mutate=None):
    """pretrain() with the attention mask of every micro-batch recorded twice: as the dataloader
    yields it and as the forward step hands it to the model. Returns (losses, dataloader masks,
    model masks), each mask None or (shape, masked entries). ``mutate``: 'flag-ignored' (the
    dataset builds masks whatever the flag says) or 'mask-never-needed' (the forward step drops
    the mask even where --reset-attention-mask edits it)."""
    import pretrain_gpt_moe
    from megatron_moe.data import gpt
    from tests._train_cases import run_pretrain

    data_seen, model_seen = [], []
    get_batch, dataset_config = pretrain_gpt_moe.get_batch, gpt.gpt_dataset_config
    needs = pretrain_gpt_moe.needs_attention_mask
    fact = lambda mask: None if mask is None else (tuple(mask.shape), int(mask.sum()))  # noqa

    class Recorded:
        def __init__(self, it):
            self.it = it

        def __next__(self):
            batch = next(self.it)
            data_seen.append(fact(batch.get("attention_mask")))
            return batch

    def recording_get_batch(data_iterator, vp_stage=None):
        out = get_batch(Recorded(data_iterator), vp_stage)
        model_seen.append(fact(out[3]))
        return out

    def masks_always(args, tokenizer):
        config = dataset_config(args, tokenizer)
        config.create_attention_mask = True
        return config

    pretrain_gpt_moe.get_batch = recording_get_batch
    if mutate == "flag-ignored":
        gpt.gpt_dataset_config = masks_always
    if mutate == "mask-never-needed":
        pretrain_gpt_moe.needs_attention_mask = lambda args: False
    try:
        history = run_pretrain(rank, world_size, argv)
    finally:
        pretrain_gpt_moe.get_batch, gpt.gpt_dataset_config = get_batch, dataset_config
        pretrain_gpt_moe.needs_attention_mask = needs
    return history["lm_loss"], data_seen, model_seen


def train_retaining(rank, world_size, argv, mutate=None):
    """pretrain() with every checkpoint deletion checked when it starts: the tracker must already
    name a complete checkpoint (renamed into place, with its manifest) other than the one deleted.
    Returns (history, [violations]). ``mutate``: 'keeps-by-new-iteration' (the retain rule tested
    on the new iteration instead of the retired one), 'deletes-before-tracker' (the retired
    checkpoint deleted before the tracker names the new one)."""
    import os

    from megatron_moe.training import checkpoint_manifest as manifest
    from megatron_moe.training import checkpointing as C
    from tests._train_cases import run_pretrain

    violations = []
    delete, rule, write_tracker = C._delete_in_background, C.retired_iteration, C._write_tracker

    def checked_delete(root, iteration, log_progress):
        tracked = C.read_tracker(root)
        ckpt = C.checkpoint_dir(root, tracked)
        if tracked == iteration or not os.path.isfile(os.path.join(ckpt, manifest.MANIFEST)):
            violations.append(f"deleting iteration {iteration} while the tracker names {tracked}")
        return delete(root, iteration, log_progress)

    def rule_on_new_iteration(previous, iteration, retain):
        if retain is None or not previous or previous == iteration or iteration % retain == 0:
            return None
        return previous

    def delete_then_track(root, iteration):
        retired = rule(C.read_tracker(root), iteration, int(argv[argv.index(
            "--save-retain-interval") + 1]))
        if retired is not None:
            C._delete_in_background(root, retired, False)
            C.wait_for_deletion()
        write_tracker(root, iteration)

    C._delete_in_background = checked_delete
    if mutate == "keeps-by-new-iteration":
        C.retired_iteration = rule_on_new_iteration
    elif mutate == "deletes-before-tracker":
        C._write_tracker = delete_then_track
    try:
        history = run_pretrain(rank, world_size, argv)
    finally:
        C._delete_in_background, C.retired_iteration, C._write_tracker = delete, rule, write_tracker
    return history, violations


def train_resuming_without_flops(rank, world_size, argv):
    """pretrain() whose resume loses the checkpoint's FLOP count (the progress log's mutation)."""
    from megatron_moe.training import checkpointing as C
    from tests._train_cases import run_pretrain

    load = C.load_checkpoint

    def forgetful_load(*args, **kwargs):
        iteration, consumed, valid, extra = load(*args, **kwargs)
        extra = {k: v for k, v in extra.items() if k != "num_floating_point_operations_so_far"}
        return iteration, consumed, valid, extra

    C.load_checkpoint = forgetful_load
    try:
        return run_pretrain(rank, world_size, argv)
    finally:
        C.load_checkpoint = load


def train_without_gloo_groups(rank, world_size, argv, mutate=None):
    """pretrain() as an NCCL run with --disable-gloo-process-groups goes (a CPU run refuses the
    flag at parse time, so the parsed args take its value here), counting the process groups
    created with backend="gloo". Returns (history, gloo groups created). ``mutate``:
    'groups-created' (initialize_model_parallel not told), 'optimizer-not-told'
    (get_megatron_optimizer asks for the Gloo groups)."""
    import megatron.core.optimizer as mcore_optimizer
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_moe.training import loop
    from tests._train_cases import run_pretrain

    gloo_groups = [0]
    new_group, parse, init = dist.new_group, loop.parse_args, parallel_state.initialize_model_parallel
    build_optimizer = mcore_optimizer.get_megatron_optimizer

    def counting_new_group(*args, **kwargs):
        gloo_groups[0] += kwargs.get("backend") == "gloo"
        return new_group(*args, **kwargs)

    def parse_as_nccl_run(*args, **kwargs):
        parsed = parse(*args, **kwargs)
        parsed.use_gloo_process_groups = False
        return parsed

    def init_with_gloo_groups(*args, **kwargs):
        return init(*args, **dict(kwargs, create_gloo_process_groups=True))

    def optimizer_with_gloo_groups(*args, **kwargs):
        return build_optimizer(*args, **dict(kwargs, use_gloo_process_groups=True))

    dist.new_group, loop.parse_args = counting_new_group, parse_as_nccl_run
    if mutate == "groups-created":
        parallel_state.initialize_model_parallel = init_with_gloo_groups
    elif mutate == "optimizer-not-told":
        mcore_optimizer.get_megatron_optimizer = optimizer_with_gloo_groups
    try:
        history = run_pretrain(rank, world_size, argv)
    finally:
        dist.new_group, loop.parse_args = new_group, parse
        parallel_state.initialize_model_parallel = init
        mcore_optimizer.get_megatron_optimizer = build_optimizer
    return history, gloo_groups[0]


def train_counting_gc(rank, world_size, argv, mutate=None):
    """pretrain() with Python's garbage collections recorded: returns (losses, [(event, detail)]),
    events in order: ('collect', generation) for each gc.collect call, ('step', collector enabled
    during it), ('eval', collector enabled during it), and ('end', collector enabled after the
    run; each collect with its caller's file:line), and ('empty_cache',) for each
    torch.cuda.empty_cache call. ``mutate``: 'hooks-dropped' (the manual GC never plugs in),
    'empty-cache-ignored' (the loop never empties the allocator's cache)."""
    import gc
    import sys

    from megatron_moe.training import loop, manual_gc
    from tests._train_cases import pretrain_with_step

    events = []
    collect = gc.collect

    def counting_collect(generation=2):
        f = sys._getframe(1)
        events.append(("collect", generation, f"{f.f_code.co_filename}:{f.f_lineno}"))
        return collect(generation)

    def wrap(step):
        def train_step(self, data_iterator):
            events.append(("step", gc.isenabled()))
            return step(self, data_iterator)
        return train_step

    evaluate = loop.Trainer.evaluate

    def recorded_evaluate(self, data_iterator):
        out = evaluate(self, data_iterator)
        events.append(("eval", gc.isenabled()))
        return out

    import torch

    if mutate == "hooks-dropped":
        manual_gc.run_hooks = lambda *a: None
    if mutate == "empty-cache-ignored":
        loop.empty_unused_memory = lambda args, level: None
    empty_cache = torch.cuda.empty_cache
    torch.cuda.empty_cache = lambda: events.append(("empty_cache",))
    gc.collect, loop.Trainer.evaluate = counting_collect, recorded_evaluate
    try:
        losses = pretrain_with_step(argv, wrap)["history"]["lm_loss"]
    finally:
        gc.collect, loop.Trainer.evaluate = collect, evaluate
        torch.cuda.empty_cache = empty_cache
    events.append(("end", gc.isenabled()))
    return losses, events


def train_failing_with_manual_gc(rank, world_size, argv, mutate=None):
    """pretrain() whose second training step raises; returns (the error, whether Python's
    collector is on after pretrain() returned by raising)."""
    import gc

    from tests._train_cases import pretrain_with_step

    def wrap(step):
        calls = [0]

        def train_step(self, data_iterator):
            calls[0] += 1
            if calls[0] == 2:
                raise RuntimeError("step 2 failed")
            return step(self, data_iterator)
        return train_step

    try:
        pretrain_with_step(argv, wrap)
    except RuntimeError as exc:
        return str(exc), gc.isenabled()
    return None, gc.isenabled()
