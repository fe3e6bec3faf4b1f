"""Megatron-LM's whole flag surface: every flag of its ``arguments.py`` has a status here.

Data (this directory):

* ``megatron_<release>.json`` -- Megatron-LM's flags at a release, read from its own parser by
  ``tools/extract_megatron_flags.py`` (spellings, argparse group, dest, shape, default; no help
  text). ``RELEASES`` names the releases we track.
* ``status.txt`` -- THE table: one line per Megatron flag, ``FLAG  STATUS  REASON``:

  ``implemented``  our parser defines the flag with Megatron's meaning (``megatron_moe/arguments.py``
                   or a feature module's ``add_arguments``); REASON says where / any limit.
  ``noop``         accepted and documented as having no effect on the math here: it only selects
                   a fused kernel or a backend. Registered from Megatron's shape (same dest and
                   default), so the value is on ``args`` and is passed to megatron-core where it
                   applies (GPU with Transformer Engine, ``model.transformer_config_from_args``).
  ``refused``      accepted by argparse (never "unrecognized arguments"), then rejected at parse
                   time with one line: ``--flag is refused: REASON``.

How to change a flag's status (e.g. when you implement a refused flag):

1. define the flag in the parser with Megatron's spelling, dest and default (``add_argument`` in
   ``arguments.py`` or your module's ``add_arguments``), and implement it;
2. edit its line in ``status.txt``: ``--my-flag  implemented  what it does here / where``;
3. regenerate the reference: ``python tools/gen_flags_doc.py`` (writes ``docs/flags.md``).

``tests/test_flags.py`` fails when a Megatron flag has no line, when an ``implemented`` flag is not
defined by our own code (or a ``noop``/``refused`` one is: flip it), or when ``docs/flags.md`` is
stale. A flag Megatron adds in a newer release: re-run the extractor for that release, add it to
``RELEASES``, then give each new flag a line.
"""

from __future__ import annotations

import argparse
import functools
import json
import os

RELEASES = ("core_v0.16.1", "core_v0.19.0")
STATUSES = ("implemented", "noop", "refused")
HERE = os.path.dirname(os.path.abspath(__file__))
STATUS_FILE = os.path.join(HERE, "status.txt")
_REFUSED_PREFIX = "refused:"   # dest of a refused flag's placeholder action
NOOP_GROUP = "Megatron-LM flags accepted as no-ops (kernel/backend selectors; docs/flags.md)"


@functools.lru_cache(maxsize=None)
def megatron_flags(release: str) -> dict:
    """{flag: record} of one release (``tools/extract_megatron_flags.py`` output)."""
    with open(os.path.join(HERE, f"megatron_{release}.json")) as f:
        data = json.load(f)
    return {r["flag"]: dict(r, release=data["release"]) for r in data["flags"]}


@functools.lru_cache(maxsize=None)
def all_megatron_flags() -> dict:
    """{flag: record} over RELEASES (the newest release's shape wins); record["releases"] lists them."""
    out = {}
    for release in RELEASES:
        for flag, record in megatron_flags(release).items():
            releases = out.get(flag, {}).get("releases", []) + [release]
            out[flag] = dict(record, releases=releases)
    return out


def parse_status(text: str, path: str = STATUS_FILE) -> dict:
    """{flag: (status, reason)}; a malformed line raises ValueError naming file and line."""
    table = {}
    for lineno, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.split(None, 2)
        if len(parts) < 3 or not parts[0].startswith("--") or parts[1] not in STATUSES:
            raise ValueError(f"{path}:{lineno}: expected 'FLAG STATUS REASON' with STATUS one of "
                             f"{', '.join(STATUSES)}: {line!r}")
        if parts[0] in table:
            raise ValueError(f"{path}:{lineno}: {parts[0]} is listed twice")
        table[parts[0]] = (parts[1], parts[2])
    return table


@functools.lru_cache(maxsize=None)
def status_table() -> dict:
    with open(STATUS_FILE) as f:
        return parse_status(f.read())


_TYPES = {"int": int, "float": float}


def _shape_kwargs(record: dict) -> dict:
    """argparse keyword arguments reproducing a Megatron flag's shape (what it consumes)."""
    action = record["action"]
    if action == "_StoreTrueAction":
        return dict(action="store_true")
    if action == "_StoreFalseAction":
        return dict(action="store_false")
    if action == "BooleanOptionalAction":
        return dict(action=argparse.BooleanOptionalAction, default=record["default"])
    kwargs = dict(nargs=record["nargs"], default=record["default"],
                  type=_TYPES.get(record["type"], str))
    choices = record["choices"]
    if choices and all(isinstance(c, (str, int, float)) and not isinstance(c, bool) for c in choices):
        kwargs["choices"] = [kwargs["type"](c) for c in choices]
    return kwargs


def _spellings(record: dict) -> list:
    spellings = [record["flag"]] + list(record["aliases"])
    if record["action"] == "BooleanOptionalAction":  # argparse derives the --no- form itself
        spellings = [s for s in spellings if not s.startswith("--no-")]
    return spellings


def register(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add every ``noop`` and ``refused`` Megatron flag the parser does not already define."""
    taken = set(parser._option_string_actions)
    group = None
    for flag, (status, reason) in status_table().items():
        record = all_megatron_flags().get(flag)
        if status == "implemented" or record is None:
            continue
        spellings = [s for s in _spellings(record) if s not in taken]
        if not spellings or len(spellings) < len(_spellings(record)):
            continue  # our own code defines it: tests/test_flags.py asks for the status to be fixed
        kwargs = _shape_kwargs(record)
        if status == "noop":
            if group is None:
                group = parser.add_argument_group(NOOP_GROUP)
            action = group.add_argument(*spellings, dest=record["dest"],
                                        help=f"No-op here: {reason}", **kwargs)
        else:
            kwargs.pop("choices", None)  # any value gets the refusal line, not a choices error
            kwargs["default"] = argparse.SUPPRESS
            if "type" in kwargs:
                kwargs["type"] = str
            if kwargs.get("action") is argparse.BooleanOptionalAction:
                kwargs["action"] = "store_true"
                spellings += ["--no-" + s[2:] for s in spellings if "--no-" + s[2:] not in taken]
            action = parser.add_argument(*spellings, dest=_REFUSED_PREFIX + flag,
                                         help=argparse.SUPPRESS, **kwargs)
        action.megatron_status = status
        taken.update(spellings)
    return parser


def refused_given(args) -> list:
    """The refused Megatron flags present on a parsed command line."""
    return [key[len(_REFUSED_PREFIX):] for key in vars(args) if key.startswith(_REFUSED_PREFIX)]


def check_refused(args) -> None:
    """ValueError with one line for the first refused Megatron flag given on the command line."""
    for flag in refused_given(args):
        raise ValueError(f"{flag} is refused: {status_table()[flag][1]}")


def add_megatron_argument(group, flag: str, help: str | None = None, **override):
    """Define one of Megatron's flags with its exact spellings, dest, default and shape (from the
    newest release's record), so an implemented flag cannot drift from Megatron's definition."""
    record = all_megatron_flags()[flag]
    kwargs = _shape_kwargs(record)
    kwargs.update(override)
    if record["action"] not in ("_StoreTrueAction", "_StoreFalseAction", "BooleanOptionalAction"):
        kwargs.setdefault("dest", record["dest"])
    else:
        kwargs["dest"] = record["dest"]
    return group.add_argument(*_spellings(record), help=help, **kwargs)
