"""Compile every Triton kernel of ``kernels/triton_kernels.py`` ahead of time for real GPUs, on a
machine without one, and print registers and spills per kernel x arch x dtype.

    python -m kernels.aot [--arch 80 90] [--dtype fp32 bf16 fp16] [--markdown]

``triton.compile(ASTSource(...), target=GPUTarget("cuda", arch, 32))`` runs Triton's whole
pipeline (TTIR -> TTGIR -> LLVM -> PTX -> cubin, with the ptxas shipped in the triton wheel), so it
rejects what the interpreter (TRITON_INTERPRET=1, the tests' CPU path) accepts but the compiler
does not.  Registers and local memory (spills) are read from the cubin with the wheel's
``cuobjdump -res-usage`` (``n_regs``/``n_spills`` in the compiled kernel's metadata are filled only
when a driver loads it).  Each kernel is compiled with one representative launch config (the
BLOCK sizes its host wrapper picks for a typical MoE shape); the Triton cache is a fresh temporary
directory, so nothing is reused between runs.  Exit status 1 on any compile error.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

FLOAT = {"fp32": "fp32", "bf16": "bf16", "fp16": "fp16"}

# E = 64 experts, top-2, hidden 4096: BLOCK_E = 64, BLOCK_T = 64 (routing_layout), BLOCK_H = 1024
# (gather/combine), 256 (row_dot) - what the host wrappers choose for that shape.
LAYOUT = dict(K=2, BLOCK_T=64, BLOCK_E=64)


def configs(dtypes):
    """(kernel name, variant, dtype label, signature, constexprs) for every compile."""
    out = []
    idx = {"idx_ptr": "*i64", "mask_ptr": "*u8"}
    for topk in (True, False):
        variant = "top-k" if topk else "routing map"
        out.append(("_layout_count_kernel", variant, "int", dict(
            idx, counts_ptr="*i32", T="i32", E="i32", K="constexpr", IS_TOPK="constexpr",
            BLOCK_T="constexpr", BLOCK_E="constexpr"), dict(LAYOUT, IS_TOPK=topk)))
        out.append(("_layout_scatter_kernel", variant + (" +pad" if not topk else ""), "int", dict(
            idx, prefix_ptr="*i32", base_ptr="*i64", kept_ptr="*i32", row_ptr="*i64",
            pidx_ptr="*i64", T="i32", E="i32", cap="i32", K="constexpr", IS_TOPK="constexpr",
            HAS_CAP="constexpr", PAD="constexpr", BLOCK_T="constexpr", BLOCK_E="constexpr"),
            dict(LAYOUT, IS_TOPK=topk, HAS_CAP=not topk, PAD=not topk)))
    for dt in dtypes:
        d = "*" + FLOAT[dt]
        out.append(("_gather_rows_kernel", "permute", dt, dict(
            x_ptr=d, row_ptr="*i64", scale_ptr=d, out_ptr=d, H="i32", HAS_SCALE="constexpr",
            BLOCK_H="constexpr"), dict(HAS_SCALE=False, BLOCK_H=1024)))
        out.append(("_gather_rows_kernel", "x * prob (grad)", dt, dict(
            x_ptr=d, row_ptr="*i64", scale_ptr="*fp32", out_ptr="*fp32", H="i32",
            HAS_SCALE="constexpr", BLOCK_H="constexpr"), dict(HAS_SCALE=True, BLOCK_H=1024)))
        out.append(("_combine_kernel", "unpermute + probs", dt, dict(
            x_ptr=d, order_ptr="*i64", bounds_ptr="*i64", p_ptr="*fp32", out_ptr=d, H="i32",
            HAS_P="constexpr", ACC_F64="constexpr", BLOCK_H="constexpr"),
            dict(HAS_P=True, ACC_F64=False, BLOCK_H=1024)))
        out.append(("_row_dot_kernel", "grad of probs", dt, dict(
            g_ptr=d, row_ptr="*i64", x_ptr=d, out_ptr="*fp32", H="i32", ACC_F64="constexpr",
            BLOCK_H="constexpr"), dict(ACC_F64=False, BLOCK_H=256)))
    return out


def _cuobjdump():
    import triton

    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    return path if os.path.exists(path) else shutil.which("cuobjdump")


def resource_usage(cubin: bytes, tool: str):
    """(registers, local bytes) of the one function in ``cubin``, from ``cuobjdump -res-usage``."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        txt = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True,
                             timeout=60, check=True).stdout
    m = re.search(r"REG:(\d+).*?LOCAL:(\d+)", txt, re.S)
    if not m:
        raise RuntimeError(f"cuobjdump -res-usage: no REG/LOCAL in:\n{txt}")
    return int(m.group(1)), int(m.group(2))


