"""Trainer overhead and AC modes: s/step and tokens/s of the real training loop vs a bare PyTorch loop.

    python scripts/bench_train.py                          # debug model, seq 256, batch 2, fp32, 1 rank, 3 rounds
    python scripts/bench_train.py --rounds 5 --steps 40 -- --training.seq_len 512 --training.local_batch_size 4

Both loops train the same model shape on the same kind of batches with the same optimizer and
clipping; the bare loop is what a user would write by hand (forward, cross entropy, backward, clip,
AdamW step). The trainer also runs once per AC mode (full, op, selective, and budget where the
build has it). Interleaved step by step: each round is one process that builds every kind, then
runs step 1 of each kind, step 2 of each kind, ... (the order rotating every step), so a load
spike of a shared machine hits all kinds alike. The overhead is the median over all steps of
trainer / bare of the same step index (paired neighbours), checked against 3%; per-round values
show whether rounds agree. Memory per AC mode: scripts/bench_activation_checkpoint.py.
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
        t0 = time.perf_counter()
        trainer.train_step(batches, with_metrics=False)
        return time.perf_counter() - t0

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
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.max_norm, foreach=True)
        opt.step()
        loss.item()
        return time.perf_counter() - t0

    return step, t.local_batch_size * t.seq_len


def run_round(names: list[str], overrides: list[str], steps: int, warmup: int) -> dict:
    """Builds every kind, then interleaves their steps; {kind: step times after warm-up}."""
    loops = {k: bare_step(overrides) if k == "bare" else trainer_step(overrides, k.removeprefix("trainer_ac_")
                                                                        if k != "trainer" else "none")
             for k in names}
    times: dict[str, list[float]] = {k: [] for k in names}
    for i in range(warmup + steps):
        for k in names[i % len(names):] + names[:i % len(names)]:
            t = loops[k][0]()
            if i >= warmup:
                times[k].append(t)
    return {"times": times, "tokens": {k: loop[1] for k, loop in loops.items()}}


def kinds() -> list[str]:
    from parallelisms.activation_checkpoint import AC_MODES

    return ["trainer", "bare"] + [f"trainer_ac_{m}" for m in ("full", "op", "selective", "budget") if m in AC_MODES]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3, help="processes, each interleaving every kind")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args, overrides = parser.parse_known_args()
    overrides = [o for o in overrides if o != "--"]
    overrides = ["--training.seq_len", "256", "--training.local_batch_size", "2"] + overrides
    names = kinds()
    if args.child:
        print("RESULT " + json.dumps(run_round(names, overrides, args.steps, args.warmup)))
        return
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(os.cpu_count()))}
    rounds = []
    for _ in range(args.rounds):
        proc = subprocess.run([sys.executable, __file__, "--child", "--steps", str(args.steps), "--warmup",
                               str(args.warmup), *overrides], capture_output=True, text=True, env=env, cwd=REPO)
        line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
        if line is None:
            sys.exit(f"round failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
        rounds.append(json.loads(line[7:]))
    print(f"overrides: {' '.join(overrides)}; {args.steps} steps ({args.warmup} warm-up) x {args.rounds} rounds, "
          f"interleaved step by step; OMP_NUM_THREADS={env['OMP_NUM_THREADS']}")
    print("| loop | median s/step | per-round medians | tokens/s | vs bare |")
    print("|---|---|---|---|---|")

    def paired(kind: str) -> list[float]:
        return [a / b for r in rounds for a, b in zip(r["times"][kind], r["times"]["bare"])]

    for kind in names:
        med = statistics.median(t for r in rounds for t in r["times"][kind])
        per_round = " ".join(f"{statistics.median(r['times'][kind]):.4f}" for r in rounds)
        vs = "" if kind == "bare" else f"{100 * (statistics.median(paired(kind)) - 1):+.1f}%"
        print(f"| {kind} | {med:.4f} | {per_round} | {rounds[0]['tokens'][kind] / med:,.0f} | {vs} |")
    overhead = 100 * (statistics.median(paired("trainer")) - 1)
    per_round = [100 * (statistics.median([a / b for a, b in zip(r["times"]["trainer"], r["times"]["bare"])]) - 1)
                 for r in rounds]
    print(f"trainer overhead vs bare: {overhead:+.1f}% (median of {len(paired('trainer'))} paired steps; per round "
          f"{' '.join(f'{p:+.1f}%' for p in per_round)}); within 3%: {'yes' if overhead <= 3 else 'NO'}")


if __name__ == "__main__":
    main()
