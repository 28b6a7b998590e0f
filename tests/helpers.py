"""Shared test helpers: run the trainer in-process (1 rank) or under torchrun (N ranks)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# A tiny, fast setup shared by most trainer tests: 3 layers (odd), GQA, seq 64.
TINY = ["--model.flavor", "debug_small", "--training.seq_len", "64", "--training.local_batch_size", "2",
        "--lr_scheduler.warmup_steps", "2", "--metrics.log_freq", "1", "--metrics.enable_tensorboard", "false",
        "--optimizer.lr", "1e-3"]


def run_in_process(args: list[str], stop_after: int | None = None):
    """Runs the trainer in this process; returns (per-step losses, trainer).

    `stop_after` simulates a preemption at that step (checkpoint + exit), through
    the same code path as a real SIGUSR1."""
    from trainer.config import load_config
    from trainer.train import Trainer

    cfg = load_config(args)
    trainer = Trainer(cfg)
    if stop_after is not None:
        trainer.preemption.requested = lambda: trainer.step >= stop_after
    try:
        losses = trainer.train()
    finally:
        trainer.close()
    return losses, trainer


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(nproc: int, args: list[str], timeout: int = 300, module: str = "trainer.train",
             env: dict | None = None) -> subprocess.CompletedProcess:
    """Launches `nproc` gloo ranks with a hard timeout; raises with the output on failure."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), **(env or {})}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(nproc),
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "-m", module, *args]
    proc = run_killing_group(cmd, cwd=REPO, env=full_env, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"torchrun failed ({proc.returncode}):\n{rank_errors(proc.stderr)}"
                             f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return proc


def rank_errors(stderr: str) -> str:
    """Each rank's last exception line, so a failure's first cause survives the tail cut (a
    crashed rank's traceback is often buried under its peers' 'Connection closed by peer')."""
    import re

    last: dict[str, str] = {}
    for line in stderr.splitlines():
        m = re.match(r"^\[rank(\d+)\]:\s*([\w.]*(Error|Exception|Interrupt|Exit)\b.*)$", line)
        if m:
            last[m.group(1)] = m.group(2)[:500]
    return "".join(f"rank {r} raised: {e}\n" for r, e in sorted(last.items(), key=lambda kv: int(kv[0])))


def run_killing_group(cmd: list[str], *, cwd, env: dict, timeout: int) -> subprocess.CompletedProcess:
    """subprocess.run with output captured, in its own session: on timeout the whole process
    group (launcher and every worker) is killed, so a hung test leaves nothing running."""
    import signal

    with subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          start_new_session=True) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            raise AssertionError(f"timed out after {timeout} s: {' '.join(cmd)}\n{out[-3000:]}\n{err[-3000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def read_metrics(dump_folder: str | Path) -> list[dict]:
    path = Path(dump_folder) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def losses_by_step(dump_folder: str | Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(dump_folder)}


def run_worker_cases(run_case, only_env: str, timeout_s: int = 300) -> int:
    """Body of a torchrun worker module: `python -m <worker> cases.json out_dir` runs every
    case (filtered by the comma-separated names in $only_env) in one gloo process group,
    so a whole table of layouts costs one launch."""
    import datetime

    import torch.distributed as dist

    from trainer.train import setup_logging

    cases = json.loads(Path(sys.argv[1]).read_text())
    out = Path(sys.argv[2])
    out.mkdir(parents=True, exist_ok=True)
    setup_logging()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    only = os.environ.get(only_env)
    for case in cases:
        if not only or case["name"] in only.split(","):
            run_case(case, out)
    dist.destroy_process_group()
    return 0


def tiny_seed_checkpoint(folder: Path) -> list[str]:
    """Writes a one-rank step-0 checkpoint of the TINY model under `folder`; returns the
    overrides that start a run from it (so layouts that must agree share their weights)."""
    run_in_process(TINY + ["--checkpoint.enable", "--checkpoint.create_seed_checkpoint", "--job.dump_folder",
                           str(folder)])
    return ["--checkpoint.enable", "--checkpoint.initial_load_path", str(Path(folder) / "checkpoint" / "step-0")]
