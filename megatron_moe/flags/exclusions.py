"""Combinations a feature cannot run, as data: each feature module declares its ``EXCLUDES`` and
``megatron_moe.features.validate_args`` refuses them at parse time, one line naming both flags.

A refusal written as data can be listed (docs, tests) and cannot drift from the check; the ranges of a
single flag (``--x must be >= 1``) stay in the feature's own ``validate_args``.
"""

from __future__ import annotations

import dataclasses
from typing import Callable


def _dest(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


def _set(value) -> bool:
    return value not in (None, False, 0, "", "none")


@dataclasses.dataclass(frozen=True)
class Exclusion:
    """``flag`` set (truthy, not ``none``) is refused while the feature is active.

    ``needs_one``: the flag is a parallel size that must be 1 (its default), refused when it is not.
    ``is_set``: a custom test of the other setting, for flags whose "set" is not truthiness."""
    flag: str
    reason: str
    needs_one: bool = False
    is_set: Callable | None = None

    def violated(self, args) -> bool:
        value = getattr(args, _dest(self.flag), None)
        if self.is_set is not None:
            return bool(self.is_set(args))
        if self.needs_one:
            return (value or 1) != 1
        return _set(value)

    def message(self, setting: str, args) -> str:
        if self.needs_one:
            value = getattr(args, _dest(self.flag), None)
            return f"{setting} needs {self.flag} 1 (got {value}); {self.reason}"
        return f"{setting} cannot be combined with {self.flag} ({self.reason})"


def te_grouped_gemm(args) -> bool:
    """--moe-grouped-gemm as megatron-core's Transformer Engine TEGroupedMLP (on the local path
    the flag selects this package's grouped experts, which run under every feature)."""
    return bool(getattr(args, "moe_grouped_gemm", False)) and \
        getattr(args, "transformer_impl", None) == "transformer_engine"


def check(setting: str | None, exclusions, args) -> None:
    """Raise ValueError for the first violated exclusion of an active feature (``setting`` is the
    feature's flag as given, e.g. ``--moe-balance-policy proprophet``; None when it is off)."""
    if not setting:
        return
    for ex in exclusions:
        if ex.violated(args):
            raise ValueError(ex.message(setting, args))
