#!/usr/bin/env python
"""Read Megatron-LM's flag list from a checkout into this repo's data file (no Megatron code copied).

    git -C Megatron-LM archive core_v0.16.1 megatron | tar -x -C /tmp/mlm-0.16.1
    python tools/extract_megatron_flags.py --megatron-lm /tmp/mlm-0.16.1 --release core_v0.16.1 \
        --commit $(git -C Megatron-LM rev-parse core_v0.16.1) \
        --output megatron_moe/flags/megatron_core_v0.16.1.json

Builds Megatron-LM's own parser (``megatron.training.arguments.add_megatron_arguments``) from the
checkout and records, for every option, its spellings, argparse group, destination and shape
(value-taking or not, nargs, choices, default). ``megatron.training``'s package ``__init__`` and
its ``utils``/``global_vars`` modules are not executed (they pull in tokenizers, W&B, ...): the
parser needs none of them. Run it with the interpreter whose megatron-core matches the release
(Python 3.12 for core_v0.19, whose training code needs ``typing.override``).
"""

from __future__ import annotations

import argparse
import enum
import json
import os
import sys
import types


def _json_safe(value):
    if isinstance(value, enum.Enum):  # Megatron's enum-typed flags take the member's name
        return value.name
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return repr(value)


class _NoOpModule(types.ModuleType):
    """Stand-in for a module the parser's import chain names but the parser never calls."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return lambda *a, **k: None


def megatron_parser(checkout: str) -> argparse.ArgumentParser:
    sys.path.insert(0, checkout)
    package = types.ModuleType("megatron.training")
    package.__path__ = [os.path.join(checkout, "megatron", "training")]
    sys.modules["megatron.training"] = package
    for name in ("megatron.training.utils", "megatron.training.global_vars"):
        sys.modules[name] = _NoOpModule(name)
    from megatron.training.arguments import add_megatron_arguments

    parser = argparse.ArgumentParser(allow_abbrev=False)
    add_megatron_arguments(parser)
    return parser


def flag_records(parser: argparse.ArgumentParser) -> list[dict]:
    group_of = {}
    for group in parser._action_groups:
        for action in group._group_actions:
            group_of[id(action)] = group.title
    records = []
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction) or not action.option_strings:
            continue
        long = [s for s in action.option_strings if s.startswith("--")]
        records.append(dict(
            flag=long[0] if long else action.option_strings[0],
            aliases=[s for s in action.option_strings if s != (long[0] if long else None)],
            group=group_of.get(id(action)),
            dest=action.dest,
            takes_value=action.nargs != 0,
            nargs=action.nargs,
            action=type(action).__name__,
            type=getattr(action.type, "__name__", None) if action.type is not None else None,
            choices=_json_safe(list(action.choices)) if action.choices is not None else None,
            default=_json_safe(action.default),
        ))
    return sorted(records, key=lambda r: r["flag"])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--megatron-lm", required=True, help="a Megatron-LM source tree at the release")
    p.add_argument("--release", required=True, help="the git tag, e.g. core_v0.16.1")
    p.add_argument("--commit", default=None, help="the tag's commit (recorded)")
    p.add_argument("--output", required=True)
    a = p.parse_args(argv)
    records = flag_records(megatron_parser(os.path.abspath(a.megatron_lm)))
    data = dict(release=a.release, commit=a.commit, repository="NVIDIA/Megatron-LM",
                source="megatron/training/arguments.py (add_megatron_arguments)",
                flags=records)
    with open(a.output, "w") as f:  # one flag per line: reviewable diffs between releases
        head = json.dumps({k: v for k, v in data.items() if k != "flags"})[:-1]
        f.write(head + ', "flags": [\n')
        f.write(",\n".join(json.dumps(r) for r in records))
        f.write("\n]}\n")
    print(f"{len(records)} flags of Megatron-LM {a.release} -> {a.output}")


if __name__ == "__main__":
    main()
