"""Rank functions for tests/test_profiling_flags.py (spawned by run_distributed). ``mutate``
breaks the feature inside the spawned rank; the test expects that run to fail its assertions."""


def train_marking_iterations(rank, world_size, argv, mutate=None):
    """pretrain() with each training step inside a torch.profiler.record_function named
    'megatron_moe_test_iteration_<N>' (N: the iteration the step trains, 1-based), so a trace
    shows which iterations it recorded. Returns the lm losses. ``mutate``: 'never-stepped' (the
    profiler started but never stepped), 'all-ranks' (--profile-ranks ignored)."""
    import torch

    from megatron_moe.training import profiling
    from tests._train_cases import pretrain_with_step

    done = [0]

    def wrap(step):
        def train_step(self, data_iterator):
            done[0] += 1
            with torch.profiler.record_function(f"megatron_moe_test_iteration_{done[0]}"):
                return step(self, data_iterator)
        return train_step

    before_step, profiled_rank = profiling.Profiler.before_step, profiling._profiled_rank
    if mutate == "never-stepped":
        def start_only(self, iteration):
            if self.prof is None:
                self._start_torch_profiler()
        profiling.Profiler.before_step = start_only
    if mutate == "all-ranks":
        profiling._profiled_rank = lambda args: True
    try:
        return pretrain_with_step(argv, wrap)["history"]["lm_loss"]
    finally:
        profiling.Profiler.before_step, profiling._profiled_rank = before_step, profiled_rank


def train_recording_memory(rank, world_size, argv, mutate=None):
    """pretrain() with --record-memory-history on a CPU: torch's CUDA allocator calls replaced by
    recorders (and parse-time's CUDA check by True). Returns [('record', kwargs) | ('dump', path,
    iteration)] in order. ``mutate``: 'dump-every-step' (the log interval ignored)."""
    import torch

    from megatron_moe.training import profiling

    calls, done = [], [0]
    memory = torch.cuda.memory
    real = memory._record_memory_history, memory._dump_snapshot, profiling._cuda_available
    memory._record_memory_history = lambda *a, **k: calls.append(("record", k))
    memory._dump_snapshot = lambda path: calls.append(("dump", path, done[0]))
    profiling._cuda_available = lambda: True
    after_step = profiling.MemoryHistory.after_step
    if mutate == "dump-every-step":
        profiling.MemoryHistory.after_step = lambda self, it: memory._dump_snapshot(
            profiling.snapshot_path(self.args, rank))
    try:
        _pretrain_counting_steps(argv, done)
    finally:
        memory._record_memory_history, memory._dump_snapshot, profiling._cuda_available = real
        profiling.MemoryHistory.after_step = after_step
    return calls


def train_recording_nvtx(rank, world_size, argv, mutate=None):
    """pretrain() with --nvtx-ranges on a CPU: torch.cuda.nvtx's push/pop replaced by recorders
    (and parse-time's CUDA check by True). Returns [(iteration being trained, 1-based, 'push'
    message | 'pop')] in order. ``mutate``: 'never-enabled' (megatron-core's switch not turned
    on)."""
    import torch

    from megatron_moe.training import profiling

    calls, done = [], [0]
    nvtx = torch.cuda.nvtx
    real = nvtx.range_push, nvtx.range_pop, profiling._cuda_available
    nvtx.range_push = lambda msg: calls.append((done[0], msg))
    nvtx.range_pop = lambda: calls.append((done[0], "pop"))
    profiling._cuda_available = lambda: True
    configure = profiling.configure_nvtx_profiling
    if mutate == "never-enabled":
        profiling.configure_nvtx_profiling = lambda enabled: None
    try:
        _pretrain_counting_steps(argv, done)
    finally:
        nvtx.range_push, nvtx.range_pop, profiling._cuda_available = real
        profiling.configure_nvtx_profiling = configure
    return calls


def _pretrain_counting_steps(argv, done):
    """pretrain() with ``done[0]`` the number of training steps begun (the iteration being
    trained, 1-based, while it runs)."""
    from tests._train_cases import pretrain_with_step

    def wrap(step):
        def counted(self, data_iterator):
            done[0] += 1
            return step(self, data_iterator)
        return counted

    return pretrain_with_step(argv, wrap)
