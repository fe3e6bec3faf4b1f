"""Where a training iteration's host time goes, by package: one iteration under cProfile.

On the H200 (docs/gpu.md) the device was busy 16% of the wall clock: the step was host time. The
performance section runs one extra iteration of every system under ``cProfile`` and charges each
function's own time to the package its file belongs to (ours, megatron-core, torch, torchtitan,
transformers, other). Time spent in C (a torch op's dispatch and kernel launch, the autograd
engine's C++) has no file: it is charged to the Python function that called it, by cProfile's
per-caller records, so "megatron-core" includes the ops its modules launch. Written here because
cProfile/pstats give per-function figures only; the grouping by package is ours.
"""

from __future__ import annotations

import cProfile
import os
import pstats

# (label, path fragment), first match wins; the fragments are directory names inside site-packages
# or this checkout
PACKAGES = (("megatron_moe", f"{os.sep}megatron_moe{os.sep}"), ("megatron_moe", f"{os.sep}kernels{os.sep}"),
            ("megatron.core", f"{os.sep}megatron{os.sep}core{os.sep}"),
            ("torchtitan", f"{os.sep}torchtitan{os.sep}"),
            ("transformers", f"{os.sep}transformers{os.sep}"),
            ("torch", f"{os.sep}torch{os.sep}"))
OTHER = "other"


def package_of(filename: str) -> str:
    for label, fragment in PACKAGES:
        if fragment in filename:
            return label
    return OTHER


def _is_c(func) -> bool:
    """cProfile's key of a built-in (C) function: ('~', 0, name)."""
    return func[0] == "~"


def breakdown(stats: pstats.Stats, iterations: int = 1, top: int = 12) -> dict:
    """{'by_package_s': {label: seconds per iteration}, 'total_s': ..., 'calls': Python calls per
    iteration, 'top': [(function, seconds per iteration), ...]} from ``stats`` of ``iterations``
    iterations. A C function's own time goes to its Python callers in proportion to what cProfile
    recorded per caller (the time of a C function called from C, with no Python caller, stays
    "other")."""
    by_package, by_function = {}, {}

    def charge(func, seconds):
        if _is_c(func):
            return False
        label = package_of(func[0])
        name = f"{label}:{os.path.basename(func[0])}:{func[1]} {func[2]}"
        by_function[name] = by_function.get(name, 0.0) + seconds
        by_package[label] = by_package.get(label, 0.0) + seconds
        return True

    for func, (_, _, own, _, callers) in stats.stats.items():
        if not _is_c(func):
            charge(func, own)
            continue
        charged = 0.0
        for caller, record in callers.items():
            seconds = record[2]   # this C function's own time when called from ``caller``
            if charge(caller, seconds):
                charged += seconds
        if own > charged:
            by_package[OTHER] = by_package.get(OTHER, 0.0) + own - charged
    per = max(iterations, 1)
    # Python-level calls (functions and C built-ins, each generator resumption counted): the host
    # work that launches nothing and that a faster device does not shorten
    calls = sum(record[1] for record in stats.stats.values())
    return dict(by_package_s={k: v / per for k, v in sorted(by_package.items(),
                                                            key=lambda kv: -kv[1])},
                total_s=sum(by_package.values()) / per, calls=calls / per,
                top=[(k, v / per) for k, v in sorted(by_function.items(),
                                                     key=lambda kv: -kv[1])[:top]])


class HostProfile:
    """``with HostProfile() as hp: ...`` then ``hp.breakdown(iterations)``."""

    def __init__(self):
        self.profile = cProfile.Profile()

    def __enter__(self):
        self.profile.enable()
        return self

    def __exit__(self, *exc):
        self.profile.disable()
        return False

    def breakdown(self, iterations: int = 1, top: int = 12) -> dict:
        return breakdown(pstats.Stats(self.profile), iterations, top)


def format_breakdown(b: dict) -> str:
    """Two lines for the section's log: the packages, then the top functions."""
    packages = ", ".join(f"{k} {v * 1e3:.1f}" for k, v in b["by_package_s"].items())
    lines = [f"host time per iteration (cProfile, ms): {b['total_s'] * 1e3:.1f} = {packages}"]
    lines += [f"  {v * 1e3:8.2f} ms  {name}" for name, v in b["top"]]
    return "\n".join(lines)
