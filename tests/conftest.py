import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


# --- CI legs ----------------------------------------------------------------------------------------
# .ci/run runs the whole suite on Python 3.11 / megatron-core 0.16.1, and on Python 3.12 / the newest
# megatron-core everything except the files below (`-m "not single_leg"`), to keep both legs within
# CI's time budget on 2 cores. Each listed file either does not touch megatron-core at all, or
# exercises our own logic on a megatron-core surface that the files left in leg 2 already cover on
# the newest release (named after each entry). Run them on 3.12 by hand with
# `PYTHON=python3.12 VENV=.venv312 bash scripts/run_tests.sh tests/<file>`.
SINGLE_LEG = {
    # the GPU kit's wheel selection, FLOP count, planted offload fault (test_gpu_check.py: both)
    "test_gpu_kit.py",
    # no megatron-core: planners, simulator, tools, tokenizers, .bin/.idx, raw torch.distributed
    "test_sim.py", "test_sim_recorded.py", "test_planner.py", "test_plot_expert_load.py",
    "test_balance_tools.py", "test_cost_model.py", "test_topology.py", "test_harness.py",
    "test_tokenizers.py", "test_preprocess.py", "test_merge_datasets.py", "test_tools_help.py",
    "test_comm.py", "test_offload_link.py", "test_bench_alltoall.py", "test_bench_policies.py",
    "test_paper_tables.py",   # the papers' testbeds/tables through the simulator: numpy only
    # kernels against their torch reference and the Triton compiler (test_kernels_moe stays:
    # it compares with megatron-core's permute)
    "test_kernels.py", "test_kernels_triton.py", "test_kernels_aot.py", "test_kernels_sync.py",
    # per-policy equivalence with the balanced MoE layer: test_exchange_path runs every policy x
    # algorithm bit-exact against flat on the newest megatron-core
    "test_balance_equivalence.py", "test_balance_training.py", "test_fastermoe.py",
    "test_fastermoe_equivalence.py", "test_flexmoe.py", "test_flexmoe_equivalence.py",
    "test_flexmoe_persistent.py",
    # kill -9 timing and layout changes of dist_checkpointing: save/resume on the newest release is
    # covered by test_training, test_preemption, test_compat_checkpoint and test_hf_convert
    "test_crash_safety.py", "test_reshard.py",
}


def pytest_configure(config):
    config.addinivalue_line("markers", "single_leg: run on the Python 3.11 CI leg only (conftest.py)")


def pytest_collection_modifyitems(config, items):
    import pytest

    for item in items:
        if os.path.basename(str(item.fspath)) in SINGLE_LEG:
            item.add_marker(pytest.mark.single_leg)
