"""Reading and rewriting megatron-core layer specs, whichever form a release uses.

megatron-core <= 0.17 describes the MoE MLP of a layer spec as a ``ModuleSpec(module=MoELayer,
submodules=MoESubmodules(...), params={...})``; from 0.18 it is ``functools.partial(MoELayer,
submodules=MoESubmodules(...))`` (0.17 already builds the shared experts that way, 0.19 also the
dense MLP, as ``partial(MLP.as_mlp_submodule, ...)``). Attention stays a ModuleSpec in all of them.
These helpers accept either form (and a bare class) so that the spec hooks (balance, dispatcher,
topology routers, BERT) never test a version: they ask what a spec builds and get a new spec back.
"""

import dataclasses
import functools
from typing import Any


def _is_module_spec(spec) -> bool:
    from megatron.core.transformer.spec_utils import ModuleSpec

    return isinstance(spec, ModuleSpec)


def spec_module(spec) -> Any:
    """The class (or function) a spec builds: ``ModuleSpec.module``, ``partial.func`` or the class."""
    if spec is None:
        return None
    if _is_module_spec(spec):
        return spec.module
    if isinstance(spec, functools.partial):
        return spec.func
    return spec


def spec_submodules(spec) -> Any:
    """The ``submodules`` a spec passes to its module, or None."""
    if _is_module_spec(spec):
        return spec.submodules
    if isinstance(spec, functools.partial):
        return spec.keywords.get("submodules")
    return None


def spec_params(spec) -> dict:
    """The constructor keywords a spec adds besides ``submodules`` (``ModuleSpec.params``)."""
    if _is_module_spec(spec):
        return dict(spec.params or {})
    if isinstance(spec, functools.partial):
        return {k: v for k, v in spec.keywords.items() if k != "submodules"}
    return {}


def replace_spec(spec, module=None, submodules=None, **params):
    """A new spec of the same form as ``spec`` with its module, submodules and/or params replaced
    (``params`` are merged). Specs are shared between layers and builds: never mutated in place."""
    if _is_module_spec(spec):
        changes = {}
        if module is not None:
            changes["module"] = module
        if submodules is not None:
            changes["submodules"] = submodules
        if params:
            changes["params"] = dict(spec.params or {}, **params)
        return dataclasses.replace(spec, **changes)
    if isinstance(spec, functools.partial):
        keywords = dict(spec.keywords, **params)
        if submodules is not None:
            keywords["submodules"] = submodules
        return functools.partial(module if module is not None else spec.func, *spec.args, **keywords)
    # a bare class: build a partial (what megatron-core >= 0.18 itself uses)
    keywords = dict(params)
    if submodules is not None:
        keywords["submodules"] = submodules
    target = module if module is not None else spec
    return functools.partial(target, **keywords) if keywords else target
