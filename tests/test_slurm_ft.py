"""scripts/ft_trainer.slurm on the real local SLURM cluster (tests/slurm_cluster.py, 3 nodes): 2 torchft
replica groups as job steps on the first two nodes, the lighthouse a job step of its own, the third
node a spare.

- Group 1's job step is cancelled mid-run (`scancel <job>.<step>`, as when its node is lost): the
  script restarts it alone, on the spare node, and it heals from group 0.
- Then the job is preempted as `#SBATCH --signal=B:USR1@120` does it (SIGUSR1 to the batch script):
  the script relays it to both groups, the saving group writes a checkpoint, both exit 75, and the
  script requeues the job, which resumes from that checkpoint and finishes. Group 0 logs every
  step exactly once over both runs; the lighthouse ends with the batch script.
"""

from __future__ import annotations

import json
import re
import subprocess
import time
from pathlib import Path

import pytest

from tests.slurm_cluster import free_port, free_port_range
from tests.test_slurm import _env, cluster  # noqa: F401 - the session's cluster fixture

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "ft_trainer.slurm"
STEPS = 30
ARGS = ["--model.flavor", "debug_small", "--training.steps", str(STEPS), "--training.seq_len", "64",
        "--training.local_batch_size", "2", "--metrics.log_freq", "1", "--metrics.enable_tensorboard", "false",
        "--checkpoint.enable", "true", "--checkpoint.interval", "1000",
        "--fault_tolerance.quorum_timeout_seconds", "30", "--fault_tolerance.heal_timeout_seconds", "20"]


def steps_logged(folder: Path) -> list[int]:
    path = folder / "metrics.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line)["step"])
        except (json.JSONDecodeError, KeyError):  # a line being written
            pass
    return out


@pytest.mark.slurm
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_lost_group_moves_to_the_spare_and_a_preempted_job_requeues(cluster, tmp_path):  # noqa: F811
    dump, logs, out = tmp_path / "dump", tmp_path / "logs", tmp_path / "job.out"
    # The groups sleep 1 s per step from step 6 on: time for the cancelled one to come back.
    env = _env(CONFIG_FILE="train_configs/llama_debug.toml", LOG_DIR=str(logs), REPO_DIR=str(REPO),
               FT_GROUPS="2", LIGHTHOUSE_NODE="shared", LIGHTHOUSE_PORT=str(free_port()),
               RDZV_PORT=str(free_port_range(2)), TITAN_TEST_SLOW_RANK="0:1.0@6", RESTART_DELAY="1")
    job = cluster.sbatch("--job-name=titan-ft", "--nodes=3", "--gpus-per-node=0", f"--output={out}", str(SCRIPT),
                         "--job.dump_folder", str(dump), *ARGS, env=env, cwd=REPO)

    def text() -> str:
        parts = [out.read_text(errors="replace") if out.exists() else ""]
        parts += [f"--- {f.name}\n{f.read_text(errors='replace')[-3000:]}" for f in sorted(logs.glob("*.log"))]
        return "\n".join(parts)

    def wait_until(condition, timeout: float) -> None:
        deadline = time.time() + timeout
        while not condition():
            assert time.time() < deadline, text()
            assert cluster.job_state(job) in ("PENDING", "RUNNING", "CONFIGURING"), text()
            time.sleep(0.3)

    def steps() -> list[tuple[str, str, str]]:
        listing = cluster.cmd("squeue", "--steps", "--jobs", str(job), "--noheader", "--format", "%i %j %N").stdout
        return [tuple(line.split()) for line in listing.splitlines() if len(line.split()) == 3]

    wait_until(lambda: any(s >= 5 for s in steps_logged(dump / "replica-1")), 400)
    nodes = {name: node for _, name, node in steps()}
    assert nodes["lighthouse"] == cluster.nodes[0] and nodes["group0"] == cluster.nodes[0], steps()
    assert nodes["group1"] == cluster.nodes[1], steps()
    cluster.cmd("scancel", next(i for i, name, _ in steps() if name == "group1"))
    # Restarted on the spare node; it heals from group 0.
    wait_until(lambda: (logs / "group1-node0-r1.log").exists() and
               "healed from a live peer" in (logs / "group1-node0-r1.log").read_text(), 300)
    assert {name: node for _, name, node in steps()}["group1"] == cluster.nodes[2], steps()
    # Preempted: SIGUSR1 to the batch script, as --signal=B:USR1@120 sends it.
    cluster.cmd("scancel", "--batch", "--signal=USR1", str(job))
    info = cluster.wait_job(job, timeout=600)
    assert info["JobState"] == "COMPLETED" and info.get("Restarts") == "1", (info, text())
    job_out = out.read_text()
    assert re.search(r"group 1 exited with \d+ on \[\w+\]; restarting it alone \(restart 1\)", job_out), text()
    assert f"group 1 moves to spare node(s) [{cluster.nodes[2]}]" in job_out, text()
    assert "SIGUSR1: the job is asked to stop" in job_out and "requeued job" in job_out, text()
    assert job_out.count("group 0 stopped (the job is stopping)") == 1, text()
    assert "group 0 finished" in job_out and "group 1 finished" in job_out, text()
    saved = re.findall(r"saving a checkpoint at step (\d+)", text())
    resumed = re.findall(r"starting at step (\d+)", "".join(f.read_text() for f in logs.glob("*-q1.log")))
    assert saved and resumed and set(resumed) == {max(saved)}, (saved, resumed, text())
    # Group 0 kept going through group 1's loss and resumed after the requeue: every step once.
    assert steps_logged(dump / "replica-0") == list(range(1, STEPS + 1)), text()
    assert steps_logged(dump / "replica-1")[-1] == STEPS
    deadline = time.time() + 10  # the lighthouse ends with the batch script
    while subprocess.run(["pgrep", "-f", f"lighthouse.*{logs}"], capture_output=True).returncode == 0:
        assert time.time() < deadline, "the lighthouse outlived the job"
        time.sleep(0.5)
