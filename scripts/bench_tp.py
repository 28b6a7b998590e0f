"""Tensor-parallel step time of two source trees, side by side, interleaved.

    python scripts/bench_tp.py --baseline /path/to/other/checkout          # TP 2 and FSDP 2 x TP 2
    python scripts/bench_tp.py --baseline DIR --rounds 5 -- --training.seq_len 256

Each round runs every (layout, tree) pair once through `./run_train.sh` of that tree (torchrun,
gloo, the CPU thread split a user gets), in an order that rotates every round, so a load spike
of a shared machine hits both trees alike. A run's step time is the mean of its last logged
interval (metrics.jsonl, after warm-up); the table gives the median over rounds, each round's
value, and the ratio of the two trees' medians. Without --baseline it times this tree alone.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
COMMON = ["--config", "llama_debug.toml", "--data.type", "synthetic", "--training.seq_len", "128",
          "--training.local_batch_size", "2", "--metrics.enable_tensorboard", "false", "--checkpoint.enable", "false",
          "--validation.enable", "false", "--training.max_skipped_steps", "0"]
LAYOUTS = {
    "TP 2": (2, ["--parallelism.tensor_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1"]),
    "FSDP 2 x TP 2": (4, ["--parallelism.tensor_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "2"]),
}


def step_time(tree: Path, nproc: int, argv: list[str], steps: int, workdir: str) -> float:
    dump = Path(workdir) / f"run{time.monotonic_ns()}"
    cmd = ["./run_train.sh", *argv, "--training.steps", str(steps), "--metrics.log_freq", str(steps // 2),
           "--job.dump_folder", str(dump)]
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "PYTHONPATH")}
    env.update(NGPU=str(nproc), PYTHONPATH=str(tree))
    proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise SystemExit(f"{tree}: {' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    records = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return float(records[-1]["step_time_s"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--baseline", type=Path, help="another checkout to compare with (e.g. a git worktree)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("rest", nargs="*", help="extra trainer overrides, after --")
    opts = p.parse_args()
    trees = {"this tree": REPO, **({"baseline": opts.baseline.resolve()} if opts.baseline else {})}
    pairs = [(layout, tree) for layout in LAYOUTS for tree in trees]
    times: dict = {pair: [] for pair in pairs}
    with tempfile.TemporaryDirectory() as d:
        for r in range(opts.rounds):
            for layout, tree in pairs[r % len(pairs):] + pairs[:r % len(pairs)]:
                nproc, overrides = LAYOUTS[layout]
                times[(layout, tree)].append(step_time(trees[tree], nproc, [*COMMON, *overrides, *opts.rest],
                                                       opts.steps, d))
    load = os.getloadavg()[0]
    print(f"\nTP step time, debug Llama, seq 128 x local batch 2, fp32, gloo; {opts.rounds} rounds, "
          f"load average {load:.1f} at the end\n")
    print("| layout | tree | s/step (median) | per round | vs baseline |")
    print("|---|---|---|---|---|")
    for layout, tree in pairs:
        med = statistics.median(times[(layout, tree)])
        base = statistics.median(times[(layout, "baseline")]) if "baseline" in trees else None
        ratio = f"{med / base - 1:+.1%}" if base and tree != "baseline" else ""
        rounds = " ".join(f"{t:.3f}" for t in times[(layout, tree)])
        print(f"| {layout} | {tree} | {med:.3f} | {rounds} | {ratio} |")


if __name__ == "__main__":
    main()
