"""CPU validation: the planner's predictions against runs of `./run_train.sh` on this machine.

Why through `./run_train.sh`: a prediction is only useful if it holds for what the user
runs, so each layout is launched exactly as a user would (torchrun, gloo, the CPU thread
split `run_train.sh` makes), and its step time is read from metrics.jsonl (the mean of
the last logged interval, after warm-up). Peak memory is measured as in
trainer/memory/validate.py (a fresh process per rank count, VmHWM growth of a step on
top of the parameters and optimizer states), against `PlanMemory.tensors`.
Needs the cpu-gloo entry (`scripts/plan.py --calibrate`).
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time
from pathlib import Path

from planner.layout import Plan

REPO = Path(__file__).resolve().parent.parent
COMMON = ["--data.type", "synthetic", "--training.seq_len", "128", "--metrics.enable_tensorboard", "false", "--checkpoint.enable", "false",
          "--training.max_skipped_steps", "0", "--validation.enable", "false"]
LLAMA = ["--config", "llama_debug.toml", *COMMON]
DEEPSEEK = ["--config", "deepseek_debug.toml", *COMMON]


def cases(quick: bool = False) -> list[tuple[str, list[str], Plan]]:
    """(name, base argv, plan): every layout family the issue lists, on the debug models."""
    P = Plan
    out = [
        ("1 rank, AC none", LLAMA, P(1, 1, 1, local_batch=2, ac="none")),
        ("1 rank, AC full", LLAMA, P(1, 1, 1, local_batch=2, ac="full")),
        ("1 rank, AC op", LLAMA, P(1, 1, 1, local_batch=2, ac="op")),
        ("1 rank, AC budget 0.5", LLAMA, P(1, 1, 1, local_batch=2, ac="budget", budget_fraction=0.5)),
        ("FSDP 2", LLAMA, P(2, 1, 2, local_batch=2)),
        ("HSDP 2 x 2", LLAMA, P(4, 2, 2, local_batch=2)),
        ("TP 2", LLAMA, P(2, 1, 1, tp=2, local_batch=2)),
        ("FSDP 2 x TP 2", LLAMA, P(4, 1, 2, tp=2, local_batch=2)),
        ("PP 2 1F1B", LLAMA, P(2, 1, 1, pp=2, schedule="1F1B", local_batch=2, microbatch=1)),
        ("PP 2 GPipe", LLAMA, P(2, 1, 1, pp=2, schedule="GPipe", local_batch=2, microbatch=1)),
        ("PP 2 Interleaved1F1B", LLAMA, P(2, 1, 1, pp=2, schedule="Interleaved1F1B", stages_per_rank=2,
                                          local_batch=2, microbatch=1)),
        ("CP 2 allgather", LLAMA, P(2, 1, 1, cp=2, local_batch=2)),
        ("CP 2 alltoall", LLAMA, P(2, 1, 1, cp=2, cp_method="alltoall", local_batch=2)),
        ("EP 2 (DeepSeek)", DEEPSEEK, P(2, 1, 2, ep=2, local_batch=2)),
        ("FSDP 8", LLAMA, P(8, 1, 8, local_batch=2)),
    ]
    return out[:6] if quick else out


def measure_step_time(argv: list[str], plan: Plan, workdir: str, steps: int = 4, timeout: int = 900) -> float:
    dump = Path(workdir) / f"run{time.monotonic_ns()}"
    cmd = ["./run_train.sh", *argv, *plan.overrides(), "--training.steps", str(steps), "--metrics.log_freq",
           str(steps // 2), "--job.dump_folder", str(dump)]
    env = {**os.environ, "NGPU": str(plan.world)}
    env.pop("OMP_NUM_THREADS", None)  # run_train.sh splits the cores among the ranks, as for a user
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr[-2000:]}")
    records = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return float(records[-1]["step_time_s"])


def predicted(argv: list[str], plan: Plan, hw, memory_models: dict):
    from planner.memory import MemoryModel
    from planner.step_time import predict
    from planner.workload import workload_of
    from trainer.config import load_config

    cfg = load_config(argv + plan.overrides(), world_size=plan.world)
    st = predict(plan, workload_of(cfg, hw), hw, cfg.training.seq_len, compute_bytes=4)
    mm = memory_models.setdefault(tuple(argv), MemoryModel(argv, "cpu", hw.gpus_per_node))
    return st, mm.of(plan)


def measure_memory(rows: list[tuple[str, list[str], Plan]], workdir: str) -> dict[str, int]:
    """Measured tensors per rank (persistent + peak RSS growth of a step, worst rank)."""
    from trainer.memory import ValidationCase, run_measurements

    vcases = [ValidationCase(name.replace(" ", "_").replace(",", ""), argv + plan.overrides(), nproc=plan.world)
              for name, argv, plan in rows]
    got = run_measurements(vcases, workdir, timeout=900)
    out = {}
    for (name, _, _), c in zip(rows, vcases):
        worst = max(got[c.name], key=lambda r: r["peak_growth"])
        out[name] = worst["persistent_bytes"] + worst["peak_growth"]
    return out


def main(argv: list[str]) -> None:
    """`--rounds N` (default 2): each layout is run N times, the rounds interleaved, and its
    fastest is the measurement: a load spike on the shared machine only ever slows a run."""
    from planner.hardware import get_hardware

    quick = "--quick" in argv
    rounds = max(1, int(argv[argv.index("--rounds") + 1])) if "--rounds" in argv else 2
    hw = get_hardware("cpu-gloo")
    rows = cases(quick)
    models: dict = {}
    MiB = 1024**2
    with tempfile.TemporaryDirectory() as d:
        mem_rows = [r for r in rows if r[2].pp == 1]  # measure_step runs one schedule-free step
        measured_mem = measure_memory(mem_rows, d)
        times: dict = {name: [] for name, _, _ in rows}
        for r in range(rounds):
            for name, base, plan in rows:
                times[name].append(measure_step_time(base, plan, d))
                print(f"  round {r + 1}: {name}: {times[name][-1]:.3f} s", flush=True)
        table = []
        for name, base, plan in rows:
            st, mem = predicted(base, plan, hw, models)
            t = min(times[name])
            table.append((name, plan, st.step_s, t, mem.tensors, measured_mem.get(name)))
            print(f"  {name}: predicted {st.step_s:.3f} s, measured {t:.3f} s (rounds: "
                  f"{', '.join(f'{x:.3f}' for x in times[name])})", flush=True)
    print(f"\nCPU validation on {hw.note}; debug models, seq 128 x local batch 2, fp32; the fastest of {rounds} "
          "interleaved runs per layout; the machine is shared, so the measured times carry its load.\n")
    print("| layout | ranks | step s predicted | measured | error | memory MiB predicted | measured | error |")
    print("|---|---|---|---|---|---|---|---|")
    for name, plan, p, m, pm, mm in table:
        merr = f"{pm / mm - 1:+.0%}" if mm else "n/a"
        mtxt = f"{mm / MiB:.0f}" if mm else "n/a (PP)"
        print(f"| {name} | {plan.world} | {p:.3f} | {m:.3f} | {p / m - 1:+.0%} | {pm / MiB:.0f} | {mtxt} | {merr} |")
    within = sum(1 for *_, p, m, _, _ in [(r[0], r[1], r[2], r[3], r[4], r[5]) for r in table] if abs(p / m - 1) <= 0.25)
    pairs = wrong = 0
    for i in range(len(table)):
        for j in range(i + 1, len(table)):
            a, b = table[i][3], table[j][3]
            if max(a, b) / min(a, b) > 1.2:
                pairs += 1
                wrong += (table[i][2] < table[j][2]) != (a < b)
    print(f"\nstep time within 25%: {within} of {len(table)}; pairs measured > 20% apart: {pairs}, predicted in the "
          f"wrong order: {wrong}")
