"""pretrain(): parse -> initialize -> build model/optimizer/data -> train loop -> save.

The loop is Megatron-LM's: megatron-core's pipeline schedule runs forward/backward over the
micro-batches, the megatron-core optimizer steps, ``OptimizerParamScheduler`` advances by the
global batch, and the log line has Megatron's exact format (plus tokens/s and per-MoE-layer
expert-load imbalance lines).
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import time
from datetime import datetime

import torch
import torch.distributed as dist

from megatron_moe.runtime import global_vars
from megatron_moe.compat import install_megatron_core_stubs, quiet_known_warnings

quiet_known_warnings()
install_megatron_core_stubs()
from megatron_moe.arguments import parse_args
from megatron_moe.features import RunHooks

_LOSS_KEY = "lm loss"


class TrainingError(RuntimeError):
    """A user-facing failure (bad data, NaN loss, bad checkpoint) printed as one line."""


class RerunExit(Exception):
    """megatron-core's rerun state machine ends the job (Megatron-LM's exit codes: 16, resume from
    the checkpoint to re-run the iteration; 17, result validation failed)."""

    def __init__(self, should_checkpoint, exit_code):
        super().__init__(exit_code)
        self.should_checkpoint, self.exit_code = should_checkpoint, exit_code


def print_rank_0(msg):
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(msg, flush=True)


def print_rank_last(msg):
    if not dist.is_initialized() or dist.get_rank() == dist.get_world_size() - 1:
        print(msg, flush=True)


def pretrain(train_valid_test_datasets_provider, model_provider, model_type, forward_step_func,
             extra_args_provider=None, args_defaults=None, argv=None, process_non_loss_data_func=None):
    """Megatron-LM's entry point. Returns a dict of results (losses per iteration) for tests."""
    args = parse_args(argv, extra_args_provider=extra_args_provider, args_defaults=args_defaults)
    try:
        return _pretrain(args, train_valid_test_datasets_provider, model_provider, model_type,
                         forward_step_func)
    except TrainingError as exc:
        # every rank reaches the same verdict; print once, exit non-zero without a traceback wall
        print_rank_0(f"error: {exc}")
        sys.exit(1)
    except RuntimeError as exc:  # torch's DistBackendError is one
        if not _is_collective_timeout(exc):
            raise
        # only the ranks that waited see it: each prints its own line
        rank = dist.get_rank() if dist.is_initialized() else 0
        first = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__
        print(f"error: rank {rank}: a collective timed out after --distributed-timeout-minutes "
              f"{args.distributed_timeout_minutes:g}: another rank is stuck or dead ({first})",
              flush=True)
        sys.exit(1)


@contextlib.contextmanager
def _params_gathered(model, args):
    """Megatron-LM's save_checkpoint_and_time: with --overlap-param-gather the distributed
    optimizer updates only each rank's shard of the (bf16/fp16) model params and defers their
    all-gather to the next forward's pre-hooks, so at a save the other shards still hold the
    previous iteration's values. disable_forward_pre_hook() runs that all-gather synchronously
    (param_sync=True); the hooks come back after the save. Not under Megatron-FSDP, which saves
    its own shards (Megatron-LM's should_disable_forward_pre_hook)."""
    gather = (args.use_distributed_optimizer and args.overlap_param_gather
              and not args.use_megatron_fsdp)
    if gather:
        for chunk in model:
            chunk.disable_forward_pre_hook()
    try:
        yield
    finally:
        if gather:
            for chunk in model:
                chunk.enable_forward_pre_hook()


def _is_collective_timeout(exc) -> bool:
    text = str(exc).lower()
    return "timed out" in text or "timeout" in text


