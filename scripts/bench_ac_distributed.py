#!/usr/bin/env python
"""Activation-checkpointing variants side by side on several gloo ranks, through the trainer.

    python scripts/bench_ac_distributed.py --nproc 2 --variants none,full,op,op+save_all_gathers \\
        --rounds 8 -- --config llama_debug.toml --parallelism.tensor_parallel_degree 2
    python scripts/bench_ac_distributed.py --nproc 2 --variants none,full,op --rounds 8 \\
        -- --config deepseek_debug.toml --parallelism.expert_parallel_degree 2

Why: TP/SP and EP costs (re-running collectives in the recompute, what the SAC cache
holds under sequence parallel) exist only on several ranks, and step times on this
shared machine drift by +-15%, so every variant is built once (one Trainer each, in
one process group) and the variants take turns, step by step, for `--rounds` rounds.

A variant is an AC mode, optionally with `+flag` (sets `--activation_checkpoint.flag
true`) or `+key=value` parts. Printed per variant: the exact bytes kept for backward in
one step on rank 0 (`SavedActivationCounter`: autograd-saved + SAC cache) and the SAC
cache part; the step time (slowest rank; median and min over the rounds), and its excess
over `none` (the recompute and the policy's cost); the CPU time of a step summed over the
ranks (median; steadier than wall time on a shared machine, blind to time spent waiting).
The order of the variants is reversed every other round. `--profile VARIANT` also prints the
ops with the most self CPU time in one step of that variant and of `full` (torch.profiler).
Run with `OMP_NUM_THREADS=1` ranks (the launcher sets it).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def _variant_args(variant: str) -> list[str]:
    mode, *extras = variant.split("+")
    out = ["--activation_checkpoint.mode", mode]
    for extra in extras:
        key, _, value = extra.partition("=")
        out += [f"--activation_checkpoint.{key}", value or "true"]
    return out


def _worker(opts, rest: list[str]) -> None:
    import torch
    import torch.distributed as dist

    from parallelisms.ac_measure import SavedActivationCounter
    from trainer.config import load_config
    from trainer.train import Trainer, setup_logging

    setup_logging()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    variants = opts.variants.split(",")
    tmp = tempfile.mkdtemp(prefix="bench_ac_")
    common = ["--training.steps", "100000", "--metrics.log_freq", "100000", "--metrics.enable_tensorboard", "false",
              "--checkpoint.enable", "false", "--data.type", "synthetic"]
    trainers = {}
    for v in variants:
        cfg = load_config([*common, *rest, *_variant_args(v), "--job.dump_folder", f"{tmp}/{v}"])
        trainers[v] = Trainer(cfg)
    saved, times, cpu = {}, {v: [] for v in variants}, {v: [] for v in variants}
    for r in range(opts.rounds + 1):
        # Alternate the order every round, so that no variant always follows the same one.
        for v, trainer in (list(trainers.items()) if r % 2 == 0 else list(trainers.items())[::-1]):
            batches = trainer.next_microbatches()
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            if r == 0:  # warm-up round: count what is kept for backward
                exclude = [t for p in trainer.model_parts for t in list(p.parameters()) + list(p.buffers())]
                with SavedActivationCounter(exclude) as counter:
                    trainer.train_step(batches)
                saved[v] = dict(counter.bytes_by_source)
            else:
                trainer.train_step(batches)
            dt, dc = torch.tensor(time.perf_counter() - t0), torch.tensor(time.process_time() - c0)
            dist.all_reduce(dt, op=dist.ReduceOp.MAX)
            dist.all_reduce(dc)
            if r:
                times[v].append(dt.item())
                cpu[v].append(dc.item())
    if opts.profile:
        for v in dict.fromkeys([opts.profile, "full"]):
            if v in trainers:
                _profile(trainers[v], v, rank, opts.profile_rows)
    if rank == 0:
        print("RESULT " + json.dumps({"saved": saved, "times": times, "cpu": cpu}), flush=True)
    for trainer in trainers.values():
        trainer.close(destroy_process_group=False)
    dist.destroy_process_group()


def _profile(trainer, name: str, rank: int, rows: int) -> None:
    from torch.profiler import ProfilerActivity, profile
    batches = trainer.next_microbatches()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        trainer.train_step(batches)
    if rank == 0:
        print(f"PROFILE {name}: top ops by self CPU time, one step, rank 0")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows), flush=True)


def _fmt_mib(n: float) -> str:
    return f"{n / 2**20:.2f}"


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" in argv:
        split = argv.index("--")
        own, rest = argv[:split], argv[split + 1:]
    else:
        own, rest = argv, []
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--variants", default="none,full,op")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--profile", default=None, help="variant to profile (one step, with full for comparison)")
    p.add_argument("--profile-rows", type=int, default=25)
    p.add_argument("--timeout", type=int, default=1800)
    p.add_argument("--_worker", action="store_true", help=argparse.SUPPRESS)
    opts = p.parse_args(own)
    if opts._worker:
        from trainer.distributed import exit_process
        _worker(opts, rest)
        exit_process(0)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(opts.nproc),
           str(Path(__file__).resolve()), "--_worker", "--variants", opts.variants, "--rounds", str(opts.rounds),
           *(["--profile", opts.profile, "--profile-rows", str(opts.profile_rows)] if opts.profile else []),
           "--", *rest]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=opts.timeout)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if proc.returncode != 0 or line is None:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-4000:])
        raise SystemExit(f"bench failed (exit {proc.returncode})")
    if opts.profile:
        out = proc.stdout
        print(out[out.index("PROFILE"):out.index("RESULT ")] if "PROFILE" in out else "")
    res = json.loads(line[len("RESULT "):])
    times = res["times"]
    base = statistics.median(times["none"]) if "none" in times else None
    print(f"{opts.nproc} ranks, {opts.rounds} interleaved rounds, args: {' '.join(rest)}")
    header = (f"{'variant':<28}{'saved MiB':>11}{'SAC MiB':>9}{'s/step med':>12}{'s/step min':>12}{'vs none':>9}"
              f"{'CPU s/step':>12}")
    print(header + "\n" + "-" * len(header))
    for v in opts.variants.split(","):
        s, t = res["saved"][v], times[v]
        med = statistics.median(t)
        extra = f"{100 * (med / base - 1):+.0f}%" if base else "n/a"
        print(f"{v:<28}{_fmt_mib(s['autograd'] + s['sac_cache']):>11}{_fmt_mib(s['sac_cache']):>9}"
              f"{med:>12.3f}{min(t):>12.3f}{extra:>9}{statistics.median(res['cpu'][v]):>12.3f}")


if __name__ == "__main__":
    main()
