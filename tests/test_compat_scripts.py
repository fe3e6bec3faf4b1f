"""scripts/: interpreter lookup, one venv per Python, and pytest's 'no tests' exit failing loudly."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = os.path.join(ROOT, "scripts")


def _run(cmd, env=None, timeout=120):
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env=dict(os.environ, **(env or {})))


def test_find_python_resolves_a_version_name_and_refuses_a_missing_one():
    me = f"python{sys.version_info.major}.{sys.version_info.minor}"
    out = _run(["bash", os.path.join(SCRIPTS, "find_python.sh"), me])
    assert out.returncode == 0, out.stderr
    found = out.stdout.strip()
    version = _run([found, "-c", "import sys; print(sys.version_info[:2])"]).stdout.strip()
    assert version == str(tuple(sys.version_info[:2]))
    missing = _run(["bash", os.path.join(SCRIPTS, "find_python.sh"), "python3.1"])
    assert missing.returncode != 0 and "python3.1" in missing.stderr


def test_setup_env_refuses_a_venv_built_with_another_python(tmp_path):
    # a venv whose python reports another minor version than PYTHON=: refused before any install
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    fake = venv / "bin" / "python"
    fake.write_text("#!/bin/sh\necho 2.7\n")
    fake.chmod(0o755)
    out = _run(["bash", os.path.join(SCRIPTS, "setup_env.sh")],
               env={"VENV": str(venv), "PYTHON": sys.executable})
    assert out.returncode == 1
    assert "was built with Python 2.7" in out.stderr and "VENV=" in out.stderr


def test_run_tests_fails_when_pytest_collects_nothing():
    venv = sys.prefix
    stamp = os.path.join(venv, ".megatron-moe-installed")
    # what setup_env.sh compares its stamp with (newer than both: nothing to install)
    inputs = [os.path.join(ROOT, "pyproject.toml"),
              os.path.join(ROOT, "megatron_moe", "gpucheck", "wheels.py")]
    if not (os.path.exists(stamp) and
            all(os.path.getmtime(stamp) > os.path.getmtime(f) for f in inputs)):
        pytest.skip(f"{venv} is not a current scripts/setup_env.sh venv (it would reinstall)")
    out = _run(["bash", os.path.join(SCRIPTS, "run_tests.sh"), "--collect-only",
                "-k", "no_test_has_this_name_zzz", os.path.join("tests", "test_compat_scripts.py")],
               env={"VENV": venv}, timeout=300)
    assert out.returncode == 5, out.stdout[-2000:] + out.stderr[-2000:]
    assert "collected no tests (exit code 5)" in out.stderr
    assert "== tests on Python" in out.stdout
