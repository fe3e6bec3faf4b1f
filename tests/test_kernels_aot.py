"""CI: every Triton kernel compiles ahead of time for sm_80 and sm_90 in fp32, bf16 and fp16 (no GPU
needed: Triton's full pipeline and the ptxas in the triton wheel), and the register / spill table
is printed (docs/kernels.md keeps a copy).  Runs in a subprocess without TRITON_INTERPRET (other
kernel tests set it in this process, and it cannot be turned off after triton is imported)."""

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A kernel the interpreter runs (numpy does not care that ``acc`` starts as an int and becomes a
# float) and the compiler rejects (a loop-carried value must keep its type): the mutation control.
BROKEN = textwrap.dedent('''
    import triton
    import triton.language as tl

    @triton.jit
    def broken(p_ptr, out_ptr, n):
        acc = 0
        for i in range(n):
            acc += tl.load(p_ptr + i)
        tl.store(out_ptr, acc)
''')

SCRIPT = textwrap.dedent('''
    import sys
    from kernels import aot
    rc = aot.main(sys.argv[1:])
    sys.path.insert(0, {tmp!r})
    import broken_kernel
    try:
        aot.compile_one(broken_kernel.broken, {{"p_ptr": "*fp32", "out_ptr": "*fp32", "n": "i32"}},
                        {{}}, 90)
    except Exception as exc:
        print("CONTROL rejected:", type(exc).__name__)
    else:
        print("CONTROL compiled")
    sys.exit(rc)
''')


def test_all_kernels_compile_for_sm80_sm90(tmp_path):
    (tmp_path / "broken_kernel.py").write_text(BROKEN)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("OMP_NUM_THREADS", "1")
    r = subprocess.run([sys.executable, "-c", SCRIPT.format(tmp=str(tmp_path)), "--arch", "80", "90",
                        "--dtype", "fp32", "bf16", "fp16"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=600)
    print(r.stdout)                 # the register / spill table (pytest -s, or the CI log on failure)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    assert "32 compiled, 0 failed" in r.stdout, r.stdout[-2000:]
    rows = [ln.split() for ln in r.stdout.splitlines() if ln.startswith("sm_")]
    kernels = {row[1] for row in rows}
    assert kernels == {"_layout_count_kernel", "_layout_scatter_kernel", "_gather_rows_kernel",
                       "_combine_kernel", "_row_dot_kernel"}
    for arch in ("sm_80", "sm_90"):
        for dt in ("fp32", "bf16", "fp16"):
            assert sum(row[0] == arch and dt in row for row in rows) == 4, (arch, dt)
    assert all(int(row[-4]) > 0 for row in rows), "no register count read from a cubin"
    assert "CONTROL rejected" in r.stdout, r.stdout[-1000:]


def test_every_jit_kernel_is_in_the_aot_list():
    """A kernel added to triton_kernels.py without an AOT config fails here."""
    import ast

    src = open(os.path.join(ROOT, "kernels", "triton_kernels.py")).read()
    jit = {n.name for n in ast.walk(ast.parse(src)) if isinstance(n, ast.FunctionDef)
           and any("jit" in ast.unparse(d) for d in n.decorator_list)}
    aot_src = open(os.path.join(ROOT, "kernels", "aot.py")).read()
    helpers = {"_pairs"}          # @triton.jit helpers inlined into the kernels that call them
    missing = sorted(k for k in jit - helpers if f'"{k}"' not in aot_src)
    assert jit - helpers and not missing, missing
