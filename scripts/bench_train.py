"""Trainer overhead and AC modes: s/step and tokens/s of the real training loop vs a bare PyTorch loop.

    python scripts/bench_train.py                          # debug model, seq 256, batch 2, fp32, 1 rank, 3 rounds
    python scripts/bench_train.py --rounds 3 --threads 1,2 # the same at 1 and at 2 threads (one table pair each)
    python scripts/bench_train.py --rounds 5 --steps 40 -- --training.seq_len 512 --training.local_batch_size 4
    python scripts/bench_train.py --fsdp1 -- --training.mixed_precision_on_cpu true  # FSDP2 bf16 params, as on GPUs

Both loops train the same model shape on the same kind of batches with the same optimizer and
clipping; the bare loop is what a user would write by hand (forward, cross entropy, backward, clip,
AdamW step). The trainer also runs once per AC mode (full, op, selective, and budget where the
build has it). Interleaved step by step: each round is one process that builds every kind, then
runs step 1 of each kind, step 2 of each kind, ... (the order rotating every step), so a load
spike of a shared machine hits all kinds alike. The overhead is the median over all steps of
trainer / bare of the same step index (paired neighbours), checked against 3%; per-round values
show whether rounds agree. Memory per AC mode: scripts/bench_activation_checkpoint.py.

Precision as on a GPU: `-- --training.mixed_precision_on_cpu true` computes in bf16, under
autocast on one rank (what one GPU runs); add `--fsdp1` for FSDP2 over a one-rank mesh
instead, whose MixedPrecisionPolicy gathers bf16 params (what every multi-GPU run computes
in). The bare loop stays fp32 without FSDP: read the AC table then, not "vs bare".

The AC table gives, per mode, its cost over `none` (the trainer without AC: median of the paired
step ratios, as above) against its target: the mode's recompute share plus 5 points. The share
is measured, not assumed: after the timed steps each round runs one more step of every kind
under `ac_measure.flop_counter()`, and the recompute is that step's FLOPs minus those of `none`
(forward, backward and the loss are the same in every mode). "share of step" is the recompute
over the mode's own step FLOPs (the figure docs/activation_checkpointing.md quotes); "extra over
none" is the recompute over none's FLOPs, the time a mode would add if time followed FLOPs. The
target is the share of step + 5 points (the stricter of the two). memory_budget needs compile,
so it has no eager row. On a shared machine read the per-round columns: a load spike within a
step cannot cancel out. "CPU-time cost" is the same paired ratio of the process's CPU time
(user + system), steadier than wall time when other jobs share the cores; PASS/MISS reads the
wall-time cost.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def trainer_step(overrides: list[str], ac_mode: str):
    """One Trainer (AC `ac_mode`); returns (step function, tokens per step)."""
    from trainer.config import load_config
    from trainer.train import Trainer

    cfg = load_config(["--config", "llama_debug.toml", "--training.steps", "1000000", "--metrics.log_freq",
                       str(10**6), "--metrics.enable_tensorboard", "false", "--job.dump_folder",
                       f"/tmp/bench_train/{ac_mode}", "--data.type", "synthetic", "--activation_checkpoint.mode",
                       ac_mode, *overrides])
    trainer = Trainer(cfg)

    def step() -> float:
        batches = trainer.next_microbatches()
        t0, c0 = time.perf_counter(), time.process_time()
        trainer.train_step(batches, with_metrics=False)
        return time.perf_counter() - t0, time.process_time() - c0

    return step, cfg.training.local_batch_size * cfg.training.seq_len


def bare_step(overrides: list[str]):
    """The hand-written loop; returns (step function, tokens per step)."""
    import torch
    import torch.nn.functional as F

    from models import get_model_spec
    from parallelisms.apply import build_model
    from trainer.config import DEFAULT_TOKENIZER, load_config
    from trainer.data import build_dataloader
    from trainer.data.tokenizer import build_tokenizer
    from trainer.model_args import tokenizer_path

    cfg = load_config(["--config", "llama_debug.toml", "--data.type", "synthetic", *overrides])
    t = cfg.training
    torch.manual_seed(t.seed)
    spec = get_model_spec(cfg.model.name)
    model = build_model(spec, spec.flavors[cfg.model.flavor], "cpu")
    model.init_weights()
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.optimizer.lr, betas=(cfg.optimizer.beta1, cfg.optimizer.beta2),
                            weight_decay=cfg.optimizer.weight_decay, foreach=True)
    tok_path = tokenizer_path(cfg, DEFAULT_TOKENIZER)
    loader = iter(build_dataloader(cfg.data, tokenizer=build_tokenizer(tok_path), tokenizer_path=tok_path,
                                   seq_len=t.seq_len, local_batch_size=t.local_batch_size, dp_rank=0, dp_world_size=1,
                                   seed=t.seed))

    def step() -> float:
        x, y = next(loader)
        t0, c0 = time.perf_counter(), time.process_time()
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.max_norm, foreach=True)
        opt.step()
        loss.item()
        return time.perf_counter() - t0, time.process_time() - c0

    return step, t.local_batch_size * t.seq_len


def run_round(names: list[str], overrides: list[str], steps: int, warmup: int) -> dict:
    """Builds every kind, then interleaves their steps; {kind: step times after warm-up}."""
    loops = {k: bare_step(overrides) if k == "bare" else trainer_step(overrides, k.removeprefix("trainer_ac_")
                                                                        if k != "trainer" else "none")
             for k in names}
    times: dict[str, list[float]] = {k: [] for k in names}
    cpu: dict[str, list[float]] = {k: [] for k in names}
    for i in range(warmup + steps):
        for k in names[i % len(names):] + names[:i % len(names)]:
            wall, cpu_s = loops[k][0]()
            if i >= warmup:
                times[k].append(wall)
                cpu[k].append(cpu_s)
    return {"times": times, "cpu": cpu, "tokens": {k: loop[1] for k, loop in loops.items()},
            "flops": {k: step_flops(loops[k][0]) for k in names if k.startswith("trainer")}}


def step_flops(step) -> int:
    """FLOPs of one step (forward, recompute, backward), counted by ac_measure's FlopCounterMode."""
    from parallelisms.ac_measure import flop_counter

    with flop_counter() as counter:
        step()
    return counter.get_total_flops()


