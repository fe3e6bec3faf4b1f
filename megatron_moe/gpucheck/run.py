"""The GPU check's runner (``bash scripts/gpu_check.sh [--cpu] OUTDIR``; docs/gpu.md).

Runs every section of ``checks.py`` in its own process with a share of the time budget (a crash,
a hang or a CUDA error in one section cannot stop the others), prints one line per check::

    gpu-check NAME: PASS|FAIL|SKIP <figures>

and writes ``OUTDIR/gpu_report.json``, ``OUTDIR/gpu_report.md``, ``OUTDIR/gpu_check.log`` (every
section's own output) and ``OUTDIR/gpu_check_loss.png`` (the training losses). Exit status 1 when
any check failed or is missing. ``--cpu``: the same checks at toy sizes on the CPU, the CUDA-only
figures listed as skipped with the reason.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

from megatron_moe.gpucheck.checks import GROUPED, PLANT_ENV, ROOT, SECTIONS
from megatron_moe.gpucheck.checks import main as checks_main
from megatron_moe.gpucheck.process import module_command, run_forked, run_module

# seconds each section may take at most (GPU, CPU); the whole run stays inside --budget-s
SECTION_CAP_S = {"kernels": (120, 300), "training": (240, 600), "resume": (120, 300),
                 "offload": (120, 400), "inference": (120, 400), "syncs": (90, 200),
                 "perf": (540, 1200)}
# the GPU run's default sections: the performance section fits a 10-minute device call of its own
# (docs/gpu.md); the CPU mode runs every section
GPU_DEFAULT_SECTIONS = [s for s in SECTIONS if s != "perf"]


def default_sections(cpu):
    return list(SECTIONS) if cpu else GPU_DEFAULT_SECTIONS


def run_section(name, cpu, work, log, budget_s, perf_systems=None):
    """The section in a child process; returns (its result dict or None, why it ended)."""
    if name == "perf":  # one child process per row (megatron_moe/gpucheck/perf.py)
        from megatron_moe.gpucheck import perf

        t0 = time.monotonic()
        try:
            data, why = perf.run_section(cpu, work, log, budget_s, systems=perf_systems), "ok"
        except Exception as exc:  # reported as the section's missing checks
            import traceback

            log.write(traceback.format_exc())
            data, why = None, f"crashed ({exc!r})"
        return data, why, time.monotonic() - t0
    result = os.path.join(work, f"{name}.json")
    module = "megatron_moe.gpucheck.checks"
    args = [name, "--result", result, "--work", os.path.join(work, name)] + (["--cpu"] if cpu else [])
    log.write(f"\n===== section {name} ({datetime.datetime.now():%H:%M:%S}, limit "
              f"{budget_s:.0f}s): {' '.join(module_command(module, args))}\n")
    log.flush()
    why, took = run_module(module, checks_main, args, log, budget_s, ROOT, cpu)
    log.write(f"===== section {name}: {why} in {took:.1f}s\n")
    log.flush()
    data = None
    if os.path.exists(result):
        with open(result) as f:
            data = json.load(f)
    return data, why, took


def _tail(path, n=4):
    try:
        with open(path, errors="replace") as f:
            lines = [l.strip() for l in f.readlines() if l.strip()]
    except OSError:
        return ""
    return " | ".join(lines[-n:])[-500:]


def _fmt_md_value(v):
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, list) and len(v) > 8:
        return "[" + ", ".join(_fmt_md_value(x) for x in v[:3]) + f", ... ({len(v)} values), " \
            + _fmt_md_value(v[-1]) + "]"
    if isinstance(v, list):
        return "[" + ", ".join(_fmt_md_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "; ".join(f"{k}={_fmt_md_value(x)}" for k, x in v.items())
    return str(v)


def write_markdown(path, report):
    info = report["info"]
    lines = [f"# GPU check report ({report['mode']} mode)", "",
             f"Date (UTC): {report['date']}; total {report['wall_s']:.0f} s; "
             f"{report['passed']} passed, {report['failed']} failed, {report['skipped']} skipped.",
             ""]
    if info:
        lines += ["| environment | |", "|---|---|"]
        lines += [f"| {k} | {_fmt_md_value(v)} |" for k, v in info.items()]
        lines.append("")
    lines += ["| check | result | figures |", "|---|---|---|"]
    for c in report["checks"]:
        lines.append(f"| {c['name']} | {c['status']} | {c['summary'].replace('|', '/')} |")
    lines.append("")
    for c in report["checks"]:
        lines += [f"## {c['name']}: {c['status']}", "", c["summary"], ""]
        if c.get("skipped"):
            lines += ["Skipped here: " + "; ".join(c["skipped"]), ""]
        for k, v in c.get("figures", {}).items():
            lines.append(f"* {k}: {_fmt_md_value(v)}")
        lines.append("")
    with open(path, "w") as f:
        f.write("\n".join(lines))


def plot_losses(path, checks):
    """The training checks' loss curves; None when matplotlib is absent or nothing to draw."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    curves = []
    for c in checks:
        f = c.get("figures", {})
        for key in ("losses", "off_losses"):
            xs = f.get(key)
            if isinstance(xs, list) and xs and all(isinstance(x, (int, float)) for x in xs):
                curves.append((f"{c['name']} ({key})", xs))
    if not curves:
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    for label, xs in curves:
        ax.plot(range(1, len(xs) + 1), xs, label=label)
    ax.set_xlabel("iteration")
    ax.set_ylabel("lm loss")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def main(argv=None):
    p = argparse.ArgumentParser(prog="gpu_check.sh", description=__doc__.split("\n\n")[0])
    p.add_argument("outdir")
    p.add_argument("--cpu", action="store_true",
                   help="toy sizes on the CPU (the suite runs this; CUDA-only parts skipped)")
    p.add_argument("--sections", default=None,
                   help="comma-separated subset of: " + ", ".join(SECTIONS) + " (default: all "
                        "but perf on the GPU, which runs in a device call of its own; all with "
                        "--cpu)")
    p.add_argument("--perf-systems", default=None,
                   help="the perf section's rows, comma-separated subset of its systems "
                        "(default: all)")
    p.add_argument("--budget-s", type=float, default=None,
                   help="the whole run's time limit (default on the GPU: 470 s for the checks, "
                        "their 8 minutes, plus 540 s for perf; 1800 s with --cpu)")
    a = p.parse_args(argv)
    names = [s.strip() for s in (a.sections or ",".join(default_sections(a.cpu))).split(",")
             if s.strip()]
    perf_systems = None
    if a.perf_systems:
        from megatron_moe.gpucheck.perf import SYSTEMS

        perf_systems = [s.strip() for s in a.perf_systems.split(",") if s.strip()]
        bad = [s for s in perf_systems if s not in SYSTEMS]
        if bad:
            p.error(f"--perf-systems: unknown {bad}; choose from {list(SYSTEMS)}")
    unknown = [s for s in names if s not in SECTIONS]
    if unknown:
        p.error(f"--sections: unknown {unknown}; choose from {list(SECTIONS)}")
    budget = a.budget_s or (1800.0 if a.cpu else 470.0 * any(n != "perf" for n in names)
                            + 540.0 * ("perf" in names))
    os.makedirs(a.outdir, exist_ok=True)
    work = tempfile.mkdtemp(prefix="gpu_check_")
    t_start = time.monotonic()
    checks, info = [], {}
    mode = "cpu" if a.cpu else "gpu"
    print(f"gpu-check: {mode} mode, sections {', '.join(names)}, budget {budget:.0f}s, "
          f"log {os.path.join(a.outdir, 'gpu_check.log')}", flush=True)
    if os.environ.get(PLANT_ENV):
        print(f"gpu-check: {PLANT_ENV}={os.environ[PLANT_ENV]}: a planted fault", flush=True)
    log_path = os.path.join(a.outdir, "gpu_check.log")
    with open(log_path, "w") as log:
        for i, name in enumerate(names):
            left = budget - (time.monotonic() - t_start)
            # keep a little for every section still to come
            reserve = sum(10.0 for _ in names[i + 1:])
            cap = SECTION_CAP_S[name][1 if a.cpu else 0]
            data, why, took = run_section(name, a.cpu, work, log, min(cap, left - reserve),
                                          perf_systems)
            got = {c["name"]: c for c in (data or {}).get("checks", [])}
            info.update((data or {}).get("info", {}))
            for check in SECTIONS[name]:
                c = got.get(check) or dict(
                    name=check, status="FAIL", figures={}, skipped=[],
                    summary=f"no result: section {name} {why} ({_tail(log_path)})")
                checks.append(c)
                print(f"gpu-check {c['name']}: {c['status']} {c['summary']}", flush=True)
                if c.get("skipped"):
                    print(f"gpu-check {c['name']}: skipped here: " + "; ".join(c["skipped"]),
                          flush=True)
    shutil.rmtree(work, ignore_errors=True)
    if "perf" in names:
        from megatron_moe.gpucheck import perf

        perf.write_reports(a.outdir, [c for c in checks if c["name"] in SECTIONS["perf"]],
                           "cpu" if a.cpu else "gpu")
    report = dict(mode=mode, date=datetime.datetime.now(datetime.timezone.utc).strftime(
        "%Y-%m-%d %H:%M"), wall_s=time.monotonic() - t_start, info=info, checks=checks,
        passed=sum(c["status"] == "PASS" for c in checks),
        failed=sum(c["status"] == "FAIL" for c in checks),
        skipped=sum(c["status"] == "SKIP" for c in checks),
        planted=os.environ.get(PLANT_ENV) or None)
    png = plot_losses(os.path.join(a.outdir, "gpu_check_loss.png"), checks)
    report["plot"] = os.path.basename(png) if png else None
    with open(os.path.join(a.outdir, "gpu_report.json"), "w") as f:
        json.dump(report, f, indent=1)
    write_markdown(os.path.join(a.outdir, "gpu_report.md"), report)
    print(f"gpu-check: {report['passed']} passed, {report['failed']} failed, {report['skipped']} "
          f"skipped in {report['wall_s']:.0f}s; report {os.path.join(a.outdir, 'gpu_report.md')}",
          flush=True)
    left = budget - (time.monotonic() - t_start)
    if "training" in names and left >= (30 if a.cpu else 90):
        profile(a.outdir, a.cpu, left, log_path)
    return 1 if report["failed"] else 0


