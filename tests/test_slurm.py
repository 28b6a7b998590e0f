"""scripts/multinode_trainer.slurm on a real (local, 2-node) SLURM cluster.

The cluster is started once per session by `tests/slurm_cluster.py` (apt-get installs
slurm + munge if missing; needs root, otherwise the tests skip) and always torn down.
Each job gets its own rendezvous port, dump folder and log folder.

  - a 2-node x 1-process job trains, and its per-step losses match one process on one
    node (./run_train.sh, same global batch through gradient accumulation) to 1e-5;
  - `scancel --signal=USR1` mid-run: the job checkpoints at the current step, requeues
    itself, resumes and finishes; the union of both runs' losses is bitwise equal to an
    uninterrupted job, with no step repeated or skipped;
  - a typo in an override fails the job in seconds with the one-line config error.

Both layouts start from one seed checkpoint (the model init depends on the FSDP layout).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.slurm_cluster import ClusterUnavailable, LocalSlurmCluster, free_port
from trainer.launch import child_pids


REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "multinode_trainer.slurm"
STEPS = 12
LOCAL_BATCH = 2
NNODES = 2
# Small and fast on 2 shared cores (~0.5 s/step), checkpoints on, one loss line per step.
TRAIN_ARGS = ["--training.steps", str(STEPS), "--training.seq_len", "32", "--training.local_batch_size",
              str(LOCAL_BATCH), "--data.type", "builtin", "--metrics.log_freq", "1",
              "--metrics.enable_tensorboard", "false", "--checkpoint.enable", "true",
              "--checkpoint.interval", "1000", "--checkpoint.keep_latest_k", "0"]
CONFIG = "train_configs/llama_debug.toml"


def _env(**extra: str) -> dict:
    env = dict(os.environ)
    env.update(PYTHON=sys.executable, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    env.update(extra)
    return env


@pytest.fixture(scope="session")
def cluster():
    if os.geteuid() != 0:
        pytest.skip("the local SLURM cluster needs root (slurmd runs jobs as root, munged as munge)")
    c = LocalSlurmCluster(nnodes=NNODES + 1)  # one node more: the spare of tests/test_slurm_ft.py
    try:
        t0 = time.time()
        try:
            c.start()
        except ClusterUnavailable as e:
            pytest.skip(f"no local SLURM cluster: {e}")
        print(f"\n[test_slurm] cluster up in {time.time() - t0:.1f}s ({c.root})", file=sys.stderr)
        yield c
    finally:
        c.stop()
        shutil.rmtree(c.root, ignore_errors=True)


def read_losses(dump: Path) -> list[tuple[int, float]]:
    path = dump / "metrics.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        if line.strip():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:  # a line being written right now
                continue
            out.append((rec["step"], rec["loss"]))
    return out


class Job:
    def __init__(self, cluster: LocalSlurmCluster, workdir: Path, train_args: list[str], name: str):
        self.cluster, self.workdir, self.name = cluster, workdir, name
        self.dump = workdir / "dump"
        self.log_dir = workdir / "logs"
        self.out = workdir / "job.out"
        workdir.mkdir(parents=True, exist_ok=True)
        self.t0 = time.time()
        self.id = cluster.sbatch(
            f"--job-name={name}", f"--nodes={NNODES}", "--gpus-per-node=0", f"--output={self.out}", str(SCRIPT),
            "--job.dump_folder", str(self.dump), *train_args,
            env=_env(CONFIG_FILE=CONFIG, LOG_DIR=str(self.log_dir), RDZV_PORT=str(free_port()), REPO_DIR=str(REPO)),
            cwd=REPO)

    def wait(self, timeout: float = 400) -> dict[str, str]:
        try:
            info = self.cluster.wait_job(self.id, timeout=timeout)
        except TimeoutError:
            self.cluster.cmd("scancel", str(self.id), check=False)
            raise AssertionError(f"job {self.id} did not finish in {timeout}s\n{self.logs()}") from None
        self.wall = time.time() - self.t0
        print(f"[test_slurm] job {self.name} ({self.id}): {info.get('JobState')} in {self.wall:.1f}s, "
              f"restarts {info.get('Restarts')}", file=sys.stderr)
        return info

    def logs(self) -> str:
        parts = [f"--- {self.out}\n{self.out.read_text(errors='replace') if self.out.exists() else '(none)'}"]
        for f in sorted(self.log_dir.glob("*.log")) if self.log_dir.exists() else []:
            parts.append(f"--- {f.name}\n{f.read_text(errors='replace')[-3000:]}")
        return "\n".join(parts)


@pytest.fixture(scope="session")
def seed_checkpoint(tmp_path_factory) -> Path:
    """Model weights initialised by one process, so that differently sharded runs start equal."""
    dump = tmp_path_factory.mktemp("seed")
    proc = subprocess.run(["./run_train.sh", "--config", CONFIG, "--job.dump_folder", str(dump),
                           "--checkpoint.enable", "true", "--checkpoint.create_seed_checkpoint", "true",
                           "--metrics.enable_tensorboard", "false"],
                          cwd=REPO, env=_env(NPROC="1"), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    step0 = dump / "checkpoint" / "step-0"
    assert step0.is_dir(), list(dump.rglob("*"))
    return step0


@pytest.fixture(scope="session")
def reference_job(cluster, seed_checkpoint, tmp_path_factory) -> Job:
    """An uninterrupted 2-node x 1-process job."""
    job = Job(cluster, tmp_path_factory.mktemp("ref"),
              [*TRAIN_ARGS, "--checkpoint.initial_load_path", str(seed_checkpoint)], "titan-ref")
    info = job.wait()
    assert info["JobState"] == "COMPLETED", job.logs()
    return job


@pytest.mark.slurm
@pytest.mark.timeout(900)
def test_two_node_job_matches_single_node(reference_job, seed_checkpoint, tmp_path):
    job = reference_job
    losses = read_losses(job.dump)
    assert [s for s, _ in losses] == list(range(1, STEPS + 1)), job.logs()
    # one torchrun agent per node, each with its own log
    node_logs = sorted(job.log_dir.glob("node*-r0.log"))
    assert len(node_logs) == NNODES, job.logs()
    assert "world 2" in "".join(f.read_text() for f in node_logs)
    assert (job.dump / "checkpoint" / f"step-{STEPS}").is_dir()

    # The same global batch on one node, one process: local batch x 2 by gradient accumulation.
    single = tmp_path / "single"
    t0 = time.time()
    proc = subprocess.run(["./run_train.sh", "--config", CONFIG, "--job.dump_folder", str(single), *TRAIN_ARGS,
                           "--training.global_batch_size", str(LOCAL_BATCH * NNODES),
                           "--checkpoint.initial_load_path", str(seed_checkpoint)],
                          cwd=REPO, env=_env(NPROC="1"), capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    print(f"[test_slurm] single-node run_train.sh: {time.time() - t0:.1f}s", file=sys.stderr)
    ref = read_losses(single)
    assert [s for s, _ in ref] == list(range(1, STEPS + 1))
    for (step, a), (_, b) in zip(losses, ref):
        assert abs(a - b) <= 1e-5, f"step {step}: 2 nodes {a} vs 1 node {b}\n{losses}\n{ref}"


@pytest.mark.slurm
@pytest.mark.timeout(900)
def test_preempt_requeue_resume_is_bitwise(cluster, reference_job, seed_checkpoint, tmp_path):
    job = Job(cluster, tmp_path / "preempt",
              [*TRAIN_ARGS, "--checkpoint.initial_load_path", str(seed_checkpoint)], "titan-preempt")
    # Preempt once a few steps are in: USR1 to the job step (as `#SBATCH --signal=USR1@T` or an
    # admin would), then a second one while the first is being handled (must change nothing).
    deadline = time.time() + 300
    while len(read_losses(job.dump)) < 2:
        assert time.time() < deadline, job.logs()
        assert cluster.job_state(job.id) in ("PENDING", "RUNNING", "CONFIGURING"), job.logs()
        time.sleep(0.1)
    cluster.cmd("scancel", "--signal=USR1", str(job.id))
    signalled_at = len(read_losses(job.dump))
    time.sleep(0.3)
    cluster.cmd("scancel", "--signal=USR1", str(job.id), check=False)
    info = job.wait()
    logs = job.logs()
    assert info["JobState"] == "COMPLETED", logs
    assert info["Restarts"] == "1", logs

    # the first run stopped at a step boundary with a checkpoint there, then the job requeued itself
    marker = json.loads((job.log_dir / f"preempted-{job.id}.json").read_text()) \
        if (job.log_dir / f"preempted-{job.id}.json").exists() else None
    assert marker is None, "the marker is removed when the requeued run starts"
    out = job.out.read_text()
    assert "preempted:" in out and "requeued job" in out, logs
    stopped = int(out.split('preempted: {"step": ')[1].split(",")[0])
    assert signalled_at <= stopped < STEPS, logs
    assert (job.dump / "checkpoint" / f"step-{stopped}").is_dir(), logs
    r0 = "".join(f.read_text() for f in job.log_dir.glob("node*-r0.log"))
    assert "SIGUSR1: forwarding to workers" in r0, logs  # the torchrun agent survived and forwarded
    assert f"saving a checkpoint at step {stopped}" in r0, logs
    r1 = "".join(f.read_text() for f in job.log_dir.glob("node*-r1.log"))
    assert f"starting at step {stopped}" in r1, logs

    # nothing lost, nothing repeated, bitwise the uninterrupted job
    losses = read_losses(job.dump)
    assert [s for s, _ in losses] == list(range(1, STEPS + 1)), losses
    assert losses == read_losses(reference_job.dump)


@pytest.mark.slurm
@pytest.mark.timeout(900)
def test_bad_config_fails_fast(cluster, tmp_path):
    job = Job(cluster, tmp_path / "badcfg", [*TRAIN_ARGS, "--training.stpes", "3"], "titan-badcfg")
    info = job.wait(timeout=120)
    out = job.out.read_text()
    assert info["JobState"] == "FAILED", job.logs()
    assert info["ExitCode"].startswith("2:"), info
    errors = [line for line in out.splitlines() if line.startswith("config error:")]
    assert len(errors) == 1 and "stpes" in errors[0] and "steps" in errors[0], out
    assert not list(job.log_dir.glob("node*.log")), "srun must not have been started"
    # the check is one `import torch` (~5-15 s on 2 busy cores); a rendezvous timeout is 5-10 min
    assert job.wall < 120, f"took {job.wall:.0f}s; it should fail long before any rendezvous timeout"


# ---------------------------------------------------------------------------- trainer.launch alone
# No SLURM needed: signal only the agent (as proctrack/pgid, or srun's own forwarding, would) and
# check that it survives, passes the signal on, and exits with the worker's status.

WORKER = """
import json, os, sys, time
time.sleep(float(sys.argv[2]))          # a signal may land before the handler exists
from trainer.preemption import PreemptionHandler
h = PreemptionHandler()
open(sys.argv[1] + ".ready", "w").close()
deadline = time.time() + 120
while h.signal_received is None and time.time() < deadline:
    time.sleep(0.05)