def compile_one(fn, signature, constexprs, arch: int):
    """One ahead-of-time compile for ``sm_<arch>``; raises on a compile error."""
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")   # Triton 3.9's default, stated
    import triton
    from triton.backends.compiler import GPUTarget

    if getattr(getattr(triton, "knobs", None), "runtime", None) and triton.knobs.runtime.interpret:
        raise RuntimeError("kernels.aot: TRITON_INTERPRET=1 is set; AOT compilation needs the "
                           "compiler (unset it)")
    src = triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=constexprs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32))


def compile_all(archs, dtypes, log=print):
    from kernels import triton_kernels as tk

    tool = _cuobjdump()
    rows, errors = [], []
    for arch in archs:
        for name, variant, dt, sig, consts in configs(dtypes):
            fn = getattr(tk, name)
            t0 = time.perf_counter()
            try:
                k = compile_one(fn, sig, consts, arch)
                regs, spill = resource_usage(k.asm["cubin"], tool) if tool else (None, None)
            except Exception as exc:  # a compile error is the finding: collect, report, fail
                errors.append(f"sm_{arch} {name} [{variant}, {dt}]: {type(exc).__name__}: "
                              f"{str(exc).strip().splitlines()[-1] if str(exc).strip() else ''}")
                log(f"FAILED sm_{arch} {name} [{variant}, {dt}]: {exc}")
                continue
            rows.append(dict(arch=f"sm_{arch}", kernel=name, variant=variant, dtype=dt,
                             regs=regs, spill_bytes=spill, warps=k.metadata.num_warps,
                             shared=k.metadata.shared, seconds=time.perf_counter() - t0))
    return rows, errors


def table(rows, markdown=False):
    head = ["arch", "kernel", "variant", "dtype", "regs", "spill bytes", "warps", "smem"]
    body = [[r["arch"], r["kernel"], r["variant"], r["dtype"], str(r["regs"]),
             str(r["spill_bytes"]), str(r["warps"]), str(r["shared"])] for r in rows]
    if markdown:
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        lines += ["| " + " | ".join(b) + " |" for b in body]
        return "\n".join(lines)
    w = [max(len(x) for x in col) for col in zip(head, *body)]
    return "\n".join("  ".join(x.ljust(n) for x, n in zip(line, w)) for line in [head] + body)


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m kernels.aot", description=__doc__.splitlines()[0])
    p.add_argument("--arch", type=int, nargs="+", default=[80, 90])
    p.add_argument("--dtype", nargs="+", choices=sorted(FLOAT), default=["fp32", "bf16", "fp16"])
    p.add_argument("--markdown", action="store_true")
    a = p.parse_args(argv)
    cache = tempfile.mkdtemp(prefix="triton_aot_cache_")
    os.environ["TRITON_CACHE_DIR"] = cache      # compile everything, reuse nothing across runs
    t0 = time.perf_counter()
    try:
        rows, errors = compile_all(a.arch, a.dtype)
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    print(table(rows, a.markdown))
    print(f"{len(rows)} compiled, {len(errors)} failed in {time.perf_counter() - t0:.1f}s")
    for e in errors:
        print("ERROR", e)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