def _pretrain(args, datasets_provider, model_provider, model_type, forward_step_func):
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from megatron_moe.training.checkpointing import CheckpointError, load_checkpoint
    from megatron_moe.runtime.initialize import initialize_distributed
    from megatron_moe.models.builder import get_model

    start = time.time()
    global_vars.set_args(args)
    from megatron_moe.runtime.dist_signal_handler import ExitConditions

    exit_conditions = ExitConditions(args, start)  # handler first: a notice may come during setup
    from megatron_moe.training import result_validation

    try:   # Megatron-LM: before torch.distributed (it opens the tracker file)
        result_validation.initialize(args)
    except RuntimeError as exc:
        raise TrainingError(f"--result-rejected-tracker-filename: {exc}") from None
    initialize_distributed(args)
    progress = None
    if args.log_progress and args.save:   # Megatron-LM: the line right after initialisation
        from megatron_moe.training.progress_log import ProgressLog

        progress = ProgressLog(args, job_start_s=start)
        progress.job_started()
    if args.save:
        from megatron_moe.compat.checkpoint import prestart_writer

        prestart_writer()  # the checkpoint writer's one-time start (~0.1 s), not in the first save
    _build_tokenizer(args)
    from megatron_moe.training.checkpointing import checkpoint_source

    try:   # --load's checkpoint, else --pretrained-checkpoint's (finetuning)
        source = checkpoint_source(args)
    except CheckpointError as exc:   # it names the flag
        raise TrainingError(str(exc)) from None
    if args.load and args.exit_on_missing_checkpoint and source.iteration is None:
        # Megatron-LM's message; it exits with status 0
        print_rank_0(f" WARNING: no checkpoint under --load {args.load}")
        print_rank_0(">> '--exit-on-missing-checkpoint' set ... exiting. <<")
        dist.barrier()
        exit_conditions.close()
        return dict(run_result(new_history(), 0, 0), exited="--exit-on-missing-checkpoint")
    if source.root:
        from megatron_moe.training.checkpointing import keep_checkpoint_vocab_padding

        try:
            keep_checkpoint_vocab_padding(args)   # resuming at another TP: the trained padding
        except CheckpointError as exc:
            raise TrainingError(f"{source.flag}: {exc}") from None
    print_rank_0(f"> initialized {args.world_size} ranks on {args.distributed_backend}: "
                 f"TP={args.tensor_model_parallel_size} PP={args.pipeline_model_parallel_size} "
                 f"EP={args.expert_model_parallel_size} ETP={args.expert_tensor_parallel_size} "
                 f"DP={args.data_parallel_size} ({time.time() - start:.1f}s)")

    from megatron_moe.training import megatron_logging

    megatron_logging.apply_logging_level(args)   # --logging-level (Megatron's setup_logging)
    timers = megatron_logging.build_timers(args)  # --timing-log-level / --timing-log-option
    model = get_model(model_provider, args, model_type)
    from megatron_moe.models.builder import unwrap as _unwrap

    for chunk in model:  # megatron-core's schedule times its phases through config.timers
        _unwrap(chunk).config.timers = timers
    if args.use_distributed_optimizer:  # its torch-Adam fallback (no TE/apex) saves and resumes
        from megatron_moe.compat.distrib_optimizer import install_torch_adam_bridge

        install_torch_adam_bridge()
    optimizer_config = _optimizer_config(args, OptimizerConfig)
    optimizer_config.timers = timers               # the optimizer's phases (level 1)
    # --disable-gloo-process-groups: megatron-core's optimizer then takes no Gloo group (it needs
    # them only for the legacy dp-zero checkpoint format, not for our fully reshardable one)
    optimizer = get_megatron_optimizer(optimizer_config, model,
                                       use_gloo_process_groups=args.use_gloo_process_groups)
    from megatron_moe.compat.optimizer import fuse_torch_adam

    fuse_torch_adam(optimizer)   # torch's fused Adam kernel on CUDA (without TE or apex)
    from megatron_moe.compat.optimizer import mark_decoupled_lr_groups

    mark_decoupled_lr_groups(optimizer, args.decoupled_lr)   # their own key in checkpoints
    # Megatron-LM's train(): the schedule multiplies each micro-batch loss by the optimizer's
    # loss scale before backward (fp16 dynamic scaling; 1.0 for bf16/fp32), which the
    # optimizer divides out of the grads again
    _unwrap(model[0]).config.grad_scale_func = optimizer.scale_loss
    from megatron_moe.arguments import lr_schedule_steps

    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=args.lr_warmup_init, max_lr=args.lr, min_lr=args.min_lr,
        lr_decay_style=args.lr_decay_style, start_wd=args.start_weight_decay,
        end_wd=args.end_weight_decay, wd_incr_style=args.weight_decay_incr_style,
        lr_wsd_decay_style=args.lr_wsd_decay_style,
        **lr_schedule_steps(args),   # iteration- or sample-based, Megatron's step counts
        use_checkpoint_opt_param_scheduler=args.use_checkpoint_opt_param_scheduler,
        override_opt_param_scheduler=args.override_opt_param_scheduler)
    hooks = TrainingHooks(args, model, optimizer)
    if args.skip_train and not args.no_load_optim:   # Megatron-LM's validate_args
        args.no_load_optim = True
        print_rank_0("WARNING: enabling --no-load-optim when skipping training.")
    from megatron_moe.compat.batch_schedule import init_microbatch_calculator

    init_microbatch_calculator(args)   # the batch per iteration (--rampup-batch-size)

    iteration, consumed_train, consumed_valid, extra = 0, 0, 0, {}
    if source.root is not None:
        try:
            with hooks.checkpoint_io(load=True):  # ssd expert offload: real tensors to load into
                iteration, consumed_train, consumed_valid, extra = load_checkpoint(
                    model, optimizer, scheduler, args)
        except CheckpointError as exc:
            raise TrainingError(f"{source.flag}: {exc}") from None
        hooks.load_state_dict(extra.get("hooks", {}))
    args.iteration = iteration
    args.consumed_train_samples = consumed_train
    # --decrease-batch-size-if-needed: samples of the global batches not run (Megatron-LM's)
    args.skipped_train_samples = extra.get("skipped_train_samples", 0)

    train_ds, valid_ds, test_ds = _build_datasets(args, datasets_provider)
    if args.skip_train:   # Megatron-LM: no training reader; the evaluation sets from their start
        train_ds, consumed_valid = None, 0
    evaluation = args.eval_micro_batch_size
    test_iter = _iterator(args, test_ds, 0, evaluation)   # evaluated once, after training (Megatron-LM)
    if len(model) > 1 and test_iter is not None:
        test_iter = [_iterator(args, test_ds, 0, evaluation) for _ in model]
    train_iter = _iterator(args, train_ds, consumed_train)
    valid_iter = _iterator(args, valid_ds, consumed_valid, evaluation)
    if len(model) > 1:
        # the interleaved schedule takes one iterator per model chunk (Megatron-LM builds one per
        # virtual stage); the chunk that embeds and the chunk that takes the loss each read the
        # same samples in the same order
        train_iter = [_iterator(args, train_ds, consumed_train) for _ in model] if train_iter else None
        valid_iter = ([_iterator(args, valid_ds, consumed_valid, evaluation) for _ in model]
                      if valid_iter else None)
    # Megatron-LM wraps its training readers so an iteration that is re-run reads its batches again
    train_iter = result_validation.wrap_iterator(train_iter)

    if not args.skip_train:
        print_rank_0(f"> training from iteration {iteration} to {args.train_iters} "
                     f"(setup {time.time() - start:.1f}s)")
    trainer = Trainer(args, model, optimizer, scheduler, forward_step_func, hooks, exit_conditions,
                      timers=timers)
    # model FLOPs of every iteration trained so far, this job's and the checkpoint's (Megatron-LM's
    # num_floating_point_operations_so_far: --log-progress's throughputs)
    trainer.flops_so_far = extra.get("num_floating_point_operations_so_far", 0.0)
    if progress is not None:
        progress.flops_at_job_start = trainer.flops_so_far
    trainer.progress = progress
    from megatron_moe.training.checkpointing import finalize_async_save, wait_for_deletion

    try:
        if args.skip_train:
            result = trainer.evaluate_without_training(valid_iter, test_iter, iteration)
        else:
            result = trainer.train(train_iter, valid_iter, iteration, consumed_train, consumed_valid)
            if result["completed"]:   # Megatron-LM: not after an exit condition
                trainer.evaluate_after_training(valid_iter, test_iter, result["iteration"])
        finalize_async_save(blocking=True)  # --async-save: the last checkpoint is complete on exit
        wait_for_deletion()   # --save-retain-interval: the last retired checkpoint is gone
    except CheckpointError as exc:   # a save that failed (a full disk): one line, --save's path
        raise TrainingError(f"--save: {exc}") from None
    finally:
        exit_conditions.close()
        hooks.close()   # also when training raised: e.g. the manual GC turns the collector back on
    if result.get("exit_code") is not None:   # Megatron-LM's sys.exit(exit_code) after train()
        dist.barrier()
        sys.exit(result["exit_code"])
    return result


