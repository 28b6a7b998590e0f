"""Trainer overhead: tokens/s and peak RSS of the real training loop vs a bare PyTorch loop.

    python scripts/bench_train.py                          # debug model, seq 256, batch 2, fp32, 1 rank
    python scripts/bench_train.py --steps 40 -- --training.seq_len 512 --training.local_batch_size 4

Both loops train the same model on the same batches with the same optimizer and clipping; the bare
loop is what a user would write by hand (forward, cross entropy, backward, clip, AdamW step). Each
runs in its own process (so peak RSS is its own), alternating A/B/A/B to spread machine noise.
The median step time excludes the first `--warmup` steps.
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


def run_trainer(overrides: list[str], steps: int, warmup: int) -> dict:
    from trainer.config import load_config
    from trainer.train import Trainer

    cfg = load_config(["--config", "llama_debug.toml", "--training.steps", str(steps), "--metrics.log_freq",
                       str(10**6), "--metrics.enable_tensorboard", "false", "--job.dump_folder",
                       "/tmp/bench_train", "--data.type", "synthetic", *overrides])
    trainer = Trainer(cfg)
    times = []
    for _ in range(steps):
        batches = trainer.next_microbatches()
        t0 = time.perf_counter()
        trainer.train_step(batches)
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2, help="A/B repetitions")
    parser.add_argument("--child", choices=("trainer", "bare"), help=argparse.SUPPRESS)
    args, overrides = parser.parse_known_args()
    overrides = [o for o in overrides if o != "--"]
    defaults = ["--training.seq_len", "256", "--training.local_batch_size", "2"]
    overrides = defaults + overrides
    if args.child:
        fn = run_trainer if args.child == "trainer" else run_bare
        out = fn(overrides, args.steps, args.warmup)
        out["peak_rss_gib"] = _peak_rss_gib()
        print("RESULT " + json.dumps(out))
        return
    results: dict[str, list[dict]] = {"trainer": [], "bare": []}
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(os.cpu_count()))}
    for _ in range(args.rounds):
        for kind in ("trainer", "bare"):
            proc = subprocess.run([sys.executable, __file__, "--child", kind, "--steps", str(args.steps), "--warmup",
                                   str(args.warmup), *overrides], capture_output=True, text=True, env=env, cwd=REPO)
            line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
            if line is None:
                sys.exit(f"{kind} run failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
            results[kind].append(json.loads(line[7:]))
    print(f"overrides: {' '.join(overrides)}; {args.steps} steps ({args.warmup} warm-up) x {args.rounds} rounds")
    print("| loop | median s/step | tokens/s | peak RSS GiB |")
    print("|---|---|---|---|")
    medians = {}
    for kind, runs in results.items():
        med = statistics.median(t for r in runs for t in r["times"])
        medians[kind] = med
        print(f"| {kind} | {med:.4f} | {runs[0]['tokens'] / med:,.0f} | {max(r['peak_rss_gib'] for r in runs):.2f} |")
    print(f"trainer overhead: {100 * (medians['trainer'] / medians['bare'] - 1):+.1f}%")


if __name__ == "__main__":
    main()
