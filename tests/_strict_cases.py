"""Spawned-rank body for tests/test_strict_devices.py: deliberate violations of the strict device
rules (megatron_moe/comm/strict.py) and the calls that must pass."""

from __future__ import annotations

import torch
import torch.distributed as dist

# The hierarchical all-to-all's count exchange as it was before issue 14 (host count tensors),
# replayed as production code: the strict mode judges no-device factories in megatron_moe only.
_OLD_HIERARCHICAL_COUNTS = '''
def exchange_counts(in_splits, N, M, group):
    ins = torch.tensor(in_splits, dtype=torch.long).view(N, M)
    cnt_recv = torch.empty((M, N), dtype=torch.long)
    dist.all_to_all_single(cnt_recv, ins.t().contiguous(), group=group)
    return cnt_recv
'''


def _outcome(fn):
    from megatron_moe.comm.strict import StrictDeviceError

    try:
        fn()
        return "passed"
    except StrictDeviceError as e:
        return "refused: " + str(e)


def strict_rank(rank, world):
    from megatron_moe import comm
    from megatron_moe.comm import strict

    out = {"enabled": strict.enabled()}
    x = torch.randn(4, 3)                       # the payload (test code: the data's device)
    splits = [2, 2]

    def cpu_counts():                           # a deliberate CPU-count tensor in a collective
        counts = torch.tensor(splits, device="cpu")
        recv = torch.empty_like(counts)
        dist.all_to_all_single(recv, counts)

    def dot_cpu_counts():
        counts = x.new_tensor(splits).cpu()
        dist.all_reduce(counts)

    def old_hierarchical():
        ns = {"__name__": "megatron_moe._old_hierarchical", "torch": torch, "dist": dist}
        exec(_OLD_HIERARCHICAL_COUNTS, ns)
        ns["exchange_counts"]([1, 2], 2, 1, None)

    def mixed_devices():
        dist.all_to_all_single(torch.empty(4, 3, device="meta"), x)

    def object_on_hot_path():
        with strict.hot_path():
            dist.all_gather_object([None] * world, rank)

    def device_counts():                        # counts made from the data: fine
        counts = x.new_tensor(splits)
        recv = torch.empty_like(counts)
        dist.all_to_all_single(recv, counts)

    def object_in_setup():
        dist.all_gather_object([None] * world, rank)

    def host_on_gloo_group():                   # megatron-core's checkpoint groups are gloo by design
        g = dist.new_group(list(range(world)), backend="gloo")
        dist.all_reduce(torch.tensor(splits, device="cpu"), group=g)

    def comm_hierarchical():                    # the fixed algorithm: counts on the data's device
        y = comm.all_to_all(x, [2, 2], [2, 2], None, algorithm="hierarchical", ranks_per_node=1)
        assert torch.equal(y[2 * rank:2 * rank + 2], x[2 * rank:2 * rank + 2])

    for name, fn in [("cpu_counts", cpu_counts), ("dot_cpu_counts", dot_cpu_counts),
                     ("old_hierarchical", old_hierarchical), ("mixed_devices", mixed_devices),
                     ("object_on_hot_path", object_on_hot_path), ("device_counts", device_counts),
                     ("object_in_setup", object_in_setup), ("host_on_gloo_group", host_on_gloo_group),
                     ("comm_hierarchical", comm_hierarchical)]:
        out[name] = _outcome(fn)
        dist.barrier()
    # the same violations with the checks suspended: gloo itself takes them (what NCCL would refuse)
    with strict.suspended():
        for name, fn in [("cpu_counts", cpu_counts), ("dot_cpu_counts", dot_cpu_counts),
                         ("old_hierarchical", old_hierarchical), ("object_on_hot_path", object_on_hot_path)]:
            out["suspended/" + name] = _outcome(fn)
            dist.barrier()
    return out