time.sleep(0.5)                          # "saving the checkpoint"
with open(sys.argv[1], "w") as f:
    json.dump({"signal": h.signal_received, "pid": os.getpid()}, f)
"""


def _launch_worker(tmp_path: Path, delay: float) -> tuple[subprocess.Popen, Path]:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    out = tmp_path / "worker.json"
    agent = subprocess.Popen(
        [sys.executable, "-m", "trainer.launch", "--nnodes", "1", "--nproc-per-node", "1", "--rdzv-backend",
         "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", str(script), str(out), str(delay)],
        cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    return agent, out


def _wait_for(cond, agent: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while not cond():
        if agent.poll() is not None or time.time() > deadline:
            agent.kill()
            raise AssertionError(f"agent exited {agent.returncode} / timeout:\n{agent.communicate()[0]}")
        time.sleep(0.02)


@pytest.mark.timeout(300)
def test_launch_agent_forwards_sigterm_and_exits_with_worker(tmp_path):
    agent, out = _launch_worker(tmp_path, delay=0.0)
    _wait_for(lambda: Path(str(out) + ".ready").exists(), agent)
    os.kill(agent.pid, signal.SIGTERM)
    os.kill(agent.pid, signal.SIGTERM)  # a second signal changes nothing
    output, _ = agent.communicate(timeout=120)
    assert agent.returncode == 0, output
    assert json.loads(out.read_text())["signal"] == signal.SIGTERM, output
    assert "SIGTERM: forwarding to workers" in output


@pytest.mark.timeout(300)
def test_launch_usr1_before_worker_handler_is_held_not_fatal(tmp_path):
    """Workers start with SIGUSR1 blocked until PreemptionHandler exists, so an early one waits."""
    agent, out = _launch_worker(tmp_path, delay=3.0)
    _wait_for(lambda: bool(child_pids(agent.pid)), agent)
    os.kill(agent.pid, signal.SIGUSR1)  # the worker is still starting: no handler yet
    _wait_for(lambda: Path(str(out) + ".ready").exists(), agent)
    os.kill(agent.pid, signal.SIGUSR1)  # and once more while it "saves"
    output, _ = agent.communicate(timeout=120)
    assert agent.returncode == 0, output
    assert json.loads(out.read_text())["signal"] == signal.SIGUSR1, output
    assert output.count("SIGUSR1: forwarding to workers") == 2, output