def _build_tokenizer(args):
    from megatron_moe.data.tokenizers import build_tokenizer, vocab_size_with_padding

    tokenizer = build_tokenizer(args)
    if getattr(args, "padded_vocab_size", None) is None:   # --padded-vocab-size: as given
        args.padded_vocab_size = vocab_size_with_padding(
            tokenizer.vocab_size, args.make_vocab_size_divisible_by, args.tensor_model_parallel_size)
    elif args.padded_vocab_size < tokenizer.vocab_size:
        raise TrainingError(f"--padded-vocab-size ({args.padded_vocab_size}) is smaller than the "
                            f"tokenizer's vocabulary ({tokenizer.vocab_size})")
    global_vars.set_tokenizer(tokenizer)
    return tokenizer


def _optimizer_config(args, config_class):
    from megatron_moe.compat.optimizer import emerging_optimizer_kwargs

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.params_dtype]
    return config_class(
        optimizer=args.optimizer, lr=args.lr, min_lr=args.min_lr, weight_decay=args.weight_decay,
        # --decoupled-lr: megatron-core gives the embedding and output layer their own param group
        decoupled_lr=args.decoupled_lr, decoupled_min_lr=args.decoupled_min_lr,
        adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2, adam_eps=args.adam_eps,
        sgd_momentum=args.sgd_momentum, clip_grad=args.clip_grad, bf16=args.bf16, fp16=args.fp16,
        params_dtype=dtype, loss_scale=args.loss_scale, initial_loss_scale=args.initial_loss_scale,
        min_loss_scale=args.min_loss_scale, loss_scale_window=args.loss_scale_window,
        hysteresis=args.hysteresis,
        use_distributed_optimizer=args.use_distributed_optimizer,
        overlap_param_gather=args.overlap_param_gather,
        log_num_zeros_in_grad=args.log_num_zeros_in_grad,
        apply_wd_to_qk_layernorm=args.apply_wd_to_qk_layernorm, **emerging_optimizer_kwargs(args))


def _build_datasets(args, provider):
    from megatron_moe.data.gpt import train_valid_test_num_samples

    try:
        return provider(train_valid_test_num_samples(args))
    except (FileNotFoundError, ValueError, AssertionError) as exc:
        raise TrainingError(f"--data-path: could not build datasets: {exc}") from None


def _iterator(args, dataset, consumed, micro_batch_size=None):
    """The reader of one split from ``consumed`` samples on, in micro-batches of
    ``micro_batch_size`` (default --micro-batch-size; evaluation's: --eval-micro-batch-size)."""
    from megatron.core import parallel_state

    from megatron_moe.data.sampler import build_data_iterator

    if args.dataloader_type == "external":
        # Megatron-LM passes the provider's objects through as the iterators the schedule reads
        if dataset is not None and not hasattr(dataset, "__next__"):
            raise TrainingError(
                f"--dataloader-type external: the datasets provider returned a "
                f"{type(dataset).__name__}, not an iterator of batches (the GPT/BERT providers "
                f"here build map-style datasets: use --dataloader-type single or cyclic)")
        return dataset
    if dataset is None or len(dataset) == 0:
        return None
    return build_data_iterator(dataset, consumed, micro_batch_size or args.micro_batch_size,
                               parallel_state.get_data_parallel_rank(),
                               parallel_state.get_data_parallel_world_size(), args.num_workers,
                               args.dataloader_type, args.data_sharding)


class TrainingHooks(RunHooks):
    """What acts around a training step: the features' run hooks (megatron_moe/features.py), plus
    the expert-load tracker (telemetry for the log line) and the writers (TensorBoard, W&B)."""

    def __init__(self, args, model, optimizer=None):
        from megatron.core import parallel_state

        from megatron_moe.models.builder import unwrap
        from megatron_moe.moe.telemetry import ExpertLoadTracker

        self.args = args
        self.tracker = None
        if args.num_experts:
            self.tracker = ExpertLoadTracker(args.num_layers, args.num_experts,
                                             args.expert_model_parallel_size,
                                             mtp_num_layers=getattr(args, "mtp_num_layers", None))
            self.tracker.attach([unwrap(m) for m in model])
        super().__init__(args, model, optimizer, tracker=self.tracker)
        self.writer = None
        if dist.get_rank() == dist.get_world_size() - 1:  # the rank with the loss (Megatron's)
            from megatron_moe.training.wandb_writer import build_writer

            if args.tensorboard_dir:
                from torch.utils.tensorboard import SummaryWriter

                self.writer = SummaryWriter(log_dir=args.tensorboard_dir, max_queue=1000)
            self.writer = build_writer(args, self.writer)  # + W&B with --wandb-project
        self.is_last_stage = parallel_state.is_pipeline_last_stage()

    @property
    def balance(self):
        return self.get("balance")

    @property
    def offload(self):
        return self.get("offload")

    def close(self):
        super().close()
        if self.writer is not None:
            self.writer.flush()
            self.writer.close()


