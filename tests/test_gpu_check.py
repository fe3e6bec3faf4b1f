"""The GPU kit's CPU mode (issue 27): ``bash scripts/gpu_check.sh --cpu OUTDIR`` runs every check
of the GPU run at toy sizes, prints one line per check, writes the report, and lists the CUDA-only
parts as skipped, so the kit cannot rot between GPU runs. Both CI legs run it."""

import json
import os
import subprocess
import sys

import megatron.core
import pytest

from megatron_moe.gpucheck.checks import SECTIONS
from tests.test_helper_processes import _alive   # a process neither gone nor a zombie

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_kit(out, *args, env=None, timeout=1800):
    e = dict(os.environ, PYTHON=sys.executable, OMP_NUM_THREADS="1", **(env or {}))
    e.pop("GPU_CHECK_INSTALL_WHEELS", None)
    return subprocess.run(["bash", os.path.join(ROOT, "scripts", "gpu_check.sh"), "--cpu",
                           str(out), *args], capture_output=True, text=True, env=e,
                          timeout=timeout, cwd=ROOT)


# the checks and the performance section run in two kit runs (each inside the suite's time limit
# per test on a loaded 2-core machine); `gpu_check.sh --cpu` alone runs both
CHECKS = [s for s in SECTIONS if s != "perf"]


def test_cpu_mode_runs_every_section_by_default():
    from megatron_moe.gpucheck.run import GPU_DEFAULT_SECTIONS, default_sections

    assert default_sections(cpu=True) == list(SECTIONS) and "perf" in SECTIONS
    # on the GPU the performance section is a device call of its own (docs/gpu.md)
    assert default_sections(cpu=False) == GPU_DEFAULT_SECTIONS == CHECKS


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_check")
    p = run_kit(out, "--sections", ",".join(CHECKS))
    with open(out / "gpu_report.json") as f:
        report = json.load(f)
    return p, report, out


@pytest.fixture(scope="module")
def perf_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_check_perf")
    p = run_kit(out, "--sections", "perf")
    with open(out / "gpu_report.json") as f:
        report = json.load(f)
    return p, report, out


def test_every_check_runs_and_passes(cpu_run):
    p, report, out = cpu_run
    names = [n for s in CHECKS for n in SECTIONS[s]]
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-2000:]
    assert [c["name"] for c in report["checks"]] == names
    for c in report["checks"]:
        assert c["status"] == "PASS", c
        assert f"gpu-check {c['name']}: PASS" in p.stdout
    assert report["failed"] == 0 and report["passed"] == len(names) and report["mode"] == "cpu"
    md = (out / "gpu_report.md").read_text()
    assert all(f"| {n} | PASS |" in md for n in names)
    assert (out / "gpu_check_loss.png").stat().st_size > 0
    # megatron-core appends `git rev-parse --short HEAD` of the importing process's directory
    # (package_info.py): compare the release, not that local part
    assert report["info"]["megatron_core"].split("+")[0] == megatron.core.__version__.split("+")[0]
    # the profile of a training iteration with the time the checks left (scripts/gpu_profile.py)
    assert "gpu-check profile: profiled 2 iterations" in p.stdout, p.stdout[-2000:]
    assert "== by self CPU time ==" in (out / "gpu_profile.txt").read_text()


def test_figures_prove_the_checks_ran(cpu_run):
    _, report, _ = cpu_run
    c = {x["name"]: x for x in report["checks"]}
    k = c["kernels"]["figures"]
    assert len(k) == 2 and all(v["permute_exact"] and v["hierarchical_exact"] for v in k.values())
    bf16 = c["training-bf16"]["figures"]
    assert bf16["last_loss"] < bf16["first_loss"] and bf16["tokens_per_s"] > 0
    # the log line's --log-throughput field and our own figure come from one FLOP count
    assert bf16["log_line_tflops"] is not None and bf16["flops_per_iter"] > 0
    assert c["training-resume"]["figures"]["max_abs_diff"] == 0
    off = c["offload"]["figures"]
    for tier in ("host", "ssd"):
        assert off[tier]["losses"] == off["resident_losses"]
        assert off[tier]["probe"]["calls"] > 0 and off[tier]["probe"]["violations"] == 0
    assert off["planted"]["detected"] and off["planted"]["skips"] == 1
    ring = c["inference-ring-memory"]["figures"]
    assert ring["fraction"] == pytest.approx(ring["k_over_n"])


@pytest.mark.timeout(1500)   # eight row processes: 5 minutes at a load average of 40 here
def test_perf_section_runs_every_system_on_the_same_model(perf_run):
    """--cpu runs the performance section (megatron_moe/gpucheck/perf.py) at toy sizes: every
    system trains each shape with the shape's parameter count, one FLOP count, and the ratios
    are computed; torchtitan's row is skipped, with the reason, only where it is not installed."""
    import importlib.util

    from megatron_moe.gpucheck import perf

    p, report, out = perf_run
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-2000:]
    c = {x["name"]: x for x in report["checks"]}
    assert [n for n in c] == SECTIONS["perf"] and all(x["status"] == "PASS" for x in c.values())
    have_titan = importlib.util.find_spec("torchtitan") is not None
    for shape in perf.SHAPES:
        fig = c[f"perf-{shape}"]["figures"]
        assert fig["expected_params"] == perf.expected_params(perf.SHAPES[shape]["cpu"])
        assert list(fig["rows"]) == list(perf.SYSTEMS)
        for system, row in fig["rows"].items():
            if system == "torchtitan" and not have_titan:
                assert "torchtitan is not installed" in row["skipped"]
                continue
            if system in perf.CUDA_ONLY_ROWS:   # CUDA only
                assert "CUDA only" in row["skipped"]
                continue
            assert row["same_model"] and row["params"] == fig["expected_params"], (system, row)
            assert row["tokens_per_s"] > 0 and row["aten_ops_per_iter"] > 0
            # one iteration's host time by package (megatron_moe/gpucheck/host_time.py): each
            # system's own package shows up
            own = {"ours": "megatron_moe", "stock": "megatron.core"}.get(system, system)
            assert row["host_s_per_iter"] > 0 and row["host_by_package_s"].get(own, 0) > 0, row
        assert fig["ratios"]["ours/stock"] > 0 and fig["ratios"]["ours/transformers"] > 0
        assert (fig["ratios"]["ours/torchtitan"] is not None) == have_titan
        ours = fig["rows"]["ours"]
        # at least the grouped experts are on: the parser accepts one of their flags
        assert {"--moe-torch-grouped-gemm", "--moe-grouped-gemm"} & set(ours["options"])
    md = (out / "perf_report.md").read_text()
    assert "| ours |" in md and "| stock |" in md and "Ratios of tokens/s: ours/torchtitan" in md
    assert "Host time per iteration, ms, by package" in md and "* ours: " in md
    assert json.loads((out / "perf_report.json").read_text())["mode"] == "cpu"


