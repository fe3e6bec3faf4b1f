import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


# --- CI legs ----------------------------------------------------------------------------------------
# .ci/run runs the whole suite on Python 3.11 / megatron-core 0.16.1, and on Python 3.12 / the newest
# megatron-core every file except the ones below (`-m "not single_leg"`). A file may be listed only
# if it imports neither megatron-core nor torch, triton, a tokenizer library or anything else whose
# behaviour differs between the two legs' Python and package versions: its result is the same on
# both legs, so running it twice proves nothing. Everything that touches megatron-core, torch,
# torch.distributed, Triton, the tokenizers, preprocessing, checkpoints or the GPU kit (whose
# machine runs Python 3.12 and the newest megatron-core) runs on both legs.
SINGLE_LEG = {
    # the simulator, the planners' arithmetic and the cost model: pure Python + numpy
    "test_sim.py", "test_planner.py", "test_cost_model.py", "test_paper_tables.py",
    "test_bench_policies.py",  # bench/policies.py over the simulator: numpy only
    "test_plot_expert_load.py",  # parses log text; matplotlib draws the PNG
}
assert all(name.startswith("test_") for name in SINGLE_LEG)

# Files that use something one machine has only once (a Slurm cluster: its daemons, config and
# ports). .ci/run runs the two legs side by side except for these, which run leg after leg.
MACHINE_WIDE = {"test_slurm.py"}


def pytest_configure(config):
    config.addinivalue_line("markers", "single_leg: run on the Python 3.11 CI leg only (conftest.py)")
    config.addinivalue_line("markers", "machine_wide: uses a machine-wide service; .ci/run runs "
                            "these leg after leg (conftest.py)")


def pytest_collection_modifyitems(config, items):
    import pytest

    for item in items:
        name = os.path.basename(str(item.fspath))
        if name in SINGLE_LEG:
            item.add_marker(pytest.mark.single_leg)
        if name in MACHINE_WIDE:
            item.add_marker(pytest.mark.machine_wide)