def one_rank_fsdp() -> None:
    """A gloo world of one, on which the trainer applies FSDP2 over a one-rank "dp_shard" mesh
    (gpu_check's stand-in for a multi-GPU run's mixed precision)."""
    import torch.distributed as dist

    sys.path.insert(0, str(REPO / "scripts"))
    from gpu_check.dist_checks import _install_one_rank_fsdp

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    _install_one_rank_fsdp()


def kinds() -> list[str]:
    from parallelisms.activation_checkpoint import AC_MODES

    return ["trainer", "bare"] + [f"trainer_ac_{m}" for m in ("full", "op", "selective", "budget") if m in AC_MODES]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3, help="processes, each interleaving every kind")
    parser.add_argument("--threads", default=None,
                        help="comma-separated thread counts, one set of rounds each (default: OMP_NUM_THREADS "
                             "or every core), e.g. 1,2")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--fsdp1", action="store_true",
                        help="the trainer's kinds run FSDP2 over a one-rank gloo mesh (its mixed precision)")
    args, overrides = parser.parse_known_args()
    overrides = [o for o in overrides if o != "--"]
    overrides = ["--training.seq_len", "256", "--training.local_batch_size", "2"] + overrides
    names = kinds()
    if args.child:
        import torch

        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
        if args.fsdp1:
            one_rank_fsdp()
        print("RESULT " + json.dumps(run_round(names, overrides, args.steps, args.warmup)))
        return
    default = os.environ.get("OMP_NUM_THREADS", str(os.cpu_count()))
    for threads in (args.threads or default).split(","):
        env = {**os.environ, "OMP_NUM_THREADS": threads.strip()}
        rounds = []
        for _ in range(args.rounds):
            proc = subprocess.run([sys.executable, __file__, "--child", "--steps", str(args.steps), "--warmup",
                                   str(args.warmup), *(["--fsdp1"] if args.fsdp1 else []), *overrides],
                                  capture_output=True, text=True, env=env, cwd=REPO)
            line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
            if line is None:
                sys.exit(f"round failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
            rounds.append(json.loads(line[7:]))
        print_tables(names, rounds, overrides, args, env["OMP_NUM_THREADS"])


def paired(rounds: list[dict], kind: str, base: str, clock: str = "times") -> list[float]:
    """Every step's time over `base`'s time at the same step index of the same round
    (`clock`: "times" for wall time, "cpu" for the process's CPU time)."""
    return [a / b for r in rounds for a, b in zip(r[clock][kind], r[clock][base])]


def print_tables(names: list[str], rounds: list[dict], overrides: list[str], args, threads: str) -> None:
    print(f"overrides: {' '.join(overrides)}{' (trainer: FSDP2, one rank)' if args.fsdp1 else ''}; {args.steps} "
          f"steps ({args.warmup} warm-up) x {args.rounds} rounds, interleaved step by step; OMP_NUM_THREADS={threads}")
    print("| loop | median s/step | per-round medians | tokens/s | vs bare |")
    print("|---|---|---|---|---|")
    for kind in names:
        med = statistics.median(t for r in rounds for t in r["times"][kind])
        per_round = " ".join(f"{statistics.median(r['times'][kind]):.4f}" for r in rounds)
        vs = "" if kind == "bare" else f"{100 * (statistics.median(paired(rounds, kind, 'bare')) - 1):+.1f}%"
        print(f"| {kind} | {med:.4f} | {per_round} | {rounds[0]['tokens'][kind] / med:,.0f} | {vs} |")
    overhead = 100 * (statistics.median(paired(rounds, "trainer", "bare")) - 1)
    per_round = [100 * (statistics.median(paired([r], "trainer", "bare")) - 1) for r in rounds]
    print(f"trainer overhead vs bare: {overhead:+.1f}% (median of {len(paired(rounds, 'trainer', 'bare'))} paired "
          f"steps; per round {' '.join(f'{p:+.1f}%' for p in per_round)}); within 3%: "
          f"{'yes' if overhead <= 3 else 'NO'}")
    print()
    print(f"AC modes, OMP_NUM_THREADS={threads}: cost over none (median of paired steps) against the target, "
          f"the recompute share of the step + 5 points")
    print("| mode | tokens/s | cost over none | per round | CPU-time cost | recompute: share of step "
          "| extra over none | target | |")
    print("|---|---|---|---|---|---|---|---|---|")
    none_flops = rounds[0]["flops"]["trainer"]
    for kind in ["trainer"] + [k for k in names if k.startswith("trainer_ac_")]:
        mode = "none" if kind == "trainer" else kind.removeprefix("trainer_ac_")
        med = statistics.median(t for r in rounds for t in r["times"][kind])
        tokens = f"{rounds[0]['tokens'][kind] / med:,.0f}"
        if kind == "trainer":
            print(f"| none | {tokens} | | | | | | | |")
            continue
        cost = 100 * (statistics.median(paired(rounds, kind, "trainer")) - 1)
        per_round = " ".join(f"{100 * (statistics.median(paired([r], kind, 'trainer')) - 1):+.1f}%" for r in rounds)
        cpu_cost = 100 * (statistics.median(paired(rounds, kind, "trainer", "cpu")) - 1)
        flops = rounds[0]["flops"][kind]
        share, extra = 100 * (flops - none_flops) / flops, 100 * (flops - none_flops) / none_flops
        target = share + 5
        print(f"| {mode} | {tokens} | {cost:+.1f}% | {per_round} | {cpu_cost:+.1f}% | {share:.1f}% | {extra:.1f}% "
              f"| {target:.1f}% "
              f"| {'PASS' if cost <= target else 'MISS'} |")
    print("| memory_budget | n/a: needs compile (eager table) | | | | | | | |")
    print()

if __name__ == "__main__":
    main()
