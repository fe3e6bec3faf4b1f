"""A real one-node Slurm (Debian's slurm-wlm 22.05: munged, slurmctld, slurmd) for the tests.

``SlurmCluster.start(dir)`` installs slurm-wlm and munge with apt when they are missing (as root,
what CI runs as), writes a slurm.conf for this host, starts the daemons in the foreground as
children of the test process and waits until the node is idle; ``stop()`` cancels what is left and
stops them. Clients (sbatch, squeue, scontrol, scancel) get ``SLURM_CONF`` from ``self.env``.

Choices, each for a reason this machine shows:
* ``ProctrackType=proctrack/linuxproc``: Slurm tracks a step's processes through the process
  tree. The usual ``proctrack/cgroup`` (the configurator's default; Debian ships no slurm.conf)
  starts here, but a scancel'ed step's tasks never ran their SIGTERM handlers (gVisor, cgroup v1:
  a task that traps SIGTERM printed nothing and ended at once); with linuxproc the task and a
  child in its own session got SIGTERM and ran on, as on a cluster. ``proctrack/pgid`` would lose
  torchrun's workers (torch elastic starts each in its own session).
* ``TaskPlugin=task/none``: no cgroup/affinity confinement (same reason).
* ``SlurmdParameters=config_overrides`` with more CPUs than the machine has, so a 2-4 task job fits
  on a 2-core CI machine (the tests are CPU-light; oversubscription only slows them).
* ``AuthInfo=cred_expire``: a requeued job waits this long before it starts again (120 s by
  default); short here so the requeue test finishes in CI's budget.
* ``KillWait``: the seconds between a job's SIGTERM and SIGKILL, per cluster.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import time

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "squeue", "scontrol", "scancel", "sinfo")
APT_TIMEOUT_S = 900
MUNGE_SOCKET = "/run/munge/munge.socket.2"


class SlurmUnavailable(RuntimeError):
    """Slurm could not be installed or started; the message says why."""


def _missing():
    paths = {name: shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin")
             for name in DAEMONS + CLIENTS}
    return sorted(name for name, path in paths.items() if path is None)


def ensure_installed():
    """apt-get install slurm-wlm munge when a daemon or client is missing (root only)."""
    missing = _missing()
    if not missing:
        return
    if os.geteuid() != 0:
        raise PermissionError(f"Slurm is not installed ({', '.join(missing)} missing) and "
                              f"installing slurm-wlm needs root")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    install = ["apt-get", "install", "-y", "-q", "--no-install-recommends", "slurm-wlm", "munge"]
    log = []
    for cmd in (install, ["apt-get", "update", "-q"], install):
        try:
            out = subprocess.run(cmd, env=env, capture_output=True, text=True,
                                 timeout=APT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise SlurmUnavailable(f"{' '.join(cmd)} did not finish in {APT_TIMEOUT_S} s") from None
        log.append(f"$ {' '.join(cmd)} -> {out.returncode}\n{out.stdout[-1500:]}{out.stderr[-1500:]}")
        if cmd is install and out.returncode == 0 and not _missing():
            return
    raise SlurmUnavailable("apt-get could not install slurm-wlm and munge:\n" + "\n".join(log))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _sbin(name):
    return shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin")


class SlurmCluster:
    def __init__(self, root: str, cpus: int, kill_wait: int, cred_expire: int):
        self.root = root
        self.host = socket.gethostname().split(".")[0]
        self.cpus, self.kill_wait, self.cred_expire = cpus, kill_wait, cred_expire
        self.conf = os.path.join(root, "slurm.conf")
        self.env = dict(os.environ, SLURM_CONF=self.conf)
        for name in list(self.env):   # a test run inside an allocation must not leak into jobs
            if name.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_")) and name != "SLURM_CONF":
                del self.env[name]
        self.procs = {}
        self.logs = {}

    # --- lifecycle ----------------------------------------------------------------------------
    @classmethod
    def start(cls, root: str, kill_wait: int = 20, cred_expire: int = 10, cpus: int = 8,
              timeout_s: float = 90):
        ensure_installed()
        cluster = cls(root, cpus, kill_wait, cred_expire)
        try:
            cluster._write_conf()
            cluster._start_munge()
            cluster._spawn("slurmctld", [_sbin("slurmctld"), "-D", "-i", "-f", cluster.conf])
            cluster._spawn("slurmd", [_sbin("slurmd"), "-D", "-f", cluster.conf])
            cluster._wait_idle(timeout_s)
        except BaseException:
            cluster.stop()
            raise
        return cluster

    def _write_conf(self):
        for sub in ("state", "spool", "jobs"):
            os.makedirs(os.path.join(self.root, sub), exist_ok=True)
        real = os.cpu_count() or 1
        with open(self.conf, "w") as f:
            f.write(f"""\
