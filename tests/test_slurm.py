"""Preemption under a real Slurm (issue 26): scancel, a time limit, requeue, SIGKILL mid-save.

A one-node Slurm 22.05 (tests/_slurm.py) runs examples/train_gpt_moe_slurm_cpu.sbatch, the CPU
copy of examples/train_gpt_moe_slurm.sbatch, in both launch forms at once:

* ``torchrun``: srun starts one torchrun per node, torchrun the 2 ranks (c10d rendezvous);
* ``srun``: srun starts the 2 ranks itself (``--ntasks-per-node=2``; the parser and
  initialize.py take the world size and ranks from SLURM_NTASKS / SLURM_PROCID).

Each form runs one chain of jobs on its own ``--save`` = ``--load`` directory, signalled the way
Slurm signals a job (every process of the step, helpers included):

1. a ``--requeue`` job with the script's ``#SBATCH --signal=TERM@60``: ``scontrol requeue`` at
   iteration >= 3 (SIGTERM to all, KillWait, requeue): the ranks save, the job restarts on its own,
   resumes, and once it trains its time limit is cut to the next whole minute at least 75 s ahead
   (``scontrol update``; a limit that short at submission could send the lead signal during a
   slow start-up, while the ranks still ignore SIGTERM): the time limit's lead signal stops it
   again: it saves and ends COMPLETED with exit 0;
2. a resubmitted job: ``scancel`` (SIGTERM to all): it saves the iteration every rank stopped at;
3. a resubmitted job whose save is slowed past KillWait (tests/_slow_save.py): ``scancel``,
   SIGKILL lands mid-save: the tracker keeps naming the previous checkpoint;
4. a resubmitted job resumes from it and stops at ``--exit-interval``.

Every iteration any job logged (lm loss, grad norm) equals an uninterrupted run's (a reference
job, same script), so each resume continued exactly. No job output holds a traceback, and no
process of a job (helpers: the writer's results-queue Manager, DataLoader workers with
``--num-workers 1``, the ``--async-save`` writer of the srun form) outlives it. A job with 3 tasks,
which EP=2 does not divide, fails at parse time on every rank with one line naming SLURM_NTASKS.
"""

from __future__ import annotations

import os
import re
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests import _slow_save
from tests._slurm import SlurmCluster, SlurmUnavailable, _missing, job_pids, process_line

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "examples", "train_gpt_moe_slurm_cpu.sbatch")
KILL_WAIT = 30          # s from a job's SIGTERM to its SIGKILL (Slurm's default); a CPU save and exit
                        # take 1-20 s on a loaded 2-core machine
TIME_LIMIT_MIN = 10     # --time of the time-limit job at submission: no lead signal during start-up
LEAD_ROOM_S = 75        # once the requeued run trains, its limit is cut to the first whole minute
                        # at least this far ahead: the script's lead (60 s) and the update's own
                        # latency; slurmctld checks limits every 30 s, so the lead signal comes
                        # 30-75 s before the limit (a CPU save and exit take 1-20 s here)
SLOW_SAVE_S = 60        # tests/_slow_save.py's delay for the save that SIGKILL must cut
COMMON = ["--num-workers", "1"]
FORMS = {
    "torchrun": dict(options=[], env={}, extra=[]),
    "srun": dict(options=["--ntasks-per-node=2", "--cpus-per-task=1"], env={"LAUNCHER": "srun"},
                 extra=["--async-save"]),
}
JOB_TIMEOUT_S = 300     # bound of every wait on one job
REF_MARGIN = 60         # reference iterations past the time-limit stops (later jobs add 2-10 each)

ITER_RE = re.compile(r" iteration\s+(\d+)/\s*\d+ \|.*?\| lm loss: (\S+) \|.*?\| grad norm: (\S+) \|")
START_RE = re.compile(r"> training from iteration (\d+) to")
STOP_RE = re.compile(r"exiting program after receiving SIGTERM \(iteration (\d+)\)")
SAVED_RE = re.compile(r"(?:saved checkpoint|scheduled async save) at iteration\s+(\d+)")


