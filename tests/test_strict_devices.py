"""Strict device mode (megatron_moe/comm/strict.py, on for every multi-process test): collectives
are checked as NCCL needs them, so host tensors and hot-path object collectives fail on gloo."""

from megatron_moe.runtime.local_ranks import run_distributed
from tests import _strict_cases

VIOLATIONS = ("cpu_counts", "dot_cpu_counts", "old_hierarchical", "mixed_devices", "object_on_hot_path")
ALLOWED = ("device_counts", "object_in_setup", "host_on_gloo_group", "comm_hierarchical")


def test_strict_mode_catches_host_tensors_and_hot_path_objects():
    for res in run_distributed(_strict_cases.strict_rank, 2, timeout_s=120):
        assert res["enabled"]
        for name in VIOLATIONS:
            assert res[name].startswith("refused: strict devices"), (name, res[name])
        for name in ALLOWED:
            assert res[name] == "passed", (name, res[name])
        assert "host tensor (made by torch.tensor(device='cpu')" in res["cpu_counts"]
        assert "made by .cpu()" in res["dot_cpu_counts"]
        assert "without a device (megatron_moe._old_hierarchical)" in res["old_hierarchical"]
        assert "mixes devices" in res["mixed_devices"]
        assert "all_gather_object" in res["object_on_hot_path"]
        # what makes the suite NCCL-ready is the strict mode, not gloo: suspended, gloo takes them
        for name in ("cpu_counts", "dot_cpu_counts", "old_hierarchical", "object_on_hot_path"):
            assert res["suspended/" + name] == "passed", (name, res["suspended/" + name])