class Trainer:
    def __init__(self, args, model, optimizer, scheduler, forward_step_func, hooks,
                 exit_conditions=None, timers=None):
        from megatron.core.pipeline_parallel import get_forward_backward_func

        from megatron_moe.models.builder import unwrap
        from megatron_moe.training import cuda_graph, megatron_logging

        # megatron-core's Timers (Megatron's get_timers()); dummies above --timing-log-level
        self.timers = timers if timers is not None else megatron_logging.build_timers(args)
        self.num_zeros_in_grad = None    # the last step's (--log-num-zeros-in-grad), read at log time

        self.args = args
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.forward_step_func = forward_step_func
        self.hooks = hooks
        # --cuda-graph-impl full_iteration: megatron-core's FullCudaGraphWrapper, as Megatron-LM
        self.forward_backward = cuda_graph.wrap(get_forward_backward_func(), args,
                                                unwrap(model[0]).config)
        global _AGREED_LOSS_NAMES
        _AGREED_LOSS_NAMES = None      # a new run agrees on its loss names once
        self.skipped_iters = 0
        self.nan_iters = 0
        self.flops_so_far = 0.0   # model FLOPs trained so far (the checkpoint's included)
        self.progress = None      # --log-progress's ProgressLog
        if exit_conditions is None:
            from megatron_moe.runtime.dist_signal_handler import ExitConditions

            exit_conditions = ExitConditions(args)
        # --exit-signal-handler / --exit-duration-in-mins: all ranks agree each iteration
        self.exit_conditions = exit_conditions

    # --- one iteration ---------------------------------------------------------------------------
    def train_step(self, data_iterator):
        from megatron.core.num_microbatches_calculator import get_num_microbatches

        from megatron_moe.comm.strict import hot_path
        from megatron_moe.training import result_validation

        args = self.args
        rerun = result_validation.machine()
        # Megatron-LM's train_step: megatron-core's rerun state machine decides whether the
        # forward-backward runs again (a result failed validation: training/result_validation.py)
        while rerun.should_run_forward_backward(data_iterator):
            for chunk in self.model:
                chunk.zero_grad_buffer()
            self.optimizer.zero_grad()
            with hot_path():  # strict device mode: no Python-object collectives (docs/comm.md)
                losses = self.forward_backward(
                    forward_step_func=self.forward_step_func, data_iterator=data_iterator,
                    model=self.model, num_microbatches=get_num_microbatches(),
                    seq_length=args.seq_length, micro_batch_size=args.micro_batch_size,
                    decoder_seq_length=args.seq_length,
                    forward_only=False)   # times 'forward-backward' itself (config.timers)
            result_validation.validate_recorded(args)
        empty_unused_memory(args, level=1)
        should_checkpoint, should_exit, exit_code = rerun.should_checkpoint_and_exit()
        if should_exit:   # no optimizer step: the checkpoint (if any) holds the iteration before
            raise RerunExit(should_checkpoint, exit_code)
        with hot_path():
            self.timers("optimizer", log_level=1).start()
            update_successful, grad_norm, num_zeros = self.optimizer.step()
            self.timers("optimizer").stop()
        self.num_zeros_in_grad = num_zeros
        empty_unused_memory(args, level=2)
        self.hooks.after_optimizer_step(update_successful, grad_norm)   # before the lr moves
        if update_successful:
            self.scheduler.step(increment=running_batch_size())   # samples this step consumed
        else:
            self.skipped_iters += 1
        return reduce_losses(losses), grad_norm, update_successful

    def drop_batch(self, train_iter):
        """Read one iteration's micro-batches from the training reader(s) exactly as a step would
        (only the model chunks on the first or last pipeline stage read data: get_batch)."""
        from megatron.core import parallel_state
        from megatron.core.num_microbatches_calculator import get_num_microbatches

        iterators = train_iter if isinstance(train_iter, list) else [train_iter]
        virtual = len(iterators) > 1
        for vp_stage, data_iterator in enumerate(iterators):
            stage = dict(ignore_virtual=False, vp_stage=vp_stage) if virtual else {}
            if data_iterator is None or not (parallel_state.is_pipeline_first_stage(**stage)
                                             or parallel_state.is_pipeline_last_stage(**stage)):
                continue
            for _ in range(get_num_microbatches()):
                next(data_iterator)

    def evaluate(self, data_iterator):
        args = self.args
        self.hooks.before_evaluate()
        for chunk in self.model:
            chunk.eval()
        # eval forwards must not leak into the training aux-loss and expert-load logs
        saved_aux = _snapshot_moe_tracker()
        if self.hooks.tracker is not None:
            self.hooks.tracker.enabled = False
        totals = {}
        from megatron_moe.training.result_validation import disabled_during_evaluation

        with torch.no_grad(), disabled_during_evaluation():
            for _ in range(args.eval_iters):
                losses = self.forward_backward(
                    forward_step_func=self.forward_step_func, data_iterator=data_iterator,
                    model=self.model, num_microbatches=args.eval_num_microbatches,
                    seq_length=args.seq_length, micro_batch_size=args.eval_micro_batch_size,
                    decoder_seq_length=args.seq_length, forward_only=True)
                empty_unused_memory(args, level=1)
                for key, value in reduce_losses(losses).items():
                    totals[key] = totals.get(key, 0.0) + value / args.eval_iters
        totals = {key: float(value) for key, value in totals.items()}
        for chunk in self.model:
            chunk.train()
        _restore_moe_tracker(saved_aux)
        if self.hooks.tracker is not None:
            self.hooks.tracker.enabled = True
        self.hooks.after_evaluate()
        return totals

    def evaluate_without_training(self, valid_iter, test_iter, iteration):
        """--skip-train (Megatron-LM's pretrain()): no training iteration; the validation and test
        sets are evaluated once at the loaded iteration, as after training, and (as there) not
        written to TensorBoard / W&B."""
        print_rank_0("skipping training (--skip-train is on) ...")
        result = run_result(new_history(), iteration, self.args.consumed_train_samples)
        result.update(self.evaluate_after_training(valid_iter, test_iter, iteration, write=False))
        return result

    def evaluate_after_training(self, valid_iter, test_iter, iteration, write=True):
        """Megatron-LM's pretrain() once training ends (not after an exit condition): --eval-iters
        batches of the validation set (continuing its reader) and of the test set, printed as
        ``validation loss at iteration N on validation set | ...`` / ``... on test set``."""
        out = {}
        for name, data_iterator in (("validation", valid_iter), ("test", test_iter)):
            if data_iterator is not None and self.args.eval_iters > 0:
                out[name] = self.evaluate(data_iterator)
                self._log_eval(f"iteration {iteration} on {name} set", out[name], iteration,
                               write=write)
        return out

    # --- the loop --------------------------------------------------------------------------------
    def train(self, train_iter, valid_iter, iteration, consumed_train, consumed_valid):
        from megatron.core.num_microbatches_calculator import update_num_microbatches

        from megatron_moe.flops import num_floating_point_operations
        from megatron_moe.training import result_validation
        from megatron_moe.training.checkpointing import finalize_async_save, save_checkpoint

        args = self.args
        update_num_microbatches(consumed_train, consistency_check=True)   # a resume mid-ramp
        for chunk in self.model:
            chunk.train()
        history = new_history()
        window = LogWindow()
        # resuming from --save itself: the loaded iteration is on disk already (re-saving it would
        # replace the directory the tracker points at)
        saved_at = iteration if args.load and args.save and \
            os.path.abspath(args.load) == os.path.abspath(args.save) else None
        batch = running_batch_size()   # Megatron's: changes only at a ramp-up step
        if train_iter is None and iteration < args.train_iters:
            raise TrainingError("--data-path: the training split is empty (check --split)")
        last_time = time.time()

        def read_losses():
            """The window's losses to the host in one copy (each log line, each save, the end;
            never per iteration: docs/gpu.md): history, then the NaN check, which therefore stops
            a run at most --log-interval - 1 iterations after the NaN and always before a save."""
            for it, losses in window.read():
                lm_loss = losses.get(_LOSS_KEY)
                history["lm_loss"].append(lm_loss)
                if args.check_for_nan_in_loss and lm_loss is not None and not math.isfinite(lm_loss):
                    self.nan_iters += 1
                    last = f"{args.save} (iteration {saved_at})" if saved_at else "none written this run"
                    raise TrainingError(
                        f"{_LOSS_KEY} is {lm_loss} at iteration {it}; stopping without saving. "
                        f"Last checkpoint: {last}. Lower --lr, raise --clip-grad or check the data; "
                        f"--no-nan-check disables this check")

        def save(it):
            nonlocal saved_at
            if args.save and saved_at != it:
                read_losses()   # a NaN loss is never saved
                t0 = time.time()
                with self.hooks.checkpoint_io(), _params_gathered(self.model, args):
                    save_checkpoint(it, self.model, self.optimizer, self.scheduler, args,
                                    consumed_train, consumed_valid,
                                    {"hooks": self.hooks.state_dict(),
                                     "skipped_train_samples": args.skipped_train_samples,
                                     "num_floating_point_operations_so_far": self.flops_so_far},
                                    train_data_iterator=train_iter)
                saved_at = it
                if self.progress is not None:
                    self.progress.checkpoint_saved(it, self.flops_so_far)
                how = "scheduled async save" if args.async_save else "saved checkpoint"
                print_rank_0(f"  {how} at iteration {it:7d} to {args.save} "
                             f"in {time.time() - t0:.2f}s")

        stop = None   # why the loop ended early (an exit condition), else None
        exit_code = None   # megatron-core's rerun state machine ended the job with this status
        rerun = result_validation.machine()
        if rerun.current_iteration != iteration:   # Megatron-LM's train(): the loaded iteration
            print_rank_0(f"Overwriting rerun_state_machine.current_iteration from "
                         f"{rerun.current_iteration} to {iteration}...")
            rerun.current_iteration = iteration
        while iteration < args.train_iters:
            self.hooks.before_step(iteration)   # --profile: Megatron steps its profiler here
            finalize_async_save(blocking=False)  # --async-save: commit finished writes
            # --rampup-batch-size: this iteration's batch from the samples consumed so far;
            # Megatron-LM saves a checkpoint before the batch changes
            update_num_microbatches(consumed_train, consistency_check=False, verbose=True)
            if running_batch_size() != batch:
                save(iteration)
                batch = running_batch_size()
            update_num_microbatches(consumed_train, consistency_check=True)
            if iteration + 1 in args.iterations_to_skip:
                # Megatron-LM: the iteration's batch is read and dropped; no step, no LR step, no
                # log line; its samples count as consumed and skipped
                self.drop_batch(train_iter)
                iteration += 1
                consumed_train += batch
                args.skipped_train_samples += batch
                args.iteration, args.consumed_train_samples = iteration, consumed_train
                print_rank_0(f" skipped iteration {iteration} (--iterations-to-skip)")
                continue
            try:
                loss_dict, grad_norm, ok = self.train_step(train_iter)
            except RerunExit as request:   # Megatron-LM: checkpoint (the iteration before), exit
                if request.should_checkpoint:
                    save(iteration)
                exit_code = request.exit_code
                stop = f"result validation: exiting with status {exit_code} (iteration {iteration + 1})"
                print_rank_0(stop)
                break
            iteration += 1
            consumed_train += batch
            self.flops_so_far += num_floating_point_operations(args, batch)
            window.samples += batch
            args.skipped_train_samples += current_global_batch_size() - batch
            args.iteration, args.consumed_train_samples = iteration, consumed_train
            self.hooks.after_step(iteration)
            interval = args.check_weight_hash_across_dp_replicas_interval
            if interval is not None and iteration % interval == 0:
                self.check_weight_hashes(iteration)
            lr = logged_lr(self.optimizer, self.scheduler)
            window.add(iteration, loss_dict, ok)   # the losses stay on the device until read
            history["iteration"].append(iteration)
            history["lr"].append(lr)
            history["grad_norm"].append(float(grad_norm) if grad_norm is not None else None)

            if iteration % args.log_interval == 0:
                read_losses()
                now = time.time()
                elapsed = (now - last_time) / window.count
                last_time = now
                self._log(iteration, consumed_train, elapsed, lr, window, grad_norm, batch)
                window = LogWindow()
            if valid_iter is not None and args.eval_interval and iteration % args.eval_interval == 0:
                eval_losses = self.evaluate(valid_iter)
                consumed_valid += args.eval_iters * args.eval_global_batch_size
                self._log_eval(f"iteration {iteration}", eval_losses, iteration)
            if args.save_interval and iteration % args.save_interval == 0:
                save(iteration)
            stop = self.exit_conditions.check()  # one all-reduce, the same answer on every rank
            if stop is None and args.exit_interval and iteration % args.exit_interval == 0:
                stop = f"exiting at iteration {iteration}"
            if stop is not None:
                save(iteration)
                print_rank_0(f"{stop} (iteration {iteration})" if "iteration" not in stop else stop)
                break
        read_losses()
        if args.save and iteration == args.train_iters:
            save(iteration)
        return dict(run_result(history, iteration, consumed_train), completed=stop is None,
                    exit_code=exit_code)

    def check_weight_hashes(self, iteration):
        """--check-weight-hash-across-dp-replicas-interval (Megatron's train loop): every
        data-parallel replica holds bit-identical parameters, or training stops."""
        from megatron.core.utils import check_param_hashes_across_dp_replicas

        if not check_param_hashes_across_dp_replicas(self.model, cross_check=True):
            raise TrainingError(f"parameter hashes differ across data-parallel replicas at "
                                f"iteration {iteration} (--check-weight-hash-across-dp-replicas-interval)")
        dist.barrier()
        print_rank_0(f">>> Weight hashes match after {iteration} iterations...")

    # --- logging ---------------------------------------------------------------------------------
    def _log(self, iteration, consumed, elapsed_s, lr, window, grad_norm, batch_size):
        """Megatron-LM's training_log line, byte for byte, then our MoE lines."""
        from megatron.core.num_microbatches_calculator import get_num_microbatches

        from megatron_moe.compat.moe_metrics import report_moe_metrics  # tracker API per version

        args = self.args
        writer = self.hooks.writer
        losses = window.averages()
        num_microbatches = get_num_microbatches()   # the last step's (Megatron's training_log)
        if args.num_experts:
            # The tracker summed every micro-batch's aux losses since the last log line.
            moe_losses = {}
            report_moe_metrics(loss_scale=1.0 / num_microbatches, iteration=iteration,
                               writer=writer, total_loss_dict=moe_losses,
                               per_layer_logging=args.moe_per_layer_logging, force_initialize=True,
                               track_names=moe_track_names(args), num_layers=args.num_layers,
                               moe_layer_freq=args.moe_layer_freq,
                               mtp_num_layers=getattr(args, "mtp_num_layers", None))
            for name, value in moe_losses.items():
                losses[name] = float(value) / window.count
        if getattr(args, "mtp_num_layers", None):
            # megatron-core's MTP tracker summed each micro-batch's 'mtp_N loss' since the last
            # line; Megatron-LM's training_log scales it by 1/num_microbatches, per iteration
            from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

            mtp_losses = {}
            MTPLossLoggingHelper.track_mtp_metrics(1.0 / num_microbatches, iteration, None,
                                                   None, mtp_losses)
            for name, value in mtp_losses.items():
                losses[name] = float(value) / window.count
        # the window's samples (--rampup-batch-size: its iterations' batches differ)
        tokens_per_s = window.samples * args.seq_length / window.count / elapsed_s \
            if elapsed_s > 0 else 0.0
        line = f" [{datetime.now().strftime('%Y-%m-%d %H:%M:%S.%f')}]"
        line += f" iteration {iteration:8d}/{args.train_iters:8d} |"
        line += f" consumed samples: {consumed:12d} |"
        if args.skipped_train_samples > 0:   # --decrease-batch-size-if-needed
            line += f" skipped samples: {args.skipped_train_samples:12d} |"
        line += f" elapsed time per iteration (ms): {elapsed_s * 1000.0:.1f} |"
        if args.log_throughput:  # Megatron-LM's field, from the one FLOP count (megatron_moe/flops.py)
            from megatron_moe.flops import num_floating_point_operations

            flops = num_floating_point_operations(args, window.samples) / window.count
            tflops = flops / elapsed_s / 1e12 / args.world_size if elapsed_s > 0 else 0.0
            line += f" throughput per GPU (TFLOP/s/GPU): {tflops:.1f} |"
        line += f" learning rate: {lr:.6E} |"
        line += f" global batch size: {batch_size:5d} |"
        for key, value in losses.items():
            line += f" {key}: {value:.6E} |"
        line += f" loss scale: {self.optimizer.get_loss_scale().item():.1f} |"
        if grad_norm is not None:
            line += f" grad norm: {float(grad_norm):.3f} |"
        scalars = self._megatron_log_scalars()
        if "num-zeros" in scalars:
            line += f" num zeros: {scalars['num-zeros']} |"
        if "params-norm" in scalars:
            line += f" params norm: {scalars['params-norm']:.3f} |"
        line += f" number of skipped iterations: {window.skipped:3d} |"
        line += f" number of nan iterations: {window.nan:3d} |"
        line += f" tokens per second: {tokens_per_s:.1f} |"
        loads = self.hooks.tracker.collect() if self.hooks.tracker is not None else []
        extra = self.hooks.metrics()
        print_rank_last(line)
        for line in self.hooks.log_lines():   # the features' own lines (--moe-expert-offload)
            print_rank_last(line)
        from megatron_moe.comm import link as ep_link

        if ep_link.active():                                    # --moe-ep-link-gbps
            st, n = ep_link.stats(), max(1, window.count)
            ep_link.reset_stats()
            print_rank_last(f" [moe] ep link (emulated) | busy sending ms per iteration: {st['busy_s'] * 1e3 / n:.1f} |"
                            f" blocked on transfers ms per iteration: {st['exposed_s'] * 1e3 / n:.1f} |"
                            f" all-to-all MB: {st['a2a_bytes'] / 1e6 / n:.3f} | p2p MB: {st['p2p_bytes'] / 1e6 / n:.3f} |")
        if args.log_expert_load:
            for load in loads:
                print_rank_last(
                    f" [moe] layer {load.layer:3d} | expert load max/mean: "
                    f"{load.expert_max_over_mean:.3f} | EP-rank load max/mean: "
                    f"{load.rank_max_over_mean:.3f} |"
                    + (f" tokens per expert: {load.tokens_per_expert} |"
                       if len(load.tokens_per_expert) <= 16 else "")
                    + (f" cross-node {load.cross_node_fraction:.2f} |"
                       if load.cross_node_fraction is not None else ""))
            if extra:
                print_rank_last(" [moe] " + " | ".join(f"{k}: {v}" if isinstance(v, str) else f"{k}: {v:.4g}"
                                                       for k, v in extra.items()) + " |")
        if writer is not None:
            writer.add_scalar("learning-rate", lr, iteration)
            if args.skipped_train_samples > 0:
                writer.add_scalar("skipped-train-samples", args.skipped_train_samples, iteration)
            writer.add_scalar("tokens-per-second", tokens_per_s, iteration)
            writer.add_scalar("iteration-time", elapsed_s, iteration)
            for key, value in losses.items():
                writer.add_scalar(key, value, iteration)
            if grad_norm is not None:
                writer.add_scalar("grad-norm", float(grad_norm), iteration)
            for load in loads:
                writer.add_scalar(f"moe/expert_load_max_over_mean_layer_{load.layer}",
                                  load.expert_max_over_mean, iteration)
                writer.add_scalar(f"moe/ep_rank_load_max_over_mean_layer_{load.layer}",
                                  load.rank_max_over_mean, iteration)
                if load.cross_node_fraction is not None:
                    writer.add_scalar(f"moe/cross_node_fraction_layer_{load.layer}",
                                      load.cross_node_fraction, iteration)
            for key, value in extra.items():
                if not isinstance(value, str):          # balance/auto: the policy names, log line only
                    writer.add_scalar(f"moe/{key}", value, iteration)
            for key, value in scalars.items():          # Megatron's names: num-zeros, params-norm, mem-*
                writer.add_scalar(key, value, iteration)
        from megatron_moe.training import megatron_logging

        megatron_logging.write_timers(self.timers, args, writer, iteration)

    def _megatron_log_scalars(self) -> dict:
        """--log-num-zeros-in-grad, --log-params-norm, --log-memory-to-tensorboard: read once per
        log interval (params norm is one all-reduce over the model-parallel groups, every rank)."""
        from megatron_moe.training import megatron_logging

        args, out = self.args, {}
        if args.log_num_zeros_in_grad and self.num_zeros_in_grad is not None:
            out["num-zeros"] = self.num_zeros_in_grad
        if args.log_params_norm:
            out["params-norm"] = megatron_logging.params_l2_norm(self.model)
        if args.log_memory_to_tensorboard:
            out.update(megatron_logging.memory_scalars())
        return out

    def _log_eval(self, prefix, losses, iteration, write=True):
        parts = []
        for key, value in losses.items():
            parts.append(f"{key} value: {value:.6E}")
            parts.append(f"{key} PPL: {math.exp(min(20.0, value)):.6E}")
            if write and self.hooks.writer is not None:
                self.hooks.writer.add_scalar(f"{key} validation", value, iteration)
                if self.args.log_validation_ppl_to_tensorboard:
                    from megatron_moe.training.megatron_logging import validation_ppl

                    self.hooks.writer.add_scalar(f"{key} validation ppl", validation_ppl(value),
                                                 iteration)
        line = f" validation loss at {prefix} | " + " | ".join(parts) + " |"
        bar = "-" * len(line)
        print_rank_last(f"{bar}\n{line}\n{bar}")