def _run_time_s(text):
    """scontrol's RunTime ([D-]HH:MM:SS) in seconds."""
    days, _, hms = text.rpartition("-")
    h, m, sec = (int(v) for v in hms.split(":"))
    return int(days or 0) * 86400 + h * 3600 + m * 60 + sec


def _tracker(ckpt):
    path = os.path.join(ckpt, "latest_checkpointed_iteration.txt")
    return int(open(path).read()) if os.path.exists(path) else None


def segments(output: str) -> list:
    """One dict per run (start) in a job's output: start, {iteration: (loss, grad norm)}, stop,
    saved."""
    out = []
    parts = START_RE.split(output)
    for i in range(1, len(parts), 2):
        text = parts[i + 1]
        stop = STOP_RE.search(text)
        out.append(dict(start=int(parts[i]),
                        iters={int(m[0]): (m[1], m[2]) for m in ITER_RE.findall(text)},
                        stop=int(stop.group(1)) if stop else None,
                        saved=[int(v) for v in SAVED_RE.findall(text)]))
    return out


class Chain:
    """One launch form's jobs on one checkpoint directory."""

    def __init__(self, cluster, form, root):
        self.cluster, self.form = cluster, form
        self.ckpt = os.path.join(root, f"ckpt-{form}")
        self.facts = {}

    def submit(self, options=(), env=None, extra=()):
        spec = FORMS[self.form]
        job_env = {"PYTHON": sys.executable, "PYTHONPATH": ROOT, **spec["env"], **(env or {})}
        return self.cluster.sbatch(SCRIPT, self.ckpt, *COMMON, *spec["extra"], *extra,
                                   options=[*spec["options"], *options], env=job_env, cwd=ROOT)

    def wait_iteration(self, job, at_least, run=1):
        """Until the job's ``run``-th start has logged iteration >= at_least."""
        def reached(_, output):
            segs = segments(output)
            return len(segs) >= run and max(segs[run - 1]["iters"], default=-1) >= at_least
        self.cluster.wait_job(job, reached, JOB_TIMEOUT_S, f"run {run} at iteration {at_least}")

    def wait_gone(self, job):
        """The job ended and none of its processes is left (helpers included)."""
        fields = self.cluster.wait_done(job, JOB_TIMEOUT_S)
        deadline = time.monotonic() + KILL_WAIT + 30
        while job_pids(job) and time.monotonic() < deadline:
            time.sleep(0.3)
        left = {pid: process_line(pid) for pid in job_pids(job)}
        self.facts.setdefault("leftover", {})[job] = left
        return fields

    def requeue_then_time_limit(self):
        c, f = self.cluster, self.facts
        j = self.submit(options=[f"--time={TIME_LIMIT_MIN}"])
        self.wait_iteration(j, 3)
        c.run("scontrol", "requeue", str(j))
        # the requeued run trains (its SIGTERM handler is in place): its limit becomes the first
        # whole minute LEAD_ROOM_S ahead
        self.wait_iteration(j, 1, run=2)
        f["time_limit_min"] = -(-(_run_time_s(c.job(j)["RunTime"]) + LEAD_ROOM_S) // 60)
        c.run("scontrol", "update", f"JobId={j}", f"TimeLimit={f['time_limit_min']}")
        c.wait_job(j, lambda fields, out: len(segments(out)) >= 2 and fields.get("JobState") in
                   ("COMPLETED", "FAILED", "TIMEOUT", "CANCELLED"), JOB_TIMEOUT_S,
                   "the requeued run to end")
        f["requeue"] = dict(job=j, fields=self.wait_gone(j), output=c.output(j),
                            tracker=_tracker(self.ckpt))

    def scancels_then_resume(self):
        c, f = self.cluster, self.facts
        # scancel
        j = self.submit()
        self.wait_iteration(j, f["requeue"]["tracker"] + 2)
        c.run("scancel", str(j))
        f["scancel"] = dict(job=j, fields=self.wait_gone(j), output=c.output(j),
                            tracker=_tracker(self.ckpt))
        # scancel with a save slower than KillWait: SIGKILL mid-save
        j = self.submit(env=_slow_save.env(SLOW_SAVE_S, ROOT))
        self.wait_iteration(j, f["scancel"]["tracker"] + 2)
        c.run("scancel", str(j))
        f["killed"] = dict(job=j, fields=self.wait_gone(j), output=c.output(j),
                           tracker=_tracker(self.ckpt), listing=sorted(os.listdir(self.ckpt)))
        # resume from the tracker's checkpoint and stop at --exit-interval
        last = f["killed"]["tracker"]
        j = self.submit(extra=["--exit-interval", str(last + 3)])
        f["resume"] = dict(job=j, fields=self.wait_gone(j), output=c.output(j),
                           tracker=_tracker(self.ckpt))


def _in_parallel(calls):
    with ThreadPoolExecutor(len(calls)) as pool:
        for future in [pool.submit(call) for call in calls]:
            future.result()


@pytest.fixture(scope="module")
def slurm_runs(tmp_path_factory):
    if os.geteuid() != 0:
        missing = _missing()
        pytest.skip("a Slurm of its own needs root (slurmctld/slurmd as root"
                    + (f"; not installed: {', '.join(missing)}" if missing else "") + ")")
    root = str(tmp_path_factory.mktemp("slurm"))
    try:
        cluster = SlurmCluster.start(root, kill_wait=KILL_WAIT, cred_expire=10, cpus=16)
    except SlurmUnavailable as exc:   # CI's machine has apt: a missing Slurm is a failure
        pytest.fail(f"cannot run a Slurm here: {exc}")
    try:
        chains = {form: Chain(cluster, form, root) for form in FORMS}
        bad = Chain(cluster, "srun", root)   # 3 tasks: EP=2 does not divide them
        bad.ckpt = os.path.join(root, "ckpt-bad")
        bad_job = bad.submit(options=["--ntasks-per-node=3"])
        _in_parallel([chain.requeue_then_time_limit for chain in chains.values()])
        # the uninterrupted reference, beside the rest of the chains: the time-limit runs were
        # the long ones, the rest adds a few iterations each
        ref = Chain(cluster, "srun", root)
        ref.ckpt = os.path.join(root, "ckpt-reference")
        ref_end = max(ch.facts["requeue"]["tracker"] or 0 for ch in chains.values()) + REF_MARGIN
        ref_job = ref.submit(extra=["--exit-interval", str(ref_end)])
        _in_parallel([chain.scancels_then_resume for chain in chains.values()])
        ref.wait_gone(ref_job)
        yield dict(facts={form: chain.facts for form, chain in chains.items()},
                   reference=segments(cluster.output(ref_job))[0]["iters"],
                   bad=dict(fields=bad.wait_gone(bad_job), output=cluster.output(bad_job)))
    finally:
        cluster.stop()


def _no_traceback(output):
    assert "Traceback" not in output and "Exited with exit code" not in output, output[-4000:]


@pytest.mark.parametrize("form", FORMS)
def test_requeue_resumes_and_time_limit_lead_signal_saves(slurm_runs, form):
    r = slurm_runs["facts"][form]["requeue"]
    runs = segments(r["output"])
    assert len(runs) == 2 and r["fields"]["Restarts"] == "1", r["output"][-4000:]
    first, second = runs
    # scontrol requeue: every rank stopped after the same iteration and saved it
    assert first["stop"] is not None and first["saved"] == [first["stop"]], r["output"][-4000:]
    # the requeued run started on its own from that checkpoint ...
    assert second["start"] == first["stop"] and min(second["iters"]) == first["stop"] + 1
    # ... and the time limit's lead signal (#SBATCH --signal=TERM@60) stopped it with a save,
    # before the limit: the job COMPLETED with exit 0
    assert second["stop"] is not None and second["saved"][-1] == second["stop"]
    assert (r["fields"]["JobState"], r["fields"]["ExitCode"]) == ("COMPLETED", "0:0"), r["fields"]
    # ... under the cut limit
    assert r["fields"]["TimeLimit"] == f"00:{slurm_runs['facts'][form]['time_limit_min']:02d}:00"
    assert r["tracker"] == second["stop"]
    _no_traceback(r["output"])


def _resumed_job(slurm_runs, form, key, after):
    """The form's facts, job ``key``'s facts and its one run, which started from ``after``'s
    checkpoint."""
    facts = slurm_runs["facts"][form]
    (run,) = segments(facts[key]["output"])
    assert run["start"] == facts[after]["tracker"], facts[key]["output"][-4000:]
    return facts, facts[key], run


@pytest.mark.parametrize("form", FORMS)
def test_scancel_saves_the_iteration_every_rank_stopped_at(slurm_runs, form):
    facts, r, run = _resumed_job(slurm_runs, form, "scancel", after="requeue")
    assert run["stop"] is not None and run["saved"][-1:] == [run["stop"]], r["output"][-4000:]
    assert r["tracker"] == run["stop"]
    _no_traceback(r["output"])


@pytest.mark.parametrize("form", FORMS)
def test_sigkill_mid_save_keeps_the_previous_checkpoint(slurm_runs, form):
    facts, r, run = _resumed_job(slurm_runs, form, "killed", after="scancel")
    # the ranks stopped after their last logged iteration, and its save started (its .tmp is
    # there); SIGKILL cut it: no "saved" line (an --async-save logs when it is scheduled, before
    # the writes, and the rank then waits for them in the line that logs "exiting")
    stop = max(run["iters"])
    # the save's .tmp is there, cut by SIGKILL; or, when Slurm's SIGKILL reached a rank's
    # DataLoader worker a moment before the rank itself (it signals the step's processes one by
    # one), the rank saw the worker die mid-save (torch's SIGCHLD handler raises), reported the
    # save of that .tmp as failed and removed its partial files before its own SIGKILL: either
    # way the save had started and was cut, and the previous checkpoint stays the loaded one
    cut = f"iter_{stop:07d}.tmp" in r["listing"] or \
        f"iter_{stop:07d}.tmp: the save failed (RuntimeError: DataLoader worker" in r["output"]
    assert cut, (r["listing"], r["output"][-4000:])
    assert f"iter_{stop:07d}" not in r["listing"], r["listing"]
    assert (stop in run["saved"]) == ("--async-save" in FORMS[form]["extra"])
    assert run["stop"] in (None, stop)
    assert r["tracker"] == facts["scancel"]["tracker"]
    # ... and the next job loads the tracker's checkpoint
    resumed = facts["resume"]
    (run4,) = segments(resumed["output"])
    assert run4["start"] == r["tracker"] and max(run4["iters"]) == r["tracker"] + 3
    assert resumed["tracker"] == r["tracker"] + 3
    assert (resumed["fields"]["JobState"], resumed["fields"]["ExitCode"]) == ("COMPLETED", "0:0")
    _no_traceback(resumed["output"])


@pytest.mark.parametrize("form", FORMS)
def test_every_logged_iteration_equals_the_uninterrupted_run(slurm_runs, form):
    reference = slurm_runs["reference"]
    facts = slurm_runs["facts"][form]
    compared = 0
    for key in ("requeue", "scancel", "killed", "resume"):
        for run in segments(facts[key]["output"]):
            for it, values in run["iters"].items():
                assert it in reference, f"the reference stopped at {max(reference)} < {it}"
                assert values == reference[it], (key, it, values, reference[it])
                compared += 1
    # the chain covered iteration 1 to its end, with each resume's first iterations in it
    assert compared >= max(segments(facts["resume"]["output"])[0]["iters"])


@pytest.mark.parametrize("form", FORMS)
def test_no_process_outlives_its_job(slurm_runs, form):
    leftover = slurm_runs["facts"][form]["leftover"]
    assert len(leftover) == 4 and not any(leftover.values()), leftover


def test_ntasks_not_divisible_fails_at_parse_time_on_every_rank(slurm_runs):
    bad = slurm_runs["bad"]
    errors = [line for line in bad["output"].splitlines() if "error:" in line
              and "pretrain_gpt_moe.py" in line]
    expected = ("world size 3 (SLURM_NTASKS, srun's --ntasks) is not divisible by "
                "--expert-tensor-parallel-size (1) x --expert-model-parallel-size (2)")
    assert len(errors) == 3 and all(expected in line for line in errors), bad["output"][-3000:]
    assert "Traceback" not in bad["output"]
    assert bad["fields"]["JobState"] == "FAILED"
