"""Spawned-rank body for tests/test_iteration_ops.py: aten ops per training iteration of the real
pretrain() loop (1 rank, bf16, grouped experts): forward, backward, DDP's gradient bookkeeping,
the gradient norm and clipping, the optimizer step and the main -> model parameter copy."""


# ops that launch no kernel on a GPU: views and metadata (``.data`` / ``detach`` per parameter in
# megatron-core's optimizer), and host scalar reads (torch Adam's ``step`` counters live on the
# host; reads of device values are counted by tests/test_host_syncs.py and test_multi_tensor.py)
NO_KERNEL = {"detach", "alias", "view", "_unsafe_view", "as_strided", "t", "transpose", "permute",
             "unsqueeze", "squeeze", "expand", "select", "slice", "split", "split_with_sizes",
             "unbind", "_reshape_alias", "reshape", "lift_fresh", "_local_scalar_dense"}


def count(rank, world, argv, mutate=None):
    import collections

    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from megatron_moe.compat import multi_tensor
    from tests._train_cases import pretrain_with_step

    # on CUDA torch's Adam takes its foreach path by default; on the CPU its per-tensor loop:
    # foreach here, as on the GPU (the count is then what a GPU launches, at the op level)
    orig_adam = torch.optim.AdamW.__init__

    def adam_init(self, *args, **kwargs):
        kwargs.setdefault("foreach", True)
        orig_adam(self, *args, **kwargs)
    torch.optim.AdamW.__init__ = adam_init
    if mutate == "mcore_fallbacks":   # megatron-core's no-apex norm, scale and copy loops
        multi_tensor.install = lambda: []

    ops = collections.Counter()
    by_op = collections.Counter()
    state = {"it": 0}

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            if name not in NO_KERNEL:
                ops[state["it"]] += 1
                if state["it"] == 2:
                    by_op[name] += 1
            return func(*args, **(kwargs or {}))

    def counted_steps(step):
        def counted(self, data_iterator):
            state["it"] += 1
            with Count():
                return step(self, data_iterator)
        return counted

    pretrain_with_step(argv, counted_steps)
    return dict(ops, by_op=dict(by_op))