def empty_unused_memory(args, level: int):
    """--empty-unused-memory-level: at Megatron-LM's points (level 1: after each forward-backward
    and evaluation step; 2: also after each optimizer step) the CUDA caching allocator hands its
    unused blocks back to the device, for jobs that share it or fragment it. No-op on a CPU."""
    if args.empty_unused_memory_level >= level:
        torch.cuda.empty_cache()


def new_history() -> dict:
    """Per trained iteration: its number, lm loss, learning rate and grad norm (pretrain()'s
    result, for tests and tools)."""
    return {"iteration": [], "lm_loss": [], "lr": [], "grad_norm": []}


def run_result(history, iteration, consumed_train) -> dict:
    """What pretrain() returns: the history, the last iteration, the samples consumed."""
    return {"history": history, "iteration": iteration, "consumed_train_samples": consumed_train}


class LogWindow:
    """The iterations between two log lines: their losses stay on the device until ``read()``, which
    brings them to the host in one copy and sums them there (the sums Megatron's log line prints)."""

    def __init__(self):
        self.sums, self.count, self.skipped, self.nan = {}, 0, 0, 0
        self.samples = 0    # training samples its iterations consumed
        self.pending = []   # (iteration, {name: 0-dim device tensor}) not read yet

    def add(self, iteration, loss_dict, update_successful):
        self.count += 1
        if not update_successful:
            self.skipped += 1
        self.pending.append((iteration, loss_dict))

    def read(self):
        """The pending iterations' losses as host floats, [(iteration, {name: float})], summed
        into the window (non-finite values counted as nan iterations instead)."""
        tensors = [v.reshape(()) for _, d in self.pending for v in d.values() if torch.is_tensor(v)]
        host = iter(torch.stack(tensors).tolist() if tensors else [])   # the one device-to-host copy
        out = [(it, {k: next(host) if torch.is_tensor(v) else float(v) for k, v in d.items()})
               for it, d in self.pending]
        self.pending = []
        for _, loss_dict in out:
            for key, value in loss_dict.items():
                if not math.isfinite(value):
                    self.nan += 1
                    continue
                self.sums[key] = self.sums.get(key, 0.0) + value
        return out

    def averages(self):
        return {k: v / self.count for k, v in self.sums.items()}


