"""Every CPU shim in megatron_moe/compat/cpu.py: the megatron-core call fails without it, works with it."""

import json
import os
import subprocess
import sys

import pytest

from megatron_moe.compat import cpu
from megatron_moe.runtime.local_ranks import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The uneven all-gather / reduce-scatter shim needs >= 2 ranks; tests/test_training.py's
# TP2 x EP2 run (ETP=2, alltoall dispatcher) exercises it, and test_uneven_collectives below.
# The layer-wise optimizer shim (megatron-core >= 0.19, Muon with the distributed optimizer) needs
# 2 ranks and emerging-optimizers: tests/test_muon.py's dist_muon test runs with it and without it.
# The pipeline-send shim needs 2 pipeline ranks: tests/test_ddp_schedule_flags.py's late-receiver
# test runs with it and without it. The Megatron-FSDP shim: tests/test_megatron_fsdp.py trains on 2
# ranks with it and fails without it.
MULTI_RANK_ONLY = {"uneven_collectives", "layer_wise_optimizer", "pipeline_sends", "megatron_fsdp"}


def _probe(*flags):
    out = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "_compat_probe.py"),
                          str(free_port()), *flags], capture_output=True, text=True, timeout=180,
                         env=dict(os.environ, PYTHONPATH=ROOT))
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def without_shims():
    return _probe()


@pytest.fixture(scope="module")
def with_shims():
    return _probe("--shims")


def test_every_shim_has_a_scenario(without_shims):
    names = {shim.__name__.removeprefix("patch_") for shim in cpu.SHIMS}
    assert names - MULTI_RANK_ONLY == set(without_shims)


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="CPU-only behaviour")
def test_scenarios_fail_without_shims(without_shims):
    """Each shim the installed megatron-core needs is needed; each one it does not is not."""
    active = {shim.__name__.removeprefix("patch_") for shim in cpu.active_shims()}
    needed = {k: v for k, v in without_shims.items() if k in active}
    fixed = {k: v for k, v in without_shims.items() if k not in active}
    assert all(v.startswith("error") for v in needed.values()), needed
    assert all(v == "ok" for v in fixed.values()), fixed


def test_scenarios_pass_with_shims(with_shims):
    assert all(v == "ok" for v in with_shims.values()), with_shims


def _uneven_gather_rank(rank, world_size):
    import torch
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import mappings

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    group = parallel_state.get_tensor_model_parallel_group()
    sizes = [2, 3]
    mine = torch.full((sizes[rank], 4), float(rank + 1))
    gathered = mappings._gather_along_first_dim(mine, group, sizes)
    full = torch.arange(5 * 4, dtype=torch.float32).view(5, 4)
    scattered = mappings._reduce_scatter_along_first_dim(full, group, sizes)
    return gathered.tolist(), scattered.tolist()


def test_uneven_collectives():
    from megatron_moe.runtime.local_ranks import run_distributed
    from tests import test_compat

    results = run_distributed(test_compat._uneven_gather_rank, 2, timeout_s=120)
    expected_gather = [[1.0] * 4] * 2 + [[2.0] * 4] * 3
    full = [[float(4 * r + c) for c in range(4)] for r in range(5)]
    for rank, (gathered, scattered) in enumerate(results):
        assert gathered == expected_gather
        rows = full[:2] if rank == 0 else full[2:]
        assert scattered == [[2 * v for v in row] for row in rows]  # summed over 2 ranks


def test_paged_stash_stub_only_where_needed():
    """megatron-core 0.19 imports triton unguarded (moe/ops/paged_stash): without triton the
    model cannot be imported unless compat registers its stub; older releases need none."""
    from megatron_moe.compat.versions import mcore_at_least

    def imports(with_stub):
        code = ("import sys; sys.modules['triton'] = None\n"  # as if triton were not installed
                + ("from megatron_moe.compat import install_megatron_core_stubs as s; s()\n"
                   if with_stub else "")
                + "import megatron.core.models.gpt.gpt_model")
        return subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True,
                              text=True, timeout=300, env=dict(os.environ, PYTHONPATH=ROOT))

    with_stub = imports(True)
    assert with_stub.returncode == 0, with_stub.stderr[-2000:]
    without = imports(False)
    assert (without.returncode != 0) == mcore_at_least("0.19"), without.stderr[-2000:]