def test_cuda_only_parts_are_listed_as_skipped(cpu_run):
    p, report, _ = cpu_run
    c = {x["name"]: x for x in report["checks"]}
    for name in ("environment", "kernels", "training-bf16", "offload", "inference-ring-memory"):
        assert c[name]["skipped"], name
        assert f"gpu-check {name}: skipped here: " in p.stdout


def test_gpu_profile_script_smoke(cpu_run):
    """scripts/gpu_profile.py (the H100 run's host-bound diagnosis, docs/gpu.md) on the CPU model
    sizes: it trains, profiles the iterations after the warm-up and writes its tables. The kit's
    CPU run above ran it (``run.profile``: ``gpu_profile.py OUTDIR --cpu --layers 2 --iters 3
    --warmup 1``, its main in a fork of the runner) and printed its first line only where it
    exited 0."""
    p, _, out = cpu_run
    cmd = f"scripts/gpu_profile.py {out} --cpu --layers 2 --iters 3 --warmup 1\n"
    assert cmd in (out / "gpu_check.log").read_text()
    text = (out / "gpu_profile.txt").read_text()
    assert text.startswith("profiled 2 iterations of BIG (2 layers)")
    assert f"gpu-check profile: {text.splitlines()[0]}" in p.stdout, p.stdout[-2000:]
    assert "== by self CPU time ==" in text and "aten::mm" in text


def _bounded_child(tmp_path, what):
    from megatron_moe.gpucheck.process import run_module
    from tests import _gpucheck_child

    with open(tmp_path / "log", "w") as log:
        got, _ = run_module("tests._gpucheck_child", _gpucheck_child.main, what, log, 3.0, ROOT,
                            cpu=True)
    return got, (tmp_path / "log").read_text()


@pytest.mark.parametrize("what, why", [(["print"], "ok"), (["exit", "3"], "exit 3"),
                                       (["raise"], "exit 1"), (["hang"], "timed out after 3s")])
def test_cpu_children_are_bounded_forks_of_the_runner(tmp_path, what, why):
    """--cpu runs each section and row as a fork of the runner (megatron_moe/gpucheck/process.py):
    its own process and process group, output in the log, the exit status or the time limit
    reported as for a fresh interpreter, and whatever it started killed with it."""
    got, text = _bounded_child(tmp_path, what)
    assert got == why, text
    pid, parent, group, preloaded = text.split()[1:8:2]
    assert int(parent) == os.getpid() and int(pid) == int(group) != os.getpid()
    assert preloaded == "True"   # megatron-core came with the fork
    if what == ["raise"]:
        assert "RuntimeError: the child failed" in text
    if what == ["hang"]:   # the grandchild died with its process group
        assert not _alive(int(text.split("grandchild ")[1].split()[0]))


def test_cpu_profile_is_a_fork_of_the_runner(tmp_path, monkeypatch, capsys):
    """--cpu runs scripts/gpu_profile.py as a section: its main in a bounded fork of the runner
    (no fresh interpreter's imports), with the CPU arguments; the first line of its report is
    printed. A fresh interpreter (the GPU's way) would run the real main, never the patched one."""
    from megatron_moe.gpucheck import run
    from scripts import gpu_profile

    def main(argv):
        with open(os.path.join(argv[0], "gpu_profile.txt"), "w") as f:
            f.write(f"pid {os.getpid()} parent {os.getppid()} args {' '.join(argv[1:])}\n")

    monkeypatch.setattr(gpu_profile, "main", main)
    run.profile(str(tmp_path), True, 60, str(tmp_path / "log"))
    head = (tmp_path / "gpu_profile.txt").read_text().splitlines()[0]
    assert head.startswith("pid "), head   # the patched main ran
    pid, parent = head.split()[1:4:2]
    assert int(parent) == os.getpid() != int(pid)
    assert head.endswith(" args --cpu --layers 2 --iters 3 --warmup 1")
    assert f"gpu-check profile: {head}\n" in capsys.readouterr().out
    assert "scripts/gpu_profile.py " in (tmp_path / "log").read_text()


def test_a_childs_leftover_process_is_caught(tmp_path, monkeypatch):
    """The mutation: the runner kills only the child, not its process group."""
    from megatron_moe.gpucheck import process

    monkeypatch.setattr(process.os, "killpg", lambda pid, sig: None)
    got, text = _bounded_child(tmp_path, ["hang"])
    grandchild = int(text.split("grandchild ")[1].split()[0])
    try:
        assert got == "timed out after 3s" and _alive(grandchild)
    finally:
        os.kill(grandchild, 9)