def running_batch_size() -> int:
    """The global batch the current step runs (megatron-core's calculator: --global-batch-size,
    or the ramp-up's current batch)."""
    from megatron.core.num_microbatches_calculator import get_current_running_global_batch_size

    return get_current_running_global_batch_size()


def current_global_batch_size() -> int:
    """The global batch asked for this step (--global-batch-size or the ramp-up's); the running
    batch is smaller with --decrease-batch-size-if-needed."""
    from megatron.core.num_microbatches_calculator import get_current_global_batch_size

    return get_current_global_batch_size()


def logged_lr(optimizer, scheduler) -> float:
    """The log line's learning rate: megatron-core's canonical one (the default-schedule param
    groups', not --decoupled-lr's), as Megatron-LM's training_log reads it."""
    from megatron.core.optimizer_param_scheduler import get_canonical_lr_for_logging

    lr = get_canonical_lr_for_logging(optimizer.param_groups)
    return lr if lr is not None else scheduler.get_lr(optimizer.param_groups[0])


def reduce_losses(losses_reduced) -> dict:
    """Average each reported loss over micro-batches and data-parallel ranks; same on every rank.

    Only the last pipeline stage has losses; a world all-reduce of (sum, count) pairs gives every
    rank the value, so all ranks agree on NaN checks and on what is logged. The values stay on the
    data's device (0-dim float64 tensors): the training loop reads them on the host once per log
    interval (``LogWindow.read``), not once per iteration (docs/gpu.md, host syncs).
    """
    from megatron.core import parallel_state

    keys = sorted({k for d in losses_reduced or [] for k in d}) if losses_reduced else []
    if not keys and parallel_state.get_pipeline_model_parallel_world_size() == 1:
        return {}   # no micro-batch reported a loss (every rank is a last stage)
    names = _agree_on_loss_names(keys)
    device = _data_device()
    values = torch.zeros(2 * len(names), dtype=torch.float64, device=device)
    if parallel_state.is_pipeline_last_stage() and parallel_state.get_tensor_model_parallel_rank() == 0:
        for i, name in enumerate(names):
            for d in losses_reduced or []:
                if name in d:
                    value = torch.as_tensor(d[name], device=device)
                    if value.numel() == 2:
                        # --calculate-per-token-loss: (loss sum, tokens), Megatron's reporting pair
                        values[2 * i] += value[0].to(torch.float64)
                        values[2 * i + 1] += value[1].to(torch.float64)
                    else:
                        # one micro-batch at a time, in float64: the sum the host computed before
                        values[2 * i] += value.to(torch.float64).reshape(())
                        values[2 * i + 1] += 1
    if dist.is_initialized():
        dist.all_reduce(values)
    # every agreed name was reported by the last stage, so its count is > 0
    return {name: values[2 * i] / values[2 * i + 1] for i, name in enumerate(names)}