def profile(outdir, cpu, limit_s, log_path):
    """Where a training iteration's time goes (scripts/gpu_profile.py -> OUTDIR/gpu_profile.txt),
    with the time the checks left: the first GPU run needed a second device call for it. On the
    GPU a fresh interpreter; with --cpu a fork of this preloaded runner, as a section
    (process.py)."""
    script = os.path.join(ROOT, "scripts", "gpu_profile.py")
    args = [outdir] + (["--cpu", "--layers", "2", "--iters", "3", "--warmup", "1"] if cpu else
                       # the fastest configuration measured (the H200 run: the fused permute x0.86)
                       ["--iters", "6", "--warmup", "4", "--extra", GROUPED])
    cmd = [sys.executable, script, *args]
    with open(log_path, "a") as log:
        log.write(f"\n===== profile (limit {limit_s:.0f}s): {' '.join(cmd)}\n")
        log.flush()
        if cpu:
            from scripts import gpu_profile

            why, _ = run_forked(script, gpu_profile.main, args, log, limit_s, ROOT)
        else:
            try:
                rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                                    timeout=limit_s, start_new_session=True).returncode
                why = f"exit {rc}" if rc else "ok"
            except subprocess.TimeoutExpired:
                why = "timed out"
    path = os.path.join(outdir, "gpu_profile.txt")
    head = f"failed ({why})"
    if why == "ok" and os.path.exists(path):
        with open(path) as f:
            head = f.readline().strip()
    print(f"gpu-check profile: {head}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
