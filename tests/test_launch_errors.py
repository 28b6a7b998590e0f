"""trainer.launch: what a user sees when a worker fails, and a SIGTERM that lands while a worker
is still starting. Fake workers (no torch import) keep each launch to a few seconds."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import REPO, free_port, run_killing_group
from trainer.launch import child_pids

FAILING_WORKER = """
import os, sys, time
from configuration.fields import ConfigError
from trainer.errors import run_entry_point

def main():
    if os.environ["RANK"] == "1":
        if sys.argv[1] == "user":
            raise ConfigError("config error: training.dataset_path: rank 1 found nothing; pass a real path")
        raise ZeroDivisionError("a bug on rank 1")
    time.sleep(600)  # rank 0 waits on its peer, as in a collective; the agent must stop it
    return 0

sys.exit(run_entry_point(main))
"""


def _launch(tmp_path: Path, script: str, *args: str, filter_ranks: str = "0", nproc: int = 2):
    path = tmp_path / "worker.py"
    path.write_text(script)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "trainer.launch", "--nnodes", "1", "--nproc-per-node", str(nproc),
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--local-ranks-filter",
           filter_ranks, "--tee", "3", str(path), *args]
    t0 = time.time()
    proc = run_killing_group(cmd, cwd=REPO, env=env, timeout=240)  # far below rank 0's 600 s
    return proc, time.time() - t0


def test_user_error_on_a_hidden_rank_is_one_line_exit_2(tmp_path):
    proc, _ = _launch(tmp_path, FAILING_WORKER, "user")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out
    assert "Traceback" not in out and "ChildFailedError" not in out and "exitcode" not in out, out
    assert [ln for ln in proc.stderr.splitlines() if "config error" in ln] == [
        "config error: training.dataset_path: rank 1 found nothing; pass a real path"]


def test_a_crash_keeps_its_traceback_even_on_a_hidden_rank(tmp_path):
    proc, _ = _launch(tmp_path, FAILING_WORKER, "bug")
    assert proc.returncode == 1
    assert "Traceback (most recent call last)" in proc.stderr
    assert "ZeroDivisionError: a bug on rank 1" in proc.stderr
    assert "rank 1 crashed with exit code 1" in proc.stderr
    assert "ChildFailedError" not in proc.stdout + proc.stderr


SLOW_START_WORKER = """
import json, sys, time
time.sleep(3)                          # still importing torch: no handler yet
from trainer.preemption import PreemptionHandler
h = PreemptionHandler()                # unblocks the signal held since the worker started
time.sleep(0.5)
json.dump({"signal": h.signal_received}, open(sys.argv[1], "w"))
"""


def _start_agent(tmp_path: Path, script: str, out: Path, *, stdout) -> subprocess.Popen:
    """trainer.launch with one worker running `script out`, in its own session."""
    path = tmp_path / "worker.py"
    path.write_text(script)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        [sys.executable, "-m", "trainer.launch", "--nnodes", "1", "--nproc-per-node", "1", "--rdzv-backend",
         "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", str(path), str(out)],
        cwd=REPO, env=env, stdout=stdout, stderr=subprocess.STDOUT, text=True, start_new_session=True)


@pytest.mark.timeout(300)
def test_sigterm_during_worker_start_up_is_held_and_honoured(tmp_path):
    """Before: workers started with only SIGUSR1 blocked, and a SIGTERM during start-up killed them."""
    out = tmp_path / "worker.json"
    agent = _start_agent(tmp_path, SLOW_START_WORKER, out, stdout=subprocess.PIPE)
    try:
        deadline = time.time() + 120
        while not child_pids(agent.pid):
            assert agent.poll() is None and time.time() < deadline, agent.communicate()[0]
            time.sleep(0.02)
        os.kill(agent.pid, signal.SIGTERM)
        output, _ = agent.communicate(timeout=120)
    finally:
        if agent.poll() is None:
            os.killpg(agent.pid, signal.SIGKILL)
    assert agent.returncode == 0, output
    assert json.loads(out.read_text())["signal"] == signal.SIGTERM, output


ORPHAN_WORKER = """
import os, sys, time
from trainer.preemption import PreemptionHandler
PreemptionHandler()
open(sys.argv[1], "w").write(str(os.getpid()))
time.sleep(120)
"""


@pytest.mark.timeout(300)
def test_workers_die_with_a_killed_agent(tmp_path):
    """torchelastic starts workers in their own session: before, a SIGKILLed agent (a test's
    timeout, the OOM killer) left them running, orphaned."""
    pid_file = tmp_path / "worker.pid"
    agent = _start_agent(tmp_path, ORPHAN_WORKER, pid_file, stdout=subprocess.DEVNULL)
    deadline = time.time() + 120
    while not (pid_file.exists() and pid_file.read_text()):
        assert agent.poll() is None and time.time() < deadline
        time.sleep(0.05)
    worker = int(pid_file.read_text())
    os.kill(agent.pid, signal.SIGKILL)
    agent.wait()
    deadline = time.time() + 30
    while Path(f"/proc/{worker}").exists() and "Z" not in Path(f"/proc/{worker}/stat").read_text().split()[2]:
        if time.time() > deadline:
            os.kill(worker, signal.SIGKILL)
            raise AssertionError("the worker outlived its agent")
        time.sleep(0.05)


LATE_SIGNAL_SCRIPT = """
import os, signal, sys, time
from trainer.preemption import PreemptionHandler

class SignalDuringTeardown:  # a module global: freed after Python's finalization reset its signal handlers
    def __del__(self):
        os.kill(os.getpid(), signal.SIG{sig})
        time.sleep(0.2)

h = PreemptionHandler()
teardown = SignalDuringTeardown()
"""


@pytest.mark.parametrize("sig", ["USR1", "TERM"])
def test_a_stop_signal_during_interpreter_teardown_does_not_kill_the_rank(tmp_path, sig):
    """SLURM's test preempts twice: the second SIGUSR1 reached a rank that had saved and written its
    marker but was tearing down, where Python had put the default action back: exit -10, so the
    job step ended 138 and was not requeued."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", LATE_SIGNAL_SCRIPT.replace("{sig}", sig)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, (proc.returncode, proc.stderr)
