"""A real SLURM cluster (slurmctld + N slurmd + munge) on this one machine, for tests.

Debian's slurm-wlm accepts several slurmd daemons on one host when each has its own
node name and port ("multiple slurmd"), so `LocalSlurmCluster(nnodes=2)` gives a
2-node partition whose nodes share the host's cores, memory, filesystem and loopback.
That is enough to run `sbatch scripts/multinode_trainer.slurm` for real: srun, the
c10d rendezvous between two torchrun agents, signals, requeue.

Everything lives in a fresh directory (config, state, spool, logs, pid files); the
daemons listen on free ports picked at start, so the cluster does not collide with
another SLURM on the machine. Clients find it through `SLURM_CONF` (see `env()`);
/etc/slurm is left alone. `stop()` cancels the cluster's jobs, then stops only the
processes this object started (by pid, after checking their name) and removes the
/etc/hosts line it may have added.

Needs root (slurmd runs jobs as root here, munged runs as `munge`). Missing packages
are installed with apt-get (slurmctld slurmd slurm-client munge, no recommends).

Command line, for poking at it by hand:
    python tests/slurm_cluster.py up [--nodes 2] [--dir /tmp/titan-slurm]   # prints `export SLURM_CONF=...`
    python tests/slurm_cluster.py down --dir /tmp/titan-slurm
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge")
BINARIES = {"slurmctld": "slurmctld", "slurmd": "slurmd", "sbatch": "slurm-client", "munged": "munge"}
HOSTS_MARK = "# titan-slurm-test"


class ClusterUnavailable(RuntimeError):
    """The cluster cannot be had on this machine (not root, no apt, ...): tests skip."""


class ClusterError(RuntimeError):
    """The packages are there but the cluster did not come up: tests fail."""


def _log(msg: str) -> None:
    print(f"[slurm_cluster] {msg}", file=sys.stderr, flush=True)


def _run(cmd: list[str], env: dict | None = None, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, env=env, check=check, timeout=timeout, capture_output=True, text=True)


# ----------------------------------------------------------------------------- packages

def missing_packages() -> list[str]:
    return sorted({pkg for binary, pkg in BINARIES.items() if shutil.which(binary) is None
                   and not os.path.exists(f"/usr/sbin/{binary}")})


def ensure_packages() -> None:
    """apt-get installs slurm + munge if any is missing; raises ClusterUnavailable if it cannot."""
    missing = missing_packages()
    if not missing:
        return
    if os.geteuid() != 0:
        raise ClusterUnavailable(f"SLURM packages missing ({', '.join(missing)}) and not root to install them")
    if shutil.which("apt-get") is None:
        raise ClusterUnavailable(f"SLURM packages missing ({', '.join(missing)}) and no apt-get")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    _log(f"installing {' '.join(PACKAGES)} with apt-get")
    t0 = time.time()
    for cmd in (["apt-get", "update", "-qq"],
                ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *PACKAGES]):
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        if proc.returncode != 0:
            raise ClusterUnavailable(f"{' '.join(cmd)} failed (rc {proc.returncode}): "
                                     f"{(proc.stderr or proc.stdout).strip()[-500:]}")
    if missing_packages():
        raise ClusterUnavailable(f"still missing after apt-get: {missing_packages()}")
    _log(f"packages installed in {time.time() - t0:.1f}s")


# ----------------------------------------------------------------------------- helpers

def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


def free_port_range(count: int, start: int = 21000, stop: int = 32000, avoid: set[int] | None = None) -> int:
    """First port p (randomized start) such that p..p+count-1 are all bindable and not in `avoid`."""
    import random

    avoid = avoid or set()
    span = stop - start
    offset = random.randrange(span)
    for i in range(0, span, count + 1):
        base = start + (offset + i) % (span - count)
        ports = range(base, base + count)
        if not avoid.intersection(ports) and all(_port_free(p) for p in ports):
            return base
    raise ClusterUnavailable("no free port range found")


def free_port(avoid: set[int] | None = None) -> int:
    return free_port_range(1, avoid=avoid)


def _proc_comm(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return None


def _pid_alive(pid: int, comm: str) -> bool:
    """True if `pid` runs and is `comm` (a zombie counts as gone)."""
    if _proc_comm(pid) != comm:
        return False
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def _stop_pid(pid: int, comm: str, timeout: float = 10.0) -> None:
    """TERM, wait, KILL - only if `pid` is still the `comm` we started."""
    if not _pid_alive(pid, comm):
        return
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.time() + timeout
    while time.time() < deadline and _pid_alive(pid, comm):
        time.sleep(0.1)
    if _pid_alive(pid, comm):
        _log(f"{comm} pid {pid} ignored SIGTERM; SIGKILL")
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _munge_works() -> bool:
    try:
        m = subprocess.run(["munge", "-n"], capture_output=True, timeout=10)
        if m.returncode != 0:
            return False
        u = subprocess.run(["unmunge"], input=m.stdout, capture_output=True, timeout=10)
        return u.returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


# ----------------------------------------------------------------------------- the cluster

class LocalSlurmCluster:
    """`start()` brings up munge + slurmctld + `nnodes` slurmd; `stop()` takes down what it started."""

    def __init__(self, nnodes: int = 2, root: str | os.PathLike | None = None, node_prefix: str = "tn",
                 partition: str = "debug", cpus_per_node: int | None = None, kill_wait: int = 15) -> None:
        self.nnodes = nnodes
        self.root = Path(root) if root else Path(tempfile.mkdtemp(prefix="titan-slurm-"))
        self.node_prefix = node_prefix
        self.partition = partition
        self.cpus_per_node = cpus_per_node or os.cpu_count() or 1
        self.kill_wait = kill_wait
        self.nodes = [f"{node_prefix}{k}" for k in range(1, nnodes + 1)]
        self.conf = self.root / "etc" / "slurm.conf"
        self.log_dir = self.root / "log"
        self.run_dir = self.root / "run"
        self.started: dict[str, tuple[int, str]] = {}  # name -> (pid, comm)
        self._procs: dict[str, subprocess.Popen] = {}  # the daemons spawned by this object
        self.ctld_port: int | None = None
        self.slurmd_port_base: int | None = None

    # -- client side
    def env(self, base: dict | None = None) -> dict:
        """Environment for sbatch/squeue/scontrol (and, exported by sbatch, for the jobs)."""
        env = dict(os.environ if base is None else base)
        env["SLURM_CONF"] = str(self.conf)
        return env

    def cmd(self, *args: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess:
        return _run(list(args), env=self.env(), check=check, timeout=timeout)

    # -- lifecycle
    def start(self, timeout: float = 90) -> None:
        if os.geteuid() != 0:
            raise ClusterUnavailable("a local SLURM cluster needs root")
        ensure_packages()
        t0 = time.time()
        for sub in ("etc", "state", "spool", "log", "run"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        try:
            self._start_munge()
            self._write_conf()
            self._start_daemons()
            self._ensure_hostname_resolves()
            self._wait_idle(timeout)
        except BaseException:
            self.stop()
            raise
        _log(f"cluster up in {time.time() - t0:.1f}s: nodes {','.join(self.nodes)}, "
             f"slurmctld :{self.ctld_port}, SLURM_CONF={self.conf}")

    def _start_munge(self) -> None:
        if _munge_works():
            return
        key = Path("/etc/munge/munge.key")
        if not key.exists() or key.stat().st_size == 0:
            key.parent.mkdir(parents=True, exist_ok=True)
            _run(["mungekey", "--create", f"--keyfile={key}"])
            shutil.chown(key, "munge", "munge")
            key.chmod(0o400)
        for d in ("/run/munge", "/var/log/munge", "/var/lib/munge"):
            Path(d).mkdir(parents=True, exist_ok=True)
            shutil.chown(d, "munge", "munge")
        Path("/run/munge").chmod(0o755)
        pidfile = Path("/run/munge/munged.pid")
        pidfile.unlink(missing_ok=True)
        _run(["runuser", "-u", "munge", "--", "/usr/sbin/munged"])  # daemonizes, writes pidfile
        for _ in range(100):
            if pidfile.exists() and pidfile.read_text().strip():
                break
            time.sleep(0.05)
        pid = int(pidfile.read_text().strip())
        self.started["munged"] = (pid, "munged")
        self._save_pids()
        for _ in range(50):
            if _munge_works():
                return
            time.sleep(0.1)
        raise ClusterError("munged started but munge -n | unmunge fails")

    def _write_conf(self) -> None:
        self.ctld_port = free_port()
        self.slurmd_port_base = free_port_range(self.nnodes, avoid={self.ctld_port})
        host = socket.gethostname()
        first, last = self.slurmd_port_base, self.slurmd_port_base + self.nnodes - 1
        if self.nnodes == 1:
            nodespec, portspec = self.nodes[0], str(first)
        else:
            nodespec = f"{self.node_prefix}[1-{self.nnodes}]"
            portspec = f"[{first}-{last}]"
        mem_total = int(re.search(r"MemTotal:\s+(\d+)", Path("/proc/meminfo").read_text()).group(1)) // 1024
        mem = max(256, mem_total * 80 // 100 // self.nnodes)
        r = self.root
        self.conf.write_text(f"""\
