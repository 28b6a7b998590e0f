"""Trainer overhead and AC modes: tokens/s and peak RSS of the real training loop vs a bare PyTorch loop.

    python scripts/bench_train.py                          # debug model, seq 256, batch 2, fp32, 1 rank, 3 rounds
    python scripts/bench_train.py --rounds 5 --steps 40 -- --training.seq_len 512 --training.local_batch_size 4

Both loops train the same model on the same batches with the same optimizer and clipping; the bare
loop is what a user would write by hand (forward, cross entropy, backward, clip, AdamW step). The
trainer also runs once per AC mode (full, op, selective, and budget where the build has it). Each
run is its own process (so peak RSS is its own); every round runs every kind once, starting one
kind later each round, so machine drift spreads over all kinds. The median step time excludes the
first `--warmup` steps. The overhead is the median over rounds of trainer/bare within a round
(paired, so a slow minute of the machine hits both), checked against 3%.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def _peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def run_trainer(overrides: list[str], steps: int, warmup: int, ac_mode: str = "none") -> dict:
    from trainer.config import load_config
    from trainer.train import Trainer

    cfg = load_config(["--config", "llama_debug.toml", "--training.steps", str(steps), "--metrics.log_freq",
                       str(10**6), "--metrics.enable_tensorboard", "false", "--job.dump_folder",
                       "/tmp/bench_train", "--data.type", "synthetic", "--activation_checkpoint.mode", ac_mode,
                       *overrides])
    trainer = Trainer(cfg)
    times = []
    for _ in range(steps):
        batches = trainer.next_microbatches()
        t0 = time.perf_counter()
        trainer.train_step(batches, with_metrics=False)
        times.append(time.perf_counter() - t0)
    trainer.close()
    return {"times": times[warmup:], "tokens": cfg.training.local_batch_size * cfg.training.seq_len}


def run_bare(overrides: list[str], steps: int, warmup: int) -> dict:
    import torch
    import torch.nn.functional as F

    from models import get_model_spec
    from trainer.config import DEFAULT_TOKENIZER, load_config
    from trainer.data import build_dataloader
    from trainer.model_args import tokenizer_path
    from trainer.data.tokenizer import build_tokenizer

    cfg = load_config(["--config", "llama_debug.toml", "--data.type", "synthetic", *overrides])
    t = cfg.training
    torch.manual_seed(t.seed)
    spec = get_model_spec(cfg.model.name)
    model = spec.model_cls(spec.flavors[cfg.model.flavor])
    model.init_weights()
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.optimizer.lr, betas=(cfg.optimizer.beta1, cfg.optimizer.beta2),
                            weight_decay=cfg.optimizer.weight_decay, foreach=True)
    tok_path = tokenizer_path(cfg, DEFAULT_TOKENIZER)
    loader = iter(build_dataloader(cfg.data, tokenizer=build_tokenizer(tok_path), tokenizer_path=tok_path,
                                   seq_len=t.seq_len,
                                   local_batch_size=t.local_batch_size, dp_rank=0, dp_world_size=1, seed=t.seed))
    times = []
    for _ in range(steps):
        x, y = next(loader)
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.max_norm, foreach=True)
        opt.step()
        loss.item()
        times.append(time.perf_counter() - t0)
    return {"times": times[warmup:], "tokens": t.local_batch_size * t.seq_len}


def kinds() -> list[str]:
    from parallelisms.activation_checkpoint import AC_MODES

    return ["trainer", "bare"] + [f"trainer_ac_{m}" for m in ("full", "op", "selective", "budget") if m in AC_MODES]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3, help="repetitions of every kind, interleaved")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args, overrides = parser.parse_known_args()
    overrides = [o for o in overrides if o != "--"]
    defaults = ["--training.seq_len", "256", "--training.local_batch_size", "2"]
    overrides = defaults + overrides
    if args.child:
        if args.child == "bare":
            out = run_bare(overrides, args.steps, args.warmup)
        else:
            out = run_trainer(overrides, args.steps, args.warmup, args.child.removeprefix("trainer_ac_")
                              if args.child.startswith("trainer_ac_") else "none")
        out["peak_rss_gib"] = _peak_rss_gib()
        print("RESULT " + json.dumps(out))
        return
    names = kinds()
    results: dict[str, list[dict]] = {k: [] for k in names}
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(os.cpu_count()))}
    for r in range(args.rounds):
        for kind in names[r % len(names):] + names[:r % len(names)]:
            proc = subprocess.run([sys.executable, __file__, "--child", kind, "--steps", str(args.steps), "--warmup",
                                   str(args.warmup), *overrides], capture_output=True, text=True, env=env, cwd=REPO)
            line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
            if line is None:
                sys.exit(f"{kind} run failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
            results[kind].append(json.loads(line[7:]))
    print(f"overrides: {' '.join(overrides)}; {args.steps} steps ({args.warmup} warm-up) x {args.rounds} rounds, "
          f"OMP_NUM_THREADS={env['OMP_NUM_THREADS']}")
    print("| loop | median s/step | per-round medians | tokens/s | peak RSS GiB |")
    print("|---|---|---|---|---|")
    for kind, runs in results.items():
        med = statistics.median(t for r in runs for t in r["times"])
        rounds = " ".join(f"{statistics.median(r['times']):.4f}" for r in runs)
        print(f"| {kind} | {med:.4f} | {rounds} | {runs[0]['tokens'] / med:,.0f} | "
              f"{max(r['peak_rss_gib'] for r in runs):.2f} |")
    paired = [statistics.median(t["times"]) / statistics.median(b["times"])
              for t, b in zip(results["trainer"], results["bare"])]
    overhead = 100 * (statistics.median(paired) - 1)
    print(f"trainer overhead vs bare: {overhead:+.1f}% (median of {len(paired)} paired rounds: "
          f"{' '.join(f'{100 * (p - 1):+.1f}%' for p in paired)}); within 3%: {'yes' if overhead <= 3 else 'NO'}")


if __name__ == "__main__":
    main()
