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

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_kit(out, *args, env=None, timeout=900):
    e = dict(os.environ, PYTHON=sys.executable, OMP_NUM_THREADS="1", **(env or {}))
    e.pop("GPU_CHECK_INSTALL_WHEELS", None)
    return subprocess.run(["bash", os.path.join(ROOT, "scripts", "gpu_check.sh"), "--cpu",
                           str(out), *args], capture_output=True, text=True, env=e,
                          timeout=timeout, cwd=ROOT)


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_check")
    p = run_kit(out)
    with open(out / "gpu_report.json") as f:
        report = json.load(f)
    return p, report, out


def test_every_check_runs_and_passes(cpu_run):
    p, report, out = cpu_run
    names = [n for checks in SECTIONS.values() for n in checks]
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-2000:]
    assert [c["name"] for c in report["checks"]] == names
    for c in report["checks"]:
        assert c["status"] == "PASS", c
        assert f"gpu-check {c['name']}: PASS" in p.stdout
    assert report["failed"] == 0 and report["passed"] == len(names) and report["mode"] == "cpu"
    md = (out / "gpu_report.md").read_text()
    assert all(f"| {n} | PASS |" in md for n in names)
    assert (out / "gpu_check_loss.png").stat().st_size > 0
    assert report["info"]["megatron_core"] == megatron.core.__version__
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


def test_cuda_only_parts_are_listed_as_skipped(cpu_run):
    p, report, _ = cpu_run
    c = {x["name"]: x for x in report["checks"]}
    for name in ("environment", "kernels", "training-bf16", "offload", "inference-ring-memory"):
        assert c[name]["skipped"], name
        assert f"gpu-check {name}: skipped here: " in p.stdout


def test_gpu_profile_script_smoke(tmp_path):
    """scripts/gpu_profile.py (the H100 run's host-bound diagnosis, docs/gpu.md) on the CPU model
    sizes: it trains, profiles the iterations after the warm-up and writes its tables."""
    e = dict(os.environ, OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "gpu_profile.py"),
                        str(tmp_path), "--cpu", "--layers", "2", "--iters", "3", "--warmup", "1"],
                       capture_output=True, text=True, env=e, timeout=300, cwd=ROOT)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    text = (tmp_path / "gpu_profile.txt").read_text()
    assert text.startswith("profiled 2 iterations of BIG (2 layers)")
    assert "== by self CPU time ==" in text and "aten::mm" in text