def _data_device():
    # the data's device (NCCL needs device tensors); on a CPU build the shims answer cpu
    return torch.cuda.current_device() if torch.cuda.is_available() else torch.device("cpu")


def _agree_on_loss_names(keys):
    """The loss names every rank reduces: only the last pipeline stage knows them (BERT has two)."""
    from megatron.core import parallel_state

    if not dist.is_initialized() or parallel_state.get_pipeline_model_parallel_world_size() == 1:
        return keys or [_LOSS_KEY]
    global _AGREED_LOSS_NAMES
    if _AGREED_LOSS_NAMES is None:
        # once per run: the loss function's names do not change, and a Python-object collective
        # (pickle + host round trip) has no place in every step (strict device mode, docs/comm.md)
        names = [keys]
        dist.broadcast_object_list(names, src=dist.get_world_size() - 1)
        _AGREED_LOSS_NAMES = names[0] or [_LOSS_KEY]
    return _AGREED_LOSS_NAMES


_AGREED_LOSS_NAMES = None


def moe_track_names(args):
    """The aux-loss names megatron-core records, as Megatron-LM's training_log lists them."""
    names = []
    balancing = args.moe_router_load_balancing_type
    if isinstance(balancing, str):  # one type (not a substring test: "aux_loss" in "seq_aux_loss")
        balancing = [balancing]
    if "aux_loss" in balancing:
        names.append("load_balancing_loss")
    if "seq_aux_loss" in balancing:
        names.append("seq_load_balancing_loss")
    if "global_aux_loss" in balancing:
        names.append("global_load_balancing_loss")
    if args.moe_z_loss_coeff is not None:
        names.append("z_loss")
    if getattr(args, "moe_router_topology", "none") == "ta_loss" and \
            getattr(args, "moe_topology_loss_coeff", 0) > 0:
        names.append("topology_loss")  # megatron_moe/moe/topo_router.py
    return names


def _snapshot_moe_tracker():
    from megatron_moe.compat.moe_metrics import moe_metric_values

    return {k: v.clone() for k, v in moe_metric_values().items()}


def _restore_moe_tracker(snapshot):
    from megatron_moe.compat.moe_metrics import moe_metric_values

    for name, values in moe_metric_values().items():
        if name in snapshot:
            values.copy_(snapshot[name])
        else:
            values.zero_()

