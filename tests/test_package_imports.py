"""The package's own modules are never optional: a feature module that fails to import stops the
launch with its ImportError (its flags never vanish into "unrecognized arguments"), and the import
structure keeps no circle inside balance/policies and no arrow from comm/ up to moe/."""

import ast
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PKG = ROOT / "megatron_moe"


def test_feature_module_import_error_fails_the_launch(monkeypatch):
    from megatron_moe import arguments

    name = "megatron_moe._broken_feature"
    monkeypatch.setitem(sys.modules, name, None)  # importing it raises ImportError
    monkeypatch.setattr(arguments, "_EXTENSION_MODULES", arguments._EXTENSION_MODULES + (name,))
    with pytest.raises(ImportError, match="_broken_feature"):
        arguments.parse_args(["--num-layers", "2"], world_size=1, check_data_paths=False)


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
