"""Rank functions for tests/test_ddp_schedule_flags.py (spawned by run_distributed). ``mutate``
breaks the feature inside the spawned rank; the test expects that run to fail its assertions."""


def _ignoring_ddp_field(field, value):
    """models.builder's DistributedDataParallelConfig with ``field`` forced to ``value`` (the
    flag not passed on); returns a restore function."""
    from megatron_moe.models import builder

    real = builder.DistributedDataParallelConfig

    def forced(**kw):
        kw[field] = value
        return real(**kw)

    builder.DistributedDataParallelConfig = forced
    return lambda: setattr(builder, "DistributedDataParallelConfig", real)


def train_main_grads(rank, world_size, argv, mutate=None):
    """pretrain(); returns (losses, [main_grad dtypes after each step], main_grad adds by the
    grouped experts' backward, gradient all-reduces run with ReduceOp.AVG). ``mutate``:
    'bf16-ignored' (DDP keeps fp32 grads), 'average-ignored' (DDP scales then sums, the default)."""
    import torch.distributed as dist

    from megatron_moe.models.builder import unwrap
    from megatron_moe.moe.grouped_experts import GroupedSequentialMLP
    from tests._train_cases import pretrain_with_step

    restore = lambda: None   # noqa: E731
    if mutate == "bf16-ignored":
        restore = _ignoring_ddp_field("grad_reduce_in_fp32", True)
    if mutate == "average-ignored":
        restore = _ignoring_ddp_field("average_in_collective", False)
    averaged, dtypes = [0], []
    all_reduce = dist.all_reduce

    def counting_all_reduce(tensor, op=dist.ReduceOp.SUM, *a, **k):
        # a gradient bucket, not a loss or a norm (those are a few elements)
        averaged[0] += op == dist.ReduceOp.AVG and tensor.numel() > 1000
        return all_reduce(tensor, op, *a, **k)

    def wrap(step):
        def train_step(self, data_iterator):
            out = step(self, data_iterator)
            dtypes.append(sorted({str(p.main_grad.dtype) for chunk in self.model
                                  for p in unwrap(chunk).parameters()
                                  if getattr(p, "main_grad", None) is not None}))
            return out
        return train_step

    dist.all_reduce = counting_all_reduce
    adds_before = GroupedSequentialMLP.wgrads_into_main_grad
    try:
        losses = pretrain_with_step(argv, wrap)["history"]["lm_loss"]
    finally:
        dist.all_reduce = all_reduce
        restore()
    return losses, dtypes, GroupedSequentialMLP.wgrads_into_main_grad - adds_before, averaged[0]


def train_interleaved(rank, world_size, argv, mutate=None):
    """pretrain() with megatron-core's interleaved schedule watched: returns (losses, [the
    micro-batch group size each get_schedule_table call got], [the model config's
    overlap_p2p_comm_warmup_flush at each step]). ``mutate``: 'group-ignored' (the config keeps
    its default group), 'flush-ignored' (the config never gets the warmup/flush overlap)."""
    from megatron.core.pipeline_parallel import schedules

    from megatron_moe.models import builder
    from tests._train_cases import pretrain_with_step

    groups, flush = [], []
    table = schedules.get_schedule_table

    def recording_table(num_microbatches, num_model_chunks, group):
        groups.append(group)
        return table(num_microbatches, num_model_chunks, group)

    def wrap(step):
        def train_step(self, data_iterator):
            flush.append(builder.unwrap(self.model[0]).config.overlap_p2p_comm_warmup_flush)
            return step(self, data_iterator)
        return train_step

    config_from_args = builder.transformer_config_from_args

    def mutated_config(args, *a, **k):
        field = {"group-ignored": "microbatch_group_size_per_vp_stage",
                 "flush-ignored": "overlap_p2p_comm_warmup_flush"}[mutate]
        saved = getattr(args, field)
        setattr(args, field, {"group-ignored": None, "flush-ignored": False}[mutate])
        try:
            return config_from_args(args, *a, **k)
        finally:
            setattr(args, field, saved)

    schedules.get_schedule_table = recording_table
    if mutate:
        builder.transformer_config_from_args = mutated_config
    try:
        losses = pretrain_with_step(argv, wrap)["history"]["lm_loss"]
    finally:
        schedules.get_schedule_table = table
        builder.transformer_config_from_args = config_from_args
    return losses, groups, flush


def train_buckets(rank, world_size, argv, mutate=None):
    """pretrain(); returns (losses, gradient buckets per DDP buffer of the first chunk, the largest
    bucket's elements, gradient all-reduces per step). ``mutate``: 'bucket-size-ignored' (DDP gets
    no bucket size: megatron-core's default, one bucket at this size)."""
    import torch.distributed as dist

    from tests._train_cases import pretrain_with_step

    restore = lambda: None   # noqa: E731
    if mutate == "bucket-size-ignored":
        restore = _ignoring_ddp_field("bucket_size", None)
    reduces, buckets = [0], []
    all_reduce = dist.all_reduce

    def counting_all_reduce(tensor, *a, **k):
        reduces[0] += tensor.numel() > 100     # a gradient bucket, not a loss or a norm
        return all_reduce(tensor, *a, **k)

    def wrap(step):
        def train_step(self, data_iterator):
            if not buckets:
                ddp = self.model[0]
                buffers = list(ddp.buffers) + list(getattr(ddp, "expert_parallel_buffers", []))
                buckets.extend(b.grad_data.numel() for buf in buffers for b in buf.buckets)
            before = reduces[0]
            out = step(self, data_iterator)
            per_step.append(reduces[0] - before)
            return out
        return train_step

    per_step = []
    dist.all_reduce = counting_all_reduce
    try:
        losses = pretrain_with_step(argv, wrap)["history"]["lm_loss"]
    finally:
        dist.all_reduce = all_reduce
        restore()
    return losses, len(buckets), max(buckets), per_step


