"""torchft replica groups: time to heal against model size, and the per-step overhead against HSDP.

    python scripts/bench_ft.py                                   # CPU, gloo, 1 rank per group
    python scripts/bench_ft.py --models llama3:debug_small,llama3:debug,qwen3:0.6B --steps 30

Heal: a lighthouse and group 0 run (it starts alone after the first quorum's 10 s wait for
group 1); once group 0 has logged a few steps, group 1 starts and heals from it over torchft's
HTTP transport. The time is the healing group's first quorum (the wait for
the live group's next step boundary included) plus the transfer and the load, as the trainer logs
it, with the bytes this rank received (params, optimizer state, the rest).

Overhead: the same global batch as plain HSDP (one job, data_parallel_replicate_degree 2) and as
2 torchft groups x 1 rank; the median step time over the steps after the first 5, runs
interleaved (A B A B) so that a shared machine's load hits both alike.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
BASE = ["--training.seq_len", "64", "--training.local_batch_size", "2", "--metrics.log_freq", "1",
        "--metrics.enable_tensorboard", "false", "--lr_scheduler.warmup_steps", "2"]
HEALED = re.compile(r"healed from a live peer at step (\d+) in ([\d.]+) s \(([\d.]+) MiB")


def spawn(cmd: list[str], env: dict, log: Path) -> subprocess.Popen:
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def lighthouse(folder: Path, min_replicas: int) -> tuple[subprocess.Popen, str]:
    address_file = folder / "lighthouse"
    proc = spawn([sys.executable, "-m", "trainer.fault_tolerance.lighthouse", "--port", "0", "--min-replicas",
                  str(min_replicas), "--address-file", str(address_file)], ENV, folder / "lighthouse.log")
    while not address_file.exists():
        time.sleep(0.1)
    return proc, address_file.read_text().strip()


def group(replica_id: int, model: list[str], args: list[str], folder: Path, env: dict | None = None):
    return spawn([sys.executable, "-m", "trainer.launch", "--standalone", "--nnodes", "1", "--nproc-per-node", "1",
                  "-m", "trainer.train", *model, *BASE, *args, "--fault_tolerance.enable",
                  "--fault_tolerance.replica_id", str(replica_id), "--job.dump_folder", str(folder / "ft")],
                 {**ENV, **(env or {})}, folder / f"group{replica_id}.log")


def wait_for(path: Path, pattern: re.Pattern, timeout: float):
    deadline = time.time() + timeout
    while time.time() < deadline:
        found = pattern.search(path.read_text()) if path.exists() else None
        if found:
            return found
        time.sleep(0.5)
    raise TimeoutError(f"{pattern.pattern} not in {path} after {timeout} s:\n{path.read_text()[-3000:]}")


def model_args(spec: str) -> list[str]:
    name, flavor = spec.split(":")
    return ["--model.name", name, "--model.flavor", flavor]


def heal_time(spec: str, folder: Path) -> dict:
    folder.mkdir(parents=True)
    lh, address = lighthouse(folder, 1)
    args = ["--training.steps", "10000", "--fault_tolerance.group_count", "2", "--fault_tolerance.lighthouse",
            address, "--fault_tolerance.quorum_timeout_seconds", "10", "--fault_tolerance.heal_timeout_seconds",
            "600"]
    live = group(0, model_args(spec), args, folder, {"TITAN_TEST_SLOW_RANK": "0:0.3"})
    healing = None
    try:
        wait_for(folder / "group0.log", re.compile(r"step +3 \|"), 900)
        healing = group(1, model_args(spec), args, folder)
        found = wait_for(folder / "group1.log", HEALED, 900)
        params = re.search(r"model \S+ \S+: ([\d,]+) params", (folder / "group0.log").read_text())
        return {"model": spec, "params": int(params.group(1).replace(",", "")), "step": int(found.group(1)),
                "heal_s": float(found.group(2)), "mib": float(found.group(3))}
    finally:
        for p in (healing, live, lh):
            if p is not None:
                kill(p)


def step_times(folder: Path) -> list[float]:
    records = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r["step_time_s"] for r in records if r["step"] > 5]


def hsdp_run(spec: str, steps: int, folder: Path) -> float:
    proc = spawn(["./run_train.sh", *model_args(spec), *BASE, "--training.steps", str(steps),
                  "--parallelism.data_parallel_replicate_degree", "2", "--job.dump_folder", str(folder)],
                 {**ENV, "NGPU": "2"}, folder.with_suffix(".log"))
    if proc.wait(1800) != 0:
        raise RuntimeError(f"HSDP run failed: {folder.with_suffix('.log').read_text()[-3000:]}")
    return statistics.median(step_times(folder))


def ft_run(spec: str, steps: int, folder: Path) -> float:
    folder.mkdir(parents=True)
    lh, address = lighthouse(folder, 2)
    args = ["--training.steps", str(steps), "--fault_tolerance.group_count", "2", "--fault_tolerance.min_replicas",
            "2", "--fault_tolerance.lighthouse", address]
    try:
        groups = [group(g, model_args(spec), args, folder) for g in (0, 1)]
        for g in groups:
            if g.wait(1800) != 0:
                raise RuntimeError(f"FT run failed: {(folder / 'group0.log').read_text()[-3000:]}")
    finally:
        kill(lh)
    return statistics.median(step_times(folder / "ft" / "replica-0"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="llama3:debug_small,qwen3:debug,llama3:debug,deepseek_v3:debug",
                    help="name:flavor list for the heal table")
    ap.add_argument("--overhead-model", default="llama3:debug")
    ap.add_argument("--steps", type=int, default=30, help="steps of each overhead run")
    ap.add_argument("--repeats", type=int, default=2, help="interleaved HSDP/FT pairs")
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="bench_ft-"))
    print(f"# CPU, gloo, 1 rank per group, OMP_NUM_THREADS=1; work in {root}\n")
    print("| model | params | healed at step | heal time (s) | MiB received |")
    print("|---|---|---|---|---|")
    for i, spec in enumerate(args.models.split(",")):
        r = heal_time(spec, root / f"heal{i}")
        print(f"| {r['model']} | {r['params']:,} | {r['step']} | {r['heal_s']:.2f} | {r['mib']:.1f} |", flush=True)
    print(f"\n| run ({args.overhead_model}, {args.steps} steps) | median step time (s) |")
    print("|---|---|")
    hsdp, ft = [], []
    for i in range(args.repeats):
        hsdp.append(hsdp_run(args.overhead_model, args.steps, root / f"hsdp{i}"))
        print(f"| HSDP replicate 2 (one job), run {i + 1} | {hsdp[-1]:.4f} |", flush=True)
        ft.append(ft_run(args.overhead_model, args.steps, root / f"ft{i}"))
        print(f"| torchft 2 groups x 1 rank, run {i + 1} | {ft[-1]:.4f} |", flush=True)
    h, f = statistics.median(hsdp), statistics.median(ft)
    print(f"\ntorchft per-step overhead: {f - h:+.4f} s ({(f / h - 1) * 100:+.1f}%) against HSDP")
    return 0


if __name__ == "__main__":
    sys.exit(main())
