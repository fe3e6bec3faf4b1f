"""The wheel set the GPU machine lacks (docs/gpu.md), for ``scripts/gpu_wheels.sh``.

The GPU machine (one H100/H200, x86-64, no network) has Python 3.12 with the packages in
``GPU_MACHINE_HAS``. Everything else this project imports at run time (pyproject's
``dependencies``, then each fetched wheel's own non-optional ``Requires-Dist``, recursively) is
downloaded here with pip, for CPython 3.12 manylinux x86-64, one version of each, without
dependencies pip would add on its own (torch must never travel), and the total refused past
``LIMIT_MIB``. pip does the resolving and the downloading; this module only decides the names.
"""

from __future__ import annotations

import argparse
import email.parser
import glob
import os
import re
import subprocess
import sys
import zipfile

# What the GPU machine's system python3 already holds (issue #27's list; device/KINDS.md lists a
# superset, but only these are promised).
GPU_MACHINE_HAS = frozenset({
    "torch", "triton", "numpy", "transformers", "tokenizers", "sentencepiece", "safetensors",
    "regex", "tqdm", "matplotlib", "tensorboard", "pytest"})
LIMIT_MIB = 48
# The performance section's torchtitan row (megatron_moe/gpucheck/perf.py): the pinned release and
# exactly the packages its model, FSDP2 wrapping, loss, optimizer and LR scheduler import, fetched
# without their own requirements: its Requires-Dist also names its data stack (datasets, torchdata,
# wandb, pillow, ...), which the row does not use and whose pyarrow alone would not fit the carry.
# typing-extensions: typeguard needs a newer one than torch does. 1.7 MiB in all. These versions
# ran the row on the GPU machine's torch 2.11.0 (Python 3.12, the PyPI build run on the CPU, from
# this offline --target install) and on torch 2.13 (Python 3.11 and 3.12). torchtitan 0.3.0 is the
# one release that fits: 0.2.x's model packages import its data stack at import and 0.1.0 has no
# MoE model; on torch 2.11 its one missing name (torch.distributed.fsdp.DataParallelMeshDims, used
# only for multi-rank FSDP) is bridged in megatron_moe/compat/torchtitan.py.
PERF_WHEELS = ("torchtitan==0.3.0", "tyro==1.0.17", "docstring-parser==0.18.0",
               "typeguard==4.6.1", "spmd-types==0.2.3", "einops==0.8.2",
               "typing-extensions==4.16.0")
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64",
             "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64")
# the GPU machine, for evaluating environment markers of Requires-Dist
MARKER_ENV = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
              "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
              "implementation_name": "cpython", "platform_python_implementation": "CPython",
              "extra": ""}


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def project_dependencies(pyproject: str) -> list:
    """pyproject's [project] dependencies (requirement strings)."""
    try:
        import tomllib
    except ImportError:  # Python < 3.11
        import tomli as tomllib
    with open(pyproject, "rb") as f:
        return list(tomllib.load(f)["project"]["dependencies"])


def wheel_requirements(path: str) -> list:
    """A wheel's Requires-Dist entries that apply on the GPU machine (no extras)."""
    from packaging.requirements import Requirement

    with zipfile.ZipFile(path) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        msg = email.parser.Parser().parsestr(z.read(meta).decode("utf-8"))
    return for_gpu_machine(msg.get_all("Requires-Dist") or [])


def for_gpu_machine(requirements) -> list:
    """The requirements whose markers hold on the GPU machine, markers removed: pip download
    evaluates a marker against the interpreter running it (here possibly not 3.12) and would
    silently fetch nothing for ``emerging-optimizers; python_version >= "3.12"``."""
    from packaging.requirements import Requirement

    out = []
    for line in requirements:
        req = Requirement(line)
        if req.marker is None or req.marker.evaluate(MARKER_ENV):
            req.marker = None
            out.append(str(req))
    return out


def missing(requirements, have=GPU_MACHINE_HAS) -> list:
    from packaging.requirements import Requirement

    return [r for r in requirements if canonical(Requirement(r).name) not in have]


def pip_download(requirement: str, dest: str, python=sys.executable) -> str:
    """Download one wheel (no dependencies) for CPython 3.12 manylinux x86-64; its path."""
    before = set(os.listdir(dest))
    cmd = [python, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
           "--python-version", "3.12", "--implementation", "cp", "--disable-pip-version-check",
           "-d", dest, requirement]
    for p in PLATFORMS:
        cmd[cmd.index("-d"):cmd.index("-d")] = ["--platform", p]
    subprocess.run(cmd, check=True, timeout=600)
    new = sorted(set(os.listdir(dest)) - before)
    if new:
        return os.path.join(dest, new[0])
    # already there from an earlier run: the one wheel of that name
    from packaging.requirements import Requirement

    name = canonical(Requirement(requirement).name).replace("-", "_")
    found = [f for f in glob.glob(os.path.join(dest, "*.whl"))
             if canonical(os.path.basename(f).split("-")[0]).replace("-", "_") == name]
    if len(found) != 1:
        raise RuntimeError(f"pip download {requirement}: expected one wheel in {dest}, "
                           f"found {found}")
    return found[0]


def fetch(root: str, dest: str, limit_mib: float = LIMIT_MIB, log=print) -> list:
    """Download the missing wheels into ``dest`` (emptied of wheels first); their paths."""
    os.makedirs(dest, exist_ok=True)
    for old in glob.glob(os.path.join(dest, "*.whl")):  # one version of each: two stop the install
        os.remove(old)
    todo = missing(for_gpu_machine(project_dependencies(os.path.join(root, "pyproject.toml"))))
    done, wheels = set(), []
    from packaging.requirements import Requirement

    def fetch(req, why):
        """One requirement's wheel, unless a wheel of that name is already in; its path or None."""
        name = canonical(Requirement(req).name)
        if name in done:
            return None
        done.add(name)
        path = pip_download(req, dest)
        wheels.append(path)
        log(f"  {os.path.basename(path)}  {os.path.getsize(path) / 2**20:.2f} MiB  ({why})")
        return path

    while todo:
        req = todo.pop(0)
        path = fetch(req, f"for {req}")
        if path is not None:
            todo += missing(wheel_requirements(path))
    for req in PERF_WHEELS:  # pinned, their own requirements not followed (above)
        fetch(req, f"performance section: {req}")
    total = sum(os.path.getsize(w) for w in wheels) / 2**20
    log(f"{len(wheels)} wheels, {total:.2f} MiB in all, in {dest}")
    if total > limit_mib:
        for w in wheels:
            os.remove(w)
        raise SystemExit(f"error: the wheel set is {total:.2f} MiB, over the {limit_mib:g} MiB "
                         f"limit (the checkout plus the wheels must travel in 64 MiB); removed")
    return wheels


def main(argv=None):
    p = argparse.ArgumentParser(prog="gpu_wheels.sh", description=__doc__.split("\n\n")[0])
    p.add_argument("--dest", default=None, help="default: .gpu-wheels/ in the repository root")
    p.add_argument("--limit-mib", type=float, default=LIMIT_MIB)
    a = p.parse_args(argv)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    fetch(root, a.dest or os.path.join(root, ".gpu-wheels"), a.limit_mib)
    return 0


if __name__ == "__main__":
    sys.exit(main())
