"""Fault injection and mutations live in the tests (monkeypatch, fixtures, tests/_slow_save.py),
never as switches the library reads: no file under megatron_moe/ or kernels/ names a
``MEGATRON_MOE_TEST*`` environment variable."""

import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
PREFIX = "MEGATRON_MOE_" + "TEST"   # split so that this file is no hit of its own scan


def _hits(*roots):
    """(path, line number) of every text line under ``roots`` that names the prefix."""
    hits = []
    for root in roots:
        for path in sorted(p for p in root.rglob("*") if p.is_file()):
            try:
                text = path.read_text()
            except (UnicodeDecodeError, OSError):
                continue  # binaries (compiled kernels, caches)
            hits += [(str(path.relative_to(root.parent)), n)
                     for n, line in enumerate(text.splitlines(), 1) if PREFIX in line]
    return hits


def test_no_test_switch_in_the_package_or_kernels():
    assert _hits(ROOT / "megatron_moe", ROOT / "kernels") == []


def test_the_scan_finds_a_planted_switch(tmp_path):
    pkg = tmp_path / "megatron_moe" / "offload"
    pkg.mkdir(parents=True)
    (pkg / "link.py").write_text(f'import os\nSKIP = os.environ.get("{PREFIX}_MUTATE")\n')
    assert _hits(tmp_path / "megatron_moe") == [("megatron_moe/offload/link.py", 2)]
