"""The package's own modules are never optional: a feature module that fails to import stops the
launch with its ImportError (its flags never vanish into "unrecognized arguments"), and the import
structure keeps no circle inside balance/policies and no arrow from comm/ up to moe/."""

import ast
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PKG = ROOT / "megatron_moe"


def test_feature_module_import_error_fails_the_launch():
    """A feature module that fails to import stops the parser's import with its ImportError (its
    flags never vanish into "unrecognized arguments"): the feature list imports its modules directly."""
    code = ("import sys; sys.modules['megatron_moe.offload'] = None\n"
            "try:\n    import megatron_moe.arguments\nexcept ImportError as e:\n    print('IMPORTERROR', e)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert "IMPORTERROR" in out.stdout and "megatron_moe.offload" in out.stdout, out.stdout + out.stderr


def test_one_feature_list_and_no_string_imports():
    """Features are wired one way (megatron_moe/features.py), by import statements an import graph
    can follow: no import_module of our own modules outside compat/, no second feature list."""
    offenders = [f"{p.relative_to(ROOT)}: {name}" for p in sorted(PKG.rglob("*.py"))
                 for name, _ in _imports(p) if "import_module" in name]
    assert offenders == []
    for path in sorted(PKG.rglob("*.py")):
        text = path.read_text()
        assert "_EXTENSION_MODULES" not in text and "SPEC_HOOKS" not in text, path


def test_training_loop_imports_no_feature_with_run_hooks():
    """The training loop reaches balance and offload only through features.RunHooks."""
    loop = [n for n, _ in _imports(PKG / "training" / "loop.py")]
    wired = [n for n in loop if n.startswith(("megatron_moe.balance", "megatron_moe.offload"))
             or n in ("megatron_moe.balance", "megatron_moe.offload")]
    assert wired == [], wired


def test_stage_packages_do_not_import_the_wiring():
    """arguments.py and features.py sit above the stage packages; only the model builder (which
    applies the features' spec edits), the training loop, the inference tools' parser (it extends
    the training parser) and the GPU kit (an entry point shipped in the package) read them."""
    allowed = {PKG / "models" / "builder.py", PKG / "training" / "loop.py",
               PKG / "inference" / "arguments.py"}
    entry_points = {PKG / "gpucheck"}  # the GPU kit runs whole jobs, as tools/ and bench/ do
    offenders = [f"{p.relative_to(ROOT)}: {n}" for p in sorted(PKG.rglob("*.py"))
                 if p.parent != PKG and p not in allowed and p.parent not in entry_points
                 for n, _ in _imports(p) if n in ("megatron_moe.features", "megatron_moe.arguments")
                 or n.startswith("megatron_moe.features.")]
    assert offenders == [], offenders


def _imports(path):
    """(module imported, inside a try whose handlers catch ImportError) for every import in path."""
    tree = ast.parse(path.read_text(), str(path))
    guarded = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Try) and any(
                h.type is not None and "ImportError" in ast.unparse(h.type) for h in node.handlers):
            for inner in node.body:
                guarded.update(id(n) for n in ast.walk(inner))
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.Call) and ast.unparse(node.func).endswith("import_module"):
            # a name list of our own modules (arguments.py, model.py); compat/ alone may probe
            # megatron-core's modules this way (they move between versions)
            names = [] if path.parent.name == "compat" else ["megatron_moe (import_module)"]
        else:
            continue
        for name in names:
            yield name, id(node) in guarded


def test_no_optional_import_of_the_package_itself():
    offenders = [f"{p.relative_to(ROOT)}: {name}" for p in sorted(PKG.rglob("*.py"))
                 for name, guarded in _imports(p) if guarded and name.startswith("megatron_moe")]
    assert offenders == []


def test_no_import_circle_in_policies_and_no_upward_arrow_from_comm():
    base = {n for n, _ in _imports(PKG / "balance/policies/base.py")}
    assert not any(n.startswith("megatron_moe.balance.policies.") or "import_module" in n
                   for n in base), base  # the policies register themselves from the package
    comm = [f"{p.name}: {n}" for p in (PKG / "comm").rglob("*.py") for n, _ in _imports(p)
            if n.startswith("megatron_moe.moe")]
    assert comm == []