# written by tests/slurm_cluster.py: {self.nnodes} emulated node(s) on {host}
ClusterName=titantest
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={self.ctld_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
# cred_expire also sets how long a requeued job waits before it may start again (default 120 s)
AuthInfo=cred_expire=10
CredType=cred/munge
StateSaveLocation={r}/state
SlurmdSpoolDir={r}/spool/%n
SlurmctldPidFile={r}/run/slurmctld.daemon.pid
SlurmdPidFile={r}/run/slurmd-%n.daemon.pid
SlurmctldLogFile={r}/log/slurmctld.log
SlurmdLogFile={r}/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/builtin
# run the main scheduling loop every 2 s (default 60 s): a requeued job starts once eligible, not a minute later
SchedulerParameters=sched_interval=2
MpiDefault=none
SwitchType=switch/none
ReturnToService=2
EnforcePartLimits=ALL
JobRequeue=1
SlurmdTimeout=120
KillWait={self.kill_wait}
MailProg=/bin/true
NodeName={nodespec} NodeHostname={host} NodeAddr=127.0.0.1 Port={portspec} CPUs={self.cpus_per_node} RealMemory={mem} State=UNKNOWN
PartitionName={self.partition} Nodes=ALL Default=YES MaxTime=INFINITE State=UP
""")
        for n in self.nodes:
            (self.root / "spool" / n).mkdir(parents=True, exist_ok=True)

    def _spawn(self, name: str, cmd: list[str], comm: str) -> None:
        out = open(self.log_dir / f"{name}.out", "ab")
        # SLURM_CONF in the daemons' environment: slurm looks for gres.conf/plugstack.conf next to it
        proc = subprocess.Popen(cmd, env=self.env(), stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                                start_new_session=True)
        out.close()
        self._procs[name] = proc
        self.started[name] = (proc.pid, comm)
        self._save_pids()

    def _alive(self, name: str) -> bool:
        # A child spawned here is checked through its Popen (right after the fork its comm is still
        # python's); anything else (munged daemonizes, `down` from another process) by pid + comm.
        if name in self._procs:
            return self._procs[name].poll() is None
        return name in self.started and _pid_alive(*self.started[name])

    def _stop(self, name: str) -> None:
        proc = self._procs.pop(name, None)
        if proc is None:
            if name in self.started:
                _stop_pid(*self.started[name])
            return
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                _log(f"{name} pid {proc.pid} ignored SIGTERM; SIGKILL")
                proc.kill()
                proc.wait(timeout=10)

    def _start_daemons(self) -> None:
        self._spawn("slurmctld", ["slurmctld", "-D", "-f", str(self.conf)], "slurmctld")
        deadline = time.time() + 20
        while time.time() < deadline:
            ping = self.cmd("scontrol", "ping", check=False)
            if "UP" in ping.stdout:
                break
            if not self._alive("slurmctld"):
                break
            time.sleep(0.2)
        else:
            raise ClusterError(f"slurmctld not up; see {self.log_dir}")
        if not self._alive("slurmctld"):
            raise ClusterError(f"slurmctld died: {self._tail('slurmctld.out')}{self._tail('slurmctld.log')}")
        for n in self.nodes:
            self._spawn(f"slurmd-{n}", ["slurmd", "-D", "-N", n, "-f", str(self.conf)], "slurmd")

    def _ensure_hostname_resolves(self) -> None:
        """`hostname --ip-address` (used by the batch script to find the head) needs the host name to resolve."""
        host = socket.gethostname()
        try:
            socket.gethostbyname(host)
            return
        except OSError:
            pass
        text = Path("/etc/hosts").read_text()
        # /etc/hosts may be a bind mount: rewrite in place
        with open("/etc/hosts", "w") as f:
            f.write(text.rstrip("\n") + f"\n127.0.0.1 {host} {HOSTS_MARK} {self.root}\n")
        self.started["hosts"] = (0, "")
        self._save_pids()

    def _wait_idle(self, timeout: float) -> None:
        deadline = time.time() + timeout
        resumed = False
        t0 = time.time()
        while time.time() < deadline:
            out = self.cmd("sinfo", "-h", "-N", "-o", "%N %t", check=False).stdout.split("\n")
            states = dict(line.split() for line in out if len(line.split()) == 2)
            if all(states.get(n) in ("idle", "mix", "alloc") for n in self.nodes):
                return
            for name, (pid, comm) in self.started.items():
                if comm in ("slurmd", "slurmctld") and not self._alive(name):
                    raise ClusterError(f"{name} died: {self._tail(name + '.out')}")
            if not resumed and time.time() - t0 > 5:
                self.cmd("scontrol", "update", f"NodeName={','.join(self.nodes)}", "State=RESUME", check=False)
                resumed = True
            time.sleep(0.2)
        raise ClusterError(f"nodes not idle after {timeout}s: {states}; see {self.log_dir}")

    def _tail(self, name: str, n: int = 2000) -> str:
        try:
            return (self.log_dir / name).read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def _save_pids(self) -> None:
        (self.run_dir / "started.json").write_text(json.dumps(self.started))

    def stop(self) -> None:
        """Cancel jobs, stop our daemons (by pid), remove our /etc/hosts line. Safe to call twice."""
        if not self.started and (self.run_dir / "started.json").exists():
            self.started = {k: tuple(v) for k, v in json.loads((self.run_dir / "started.json").read_text()).items()}
        try:  # let running jobs end while slurmd is still there to clean up after them
            if self._alive("slurmctld"):
                jobs = self.cmd("squeue", "-h", "-o", "%i", check=False, timeout=20).stdout.split()
                if jobs:
                    _log(f"cancelling jobs {' '.join(jobs)}")
                    self.cmd("scancel", *jobs, check=False, timeout=20)
                    deadline = time.time() + self.kill_wait + 20
                    while time.time() < deadline and \
                            self.cmd("squeue", "-h", "-o", "%i", check=False, timeout=20).stdout.strip():
                        time.sleep(0.3)
        except (OSError, subprocess.SubprocessError) as e:
            _log(f"could not cancel jobs: {e}")
        for name, (pid, comm) in list(self.started.items()):
            if comm == "slurmd":
                self._stop(name)
        for name in ("slurmctld", "munged"):
            self._stop(name)
        self._kill_leftover_stepds()
        if "hosts" in self.started:
            text = Path("/etc/hosts").read_text()
            keep = [line for line in text.splitlines() if f"{HOSTS_MARK} {self.root}" not in line]
            with open("/etc/hosts", "w") as f:
                f.write("\n".join(keep) + "\n")
        self.started = {}
        if self.run_dir.exists():
            self._save_pids()

    def _kill_leftover_stepds(self) -> None:
        """slurmstepd processes of this cluster (their spool dir is under our root) that outlived slurmd."""
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or _proc_comm(int(entry.name)) != "slurmstepd":
                continue
            try:
                environ = (entry / "environ").read_bytes()
            except OSError:
                continue
            if f"SLURM_CONF={self.conf}".encode() in environ:
                _log(f"slurmstepd pid {entry.name} outlived its slurmd; stopping it")
                _stop_pid(int(entry.name), "slurmstepd", timeout=5)

    def __enter__(self) -> "LocalSlurmCluster":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- jobs
    def sbatch(self, *args: str, env: dict | None = None, cwd: str | os.PathLike | None = None) -> int:
        proc = subprocess.run(["sbatch", "--parsable", *args], env=self.env(env), cwd=cwd,
                              capture_output=True, text=True, timeout=60)
        if proc.returncode != 0:
            raise RuntimeError(f"sbatch failed ({proc.returncode}): {proc.stderr.strip()}")
        return int(proc.stdout.strip().split(";")[0])

    def job_info(self, job_id: int) -> dict[str, str]:
        """`scontrol show job -o` as a dict ({} once the job is forgotten)."""
        out = self.cmd("scontrol", "-o", "show", "job", str(job_id), check=False).stdout.strip()
        info = {}
        for tok in out.split():
            if "=" in tok:
                k, v = tok.split("=", 1)
                info.setdefault(k, v)
        return info

    def job_state(self, job_id: int) -> str:
        return self.job_info(job_id).get("JobState", "UNKNOWN")

    def wait_job(self, job_id: int, timeout: float = 300, poll: float = 0.3) -> dict[str, str]:
        """Polls until the job reaches a final state (requeues included); returns its last job_info."""
        final = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL",
                 "DEADLINE", "PREEMPTED"}
        deadline = time.time() + timeout
        info: dict[str, str] = {}
        while time.time() < deadline:
            info = self.job_info(job_id)
            if info.get("JobState") in final:
                return info
            time.sleep(poll)
        raise TimeoutError(f"job {job_id} not done after {timeout}s: {info}")


def _main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("action", choices=("up", "down"))
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--dir", default="/tmp/titan-slurm")
    args = ap.parse_args()
    cluster = LocalSlurmCluster(nnodes=args.nodes, root=args.dir)
    if args.action == "up":
        cluster.start()
        print(f"export SLURM_CONF={cluster.conf}")
    else:
        cluster.stop()


if __name__ == "__main__":
    _main()
