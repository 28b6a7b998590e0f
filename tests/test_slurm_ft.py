"""scripts/ft_trainer.slurm on the real local 2-node SLURM cluster (tests/slurm_cluster.py): 2 torchft
replica groups as separate job steps, the lighthouse on the first node; one group's job step is
cancelled mid-run (`scancel <job>.<step>`), restarted alone by the script, heals from the other
group and both finish; the other group logs every step once."""

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
def test_a_cancelled_group_is_restarted_alone_and_heals(cluster, tmp_path):  # noqa: F811
    dump, logs, out = tmp_path / "dump", tmp_path / "logs", tmp_path / "job.out"
    # The groups sleep 1 s per step from step 6 on: time for the cancelled one to come back.
    env = _env(CONFIG_FILE="train_configs/llama_debug.toml", LOG_DIR=str(logs), REPO_DIR=str(REPO),
               FT_GROUPS="2", LIGHTHOUSE_PORT=str(free_port()), RDZV_PORT=str(free_port_range(2)),
               TITAN_TEST_SLOW_RANK="0:1.0@6", RESTART_DELAY="1")
    job = cluster.sbatch("--job-name=titan-ft", "--nodes=2", "--gpus-per-node=0", f"--output={out}", str(SCRIPT),
                         "--job.dump_folder", str(dump), *ARGS, env=env, cwd=REPO)

    def text() -> str:
        parts = [out.read_text(errors="replace") if out.exists() else ""]
        parts += [f"--- {f.name}\n{f.read_text(errors='replace')[-3000:]}" for f in sorted(logs.glob("*.log"))]
        return "\n".join(parts)

    deadline = time.time() + 400
    while not any(s >= 5 for s in steps_logged(dump / "replica-1")):
        assert time.time() < deadline, text()
        assert cluster.job_state(job) in ("PENDING", "RUNNING", "CONFIGURING"), text()
        time.sleep(0.3)
    steps = cluster.cmd("squeue", "--steps", "--jobs", str(job), "--noheader", "--format", "%i %j").stdout
    group1 = [line.split()[0] for line in steps.splitlines() if line.split()[-1] == "group1"]
    assert len(group1) == 1, steps
    cluster.cmd("scancel", group1[0])
    info = cluster.wait_job(job, timeout=600)
    assert info["JobState"] == "COMPLETED", text()
    job_out = out.read_text()
    assert re.search(r"group 1 exited with \d+; restarting it alone \(restart 1\)", job_out), text()
    assert "group 0 finished" in job_out and "group 1 finished" in job_out, text()
    restarted = (logs / "group1-node0-r1.log").read_text()
    healed = re.search(r"healed from a live peer at step (\d+)", restarted)
    assert healed, text()
    # Group 0 kept going: every step once; group 1 logged from its heal to the end.
    assert steps_logged(dump / "replica-0") == list(range(1, STEPS + 1)), text()
    assert steps_logged(dump / "replica-1")[-1] == STEPS
    assert "lighthouse: serving at" in (logs / "lighthouse.log").read_text()
    deadline = time.time() + 10  # the lighthouse ends with the batch script
    while subprocess.run(["pgrep", "-f", f"lighthouse.*{logs}"], capture_output=True).returncode == 0:
        assert time.time() < deadline, "the lighthouse outlived the job"
        time.sleep(0.5)
