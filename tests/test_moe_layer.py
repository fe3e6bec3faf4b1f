"""The one MoE layer (megatron_moe/moe/layer.py): the only subclass of megatron-core's MoELayer in
the package, built from the spec with an injected exchange and placement; and no megatron-core
function rebound outside megatron_moe/compat/. Both checks read the source (an AST scan), and each
is shown to catch a planted offender, so they are not vacuous."""

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PKG = os.path.join(ROOT, "megatron_moe")


def _sources():
    for dirpath, _, files in os.walk(PKG):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(dirpath, name)
                with open(path) as f:
                    yield os.path.relpath(path, ROOT), f.read()


def moe_layer_subclasses(source: str):
    """Names of the classes in ``source`` whose bases name a ``MoELayer``."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef):
            for base in node.bases:
                text = ast.unparse(base)
                if text == "MoELayer" or text.endswith(".MoELayer") or text.endswith("MoELayer"):
                    out.append(node.name)
    return out


def megatron_rebindings(source: str):
    """Assignments to an attribute of a megatron-core module (``mod.name = ...`` or
    ``setattr(mod, ...)``) where ``mod`` was imported from ``megatron.core`` in the same source, or
    obtained from a call naming ``token_dispatcher`` (the module megatron-core's dispatchers read)."""
    tree = ast.parse(source)
    modules = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules |= {a.asname or a.name.split(".")[0] for a in node.names
                        if a.name.startswith("megatron.core") and a.asname}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("megatron.core"):
            modules |= {a.asname or a.name for a in node.names if a.name[:1].islower()}
        elif isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) and \
                "token_dispatcher" in ast.unparse(node.value.func):   # td = token_dispatcher_module()
            modules |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    hits = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            for t in node.targets:
                if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id in modules:
                    hits.append(ast.unparse(t))
        elif isinstance(node, ast.Call) and ast.unparse(node.func) == "setattr" and node.args:
            first = node.args[0]
            if isinstance(first, ast.Name) and first.id in modules:
                hits.append(ast.unparse(node))
    return hits


def test_one_class_subclasses_megatron_cores_moe_layer():
    from megatron.core.transformer.moe.moe_layer import MoELayer as Core

    from megatron_moe.moe.layer import MoELayer

    found = {(path, name) for path, src in _sources() for name in moe_layer_subclasses(src)}
    assert found == {(os.path.join("megatron_moe", "moe", "layer.py"), "MoELayer")}, found
    assert issubclass(MoELayer, Core)
    # the scan sees a second layer class where one is written
    assert moe_layer_subclasses("class ChunkedMoELayer(MoELayer):\n    pass\n") == ["ChunkedMoELayer"]


def test_no_megatron_core_function_rebound_outside_compat():
    hits = {path: megatron_rebindings(src) for path, src in _sources()
            if not path.startswith(os.path.join("megatron_moe", "compat"))}
    assert not any(hits.values()), {p: h for p, h in hits.items() if h}
    # where it lives, the scan sees it; and a planted rebinding elsewhere is caught
    with open(os.path.join(PKG, "compat", "dispatch.py")) as f:
        assert megatron_rebindings(f.read())
    planted = ("from megatron.core.transformer.moe import token_dispatcher\n"
               "token_dispatcher.permute = my_permute\n")
    assert megatron_rebindings(planted) == ["token_dispatcher.permute"]
    planted = "td = _token_dispatcher_module()\nsetattr(td, name, value)\n"   # the old dispatcher.py
    assert megatron_rebindings(planted) == ["setattr(td, name, value)"]


def test_the_spec_injects_exchange_and_placement():
    """Every MoE layer becomes ours with the exchange of the flags (--moe-a2a-overlap-degree 2 -> a
    chunked one); a balance policy adds the replica placement, the exchange still the flags'."""
    import argparse
    from types import SimpleNamespace

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from megatron_moe import balance
    from megatron_moe.balance.layer import ReplicaPlacement
    from megatron_moe.compat import spec_module, spec_params
    from megatron_moe.moe import dispatcher
    from megatron_moe.moe.layer import MoELayer

    args = argparse.Namespace(num_experts=4, moe_a2a_overlap_degree=2, moe_a2a_schedule="schemoe",
                              moe_a2a_algorithm="pipe", moe_a2a_compression="none",
                              moe_permute_fusion=False, moe_ep_link_gbps=None)
    block = SimpleNamespace(layer_specs=[get_gpt_layer_local_spec(num_experts=4)])
    dispatcher.customize_spec(args, block)
    mlp = block.layer_specs[0].submodules.mlp
    assert spec_module(mlp) is MoELayer
    exchange = spec_params(mlp)["exchange"]
    assert exchange.chunked and exchange.overlap_degree == 2 and exchange.algorithm == "pipe"
    assert exchange.own_all_to_all and "placement" not in spec_params(mlp)

    args.moe_a2a_overlap_degree = 1
    block = SimpleNamespace(layer_specs=[get_gpt_layer_local_spec(num_experts=4)])
    dispatcher.customize_spec(args, block)
    assert spec_module(block.layer_specs[0].submodules.mlp) is MoELayer
    assert not spec_params(block.layer_specs[0].submodules.mlp)["exchange"].chunked
    bal = balance.add_arguments(argparse.ArgumentParser()).parse_args(
        ["--moe-balance-policy", "proprophet"])
    bal.num_experts, bal.moe_a2a_algorithm = 4, "pipe"
    balance.install(bal, block)
    params = spec_params(block.layer_specs[0].submodules.mlp)
    assert isinstance(params["placement"], ReplicaPlacement)
    assert params["exchange"].algorithm == "pipe" and not params["exchange"].chunked