def train_reduce_scatter_fp32(rank, world_size, argv, mutate=None):
    """pretrain(); returns (losses, calls of megatron-core's reduce_scatter_with_fp32_accumulation,
    main_grad dtypes). ``mutate``: 'rs-fp32-ignored' (DDP never gets the flag)."""
    from megatron.core.distributed import param_and_grad_buffer as pgb

    from megatron_moe.models.builder import unwrap
    from tests._train_cases import pretrain_with_step

    restore = lambda: None   # noqa: E731
    if mutate == "rs-fp32-ignored":
        restore = _ignoring_ddp_field("reduce_scatter_with_fp32_accumulation", False)
    calls, dtypes = [0], set()
    real = pgb.reduce_scatter_with_fp32_accumulation

    def counted(*a, **k):
        calls[0] += 1
        return real(*a, **k)

    def wrap(step):
        def train_step(self, data_iterator):
            out = step(self, data_iterator)
            dtypes.update(str(p.main_grad.dtype) for chunk in self.model
                          for p in unwrap(chunk).parameters()
                          if getattr(p, "main_grad", None) is not None)
            return out
        return train_step

    pgb.reduce_scatter_with_fp32_accumulation = counted   # DDP binds it when built
    try:
        losses = pretrain_with_step(argv, wrap)["history"]["lm_loss"]
    finally:
        pgb.reduce_scatter_with_fp32_accumulation = real
        restore()
    return losses, calls[0], sorted(dtypes)


def evaluate_with_late_receiver(rank, world_size, argv, marker, gated_recv, mutate=None):
    """pretrain() (2 pipeline ranks, interleaved, --overlap-p2p-communication-warmup-flush) with
    the next stage late for its last input in the first evaluation: rank 1 posts its
    ``gated_recv``-th receive of that forward-only schedule only once rank 0 has waited on or
    dropped every send it issued there (rank 0 writes the file ``marker`` then). On gloo a send
    dropped before its receive is posted is lost, so rank 1 then hangs unless the send was kept.
    Returns (losses, sends compat completed after a schedule, receives gated).
    ``mutate``: 'sends-dropped' (compat/cpu.py's pipeline-send shim undone)."""
    import os
    import time

    import torch.distributed as dist
    from megatron.core.pipeline_parallel import p2p_communication, schedules

    from megatron_moe.compat import cpu
    from megatron_moe.training import loop
    from tests._train_cases import pretrain_with_step

    if mutate == "sends-dropped":
        p2p_communication._p2p_ops = p2p_communication._p2p_ops.__wrapped__
        schedules.forward_backward_pipelining_with_interleaving = (
            schedules.forward_backward_pipelining_with_interleaving.__wrapped__)
    first_eval, gated, outstanding = [None], [0], [0]
    received = [0]
    isend, irecv, evaluate = dist.isend, dist.irecv, loop.Trainer.evaluate

    def released():   # rank 0: a send of the first evaluation waited on or dropped
        outstanding[0] -= 1
        if outstanding[0] == 0:
            with open(marker, "w"):
                pass

    class WatchedSend:
        def __init__(self, work):
            self.work, self.done = work, False

        def wait(self, *a, **k):
            if not self.done:
                self.done = True
                released()
            return self.work.wait(*a, **k)

        def __del__(self):
            if not self.done:
                self.done, self.work = True, None   # gloo's handle goes first, then the marker
                released()

    def watched_isend(*a, **k):
        work = isend(*a, **k)
        if not (first_eval[0] and rank == 0):
            return work
        outstanding[0] += 1
        return WatchedSend(work)

    def late_irecv(*a, **k):
        if first_eval[0] and rank == 1:
            received[0] += 1
            if received[0] == gated_recv:
                gated[0] += 1
                deadline = time.monotonic() + 120
                while not os.path.exists(marker):
                    assert time.monotonic() < deadline, "rank 0 never let go of its sends"
                    time.sleep(0.01)
        return irecv(*a, **k)

    def first_evaluation_watched(self, *a, **k):
        first_eval[0] = first_eval[0] is None
        try:
            return evaluate(self, *a, **k)
        finally:
            first_eval[0] = False

    dist.isend, dist.irecv = watched_isend, late_irecv
    loop.Trainer.evaluate = first_evaluation_watched
    before = cpu.PIPELINE_SENDS_COMPLETED_AFTER_SCHEDULE[0]
    try:
        losses = pretrain_with_step(argv, lambda step: step)["history"]["lm_loss"]
    finally:
        dist.isend, dist.irecv, loop.Trainer.evaluate = isend, irecv, evaluate
    return losses, cpu.PIPELINE_SENDS_COMPLETED_AFTER_SCHEDULE[0] - before, gated[0]