ClusterName=megatronmoe
SlurmctldHost={self.host}(127.0.0.1)
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=cred_expire={self.cred_expire}
StateSaveLocation={self.root}/state
SlurmdSpoolDir={self.root}/spool
SlurmctldPidFile={self.root}/slurmctld.pid
SlurmdPidFile={self.root}/slurmd.pid
SlurmctldLogFile={self.root}/slurmctld.log
SlurmdLogFile={self.root}/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
MpiDefault=none
ReturnToService=2
KillWait={self.kill_wait}
InactiveLimit=0
MinJobAge=600
SlurmdParameters=config_overrides
# {real} real cores: config_overrides lets slurmd offer {self.cpus}
NodeName={self.host} NodeAddr=127.0.0.1 CPUs={self.cpus} State=UNKNOWN
PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP
""")

    def _munge_works(self) -> bool:
        try:
            token = subprocess.run(["munge", "-n"], capture_output=True, timeout=10)
            if token.returncode != 0:
                return False
            back = subprocess.run(["unmunge"], input=token.stdout, capture_output=True, timeout=10)
            return back.returncode == 0
        except (OSError, subprocess.TimeoutExpired):
            return False

    def _start_munge(self):
        if self._munge_works():      # a munged already runs here: use it, leave it running
            return
        os.makedirs(os.path.dirname(MUNGE_SOCKET), exist_ok=True)
        shutil.chown(os.path.dirname(MUNGE_SOCKET), "munge", "munge")
        if not os.path.exists("/etc/munge/munge.key"):
            subprocess.run(["mungekey", "--create"], check=True, timeout=30, capture_output=True)
            shutil.chown("/etc/munge/munge.key", "munge", "munge")
        self._spawn("munged", [_sbin("munged"), "-F"], user="munge")
        self._wait(self._munge_works, 30, "munged to answer")

    def _spawn(self, name, cmd, **kw):
        log = open(os.path.join(self.root, f"{name}.stdout"), "w")
        self.logs[name] = log.name
        self.procs[name] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                            env=self.env, start_new_session=True, **kw)

    def _wait(self, predicate, timeout_s, what):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    raise SlurmUnavailable(f"{name} exited ({proc.returncode}) while waiting for "
                                           f"{what}:\n{self.log_tail(name)}")
            value = predicate()
            if value:
                return value
            time.sleep(0.5)
        raise SlurmUnavailable(f"timed out after {timeout_s} s waiting for {what}:\n"
                               + "\n".join(self.log_tail(n) for n in self.procs))

    def _wait_idle(self, timeout_s):
        def idle():
            out = subprocess.run(["sinfo", "-h", "-o", "%T"], env=self.env, capture_output=True,
                                 text=True, timeout=15)
            return out.returncode == 0 and out.stdout.strip() == "idle"

        self._wait(idle, timeout_s, "the node to be idle")

    def log_tail(self, name, chars=3000) -> str:
        paths = [self.logs.get(name), os.path.join(self.root, f"{name}.log")]
        text = ""
        for path in paths:
            if path and os.path.exists(path):
                with open(path, errors="replace") as f:
                    text += f"--- {path}\n" + f.read()[-chars:]
        return text

    def stop(self):
        """Cancel every job (waiting for their processes to end), then stop the daemons."""
        if "slurmctld" in self.procs and self.procs["slurmctld"].poll() is None:
            try:
                self.run("scancel", "--full", "--user", "root", check=False)
                deadline = time.monotonic() + self.kill_wait + 30
                while time.monotonic() < deadline and self.run("squeue", "-h", check=False).strip():
                    time.sleep(0.5)
            except (OSError, subprocess.SubprocessError):
                pass
        for name in ("slurmd", "slurmctld", "munged"):
            proc = self.procs.pop(name, None)
            if proc is None or proc.poll() is not None:
                continue
            proc.terminate()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=15)

    # --- clients ------------------------------------------------------------------------------
    def run(self, *cmd, check=True, timeout=30) -> str:
        out = subprocess.run(list(cmd), env=self.env, capture_output=True, text=True,
                             timeout=timeout)
        if check and out.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} -> {out.returncode}: {out.stderr.strip()}")
        return out.stdout

    def sbatch(self, script, *script_args, options=(), env=None, cwd=None) -> int:
        """Submit from ``cwd`` (the job's SLURM_SUBMIT_DIR); its output goes to ``output(job)``."""
        out_pattern = os.path.join(self.root, "jobs", "%j.out")
        run_env = dict(self.env, **(env or {}))
        out = subprocess.run(["sbatch", "--parsable", f"--output={out_pattern}",
                              f"--chdir={self.root}", *options, script, *script_args],
                             env=run_env, capture_output=True, text=True, timeout=30, cwd=cwd)
        if out.returncode != 0:
            raise RuntimeError(f"sbatch {script} -> {out.returncode}: {out.stderr.strip()}")
        return int(out.stdout.strip().split(";")[0])

    def output(self, job) -> str:
        path = os.path.join(self.root, "jobs", f"{job}.out")
        if not os.path.exists(path):
            return ""
        with open(path, errors="replace") as f:
            return f.read()

    def job(self, job) -> dict:
        """``scontrol show job``'s fields (JobState, ExitCode, Restarts, ...)."""
        text = self.run("scontrol", "show", "job", "-o", str(job))
        return dict(re.findall(r"(\w+)=(\S*)", text))

    def wait_job(self, job, predicate, timeout_s, what):
        """Poll scontrol until predicate(fields, output) is truthy; fail with the job output."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            fields = self.job(job)
            value = predicate(fields, self.output(job))
            if value:
                return value
            time.sleep(0.3)
        raise AssertionError(f"job {job}: timed out after {timeout_s} s waiting for {what}; "
                             f"state {self.job(job).get('JobState')}\n{self.output(job)[-4000:]}")

    def wait_done(self, job, timeout_s) -> dict:
        done = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
                "PREEMPTED", "BOOT_FAIL", "DEADLINE")
        return self.wait_job(job, lambda f, _: f if f.get("JobState") in done else None,
                             timeout_s, "the job to end")


def job_pids(job) -> list:
    """Processes on this machine that belong to ``job`` (SLURM_JOB_ID in their environment):
    the batch shell, srun, torchrun, ranks and every helper they started."""
    needle = f"SLURM_JOB_ID={job}".encode()
    pids = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    with open(f"/proc/{pid}/stat") as st:
                        if st.read().rsplit(")", 1)[1].split()[0] != "Z":
                            pids.append(int(pid))
        except OSError:
            continue
    return pids


def process_line(pid) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return "?"
