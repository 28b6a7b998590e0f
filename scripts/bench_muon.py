"""Muon against AdamW: loss at equal tokens, optimizer-step time, and bytes moved per step.

    python scripts/bench_muon.py loss  [--steps 300] [--adamw-lrs 1.5e-3,3e-3,6e-3] [--muon-lrs 3e-3,6e-3,1.2e-2]
    python scripts/bench_muon.py step  [--layers 2] [--rounds 3]
    python scripts/bench_muon.py bytes [--flavor 8B] [--ranks 8] [--tp 1]

loss: trains train_configs/llama_debug.toml (300 steps, built-in corpus, cosine schedule,
same data order and tokens for every run) once per (optimizer, lr), one process each;
prints the loss at 100 / 200 / 300 steps (mean of the 10 logged steps ending there,
log_freq 1), best lr of each optimizer marked.

step: the Llama 3 8B block shape (dim 4096, FFN 14336, 32 / 8 heads) with `--layers`
layers and the debug vocab (2048: the 8B vocab's embedding would stay on AdamW in both
runs and only add the same AdamW time to each) on this CPU, one process: random grads,
then `--rounds` optimizer steps of AdamW (foreach) and Muon (fp32 NS) interleaved;
prints the median seconds of each.

bytes: what Muon's assembly moves per step per rank (parallelisms/muon_assembly.py),
against FSDP's own all-gathers and reduce-scatter, for a flavor's shapes under FSDP over
`--ranks` (x `--tp`) from the formula in that module; computed on the meta device.
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
sys.path.insert(0, str(REPO))


def loss_sweep(args) -> None:
    runs = [("AdamW", float(x)) for x in args.adamw_lrs.split(",")] + \
           [("muon", float(x)) for x in args.muon_lrs.split(",")]
    marks = (args.steps // 3, 2 * args.steps // 3, args.steps)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, lr in runs:
            dump = Path(tmp) / f"{name}_{lr}"
            cmd = [sys.executable, "-m", "trainer.train", "--config", "llama_debug.toml", "--optimizer.name", name,
                   "--optimizer.lr", str(lr), "--training.steps", str(args.steps), "--metrics.log_freq", "1",
                   "--metrics.enable_tensorboard", "false", "--job.dump_folder", str(dump)]
            t0 = time.perf_counter()
            subprocess.run(cmd, cwd=REPO, check=True, capture_output=True, env={**os.environ, "PYTHONPATH": str(REPO)})
            losses = {}
            for line in (dump / "metrics.jsonl").read_text().splitlines():
                rec = json.loads(line)
                losses[rec["step"]] = rec["loss"]
            at = [statistics.mean(losses[s] for s in range(m - 9, m + 1)) for m in marks]
            rows.append((name, lr, at, time.perf_counter() - t0))
            print(f"  {name} lr {lr:g}: {' '.join(f'{v:.4f}' for v in at)} ({rows[-1][3]:.0f} s)", flush=True)
    best = {n: min((r for r in rows if r[0] == n), key=lambda r: r[2][-1]) for n in ("AdamW", "muon")}
    print(f"\n| optimizer | lr | loss @{marks[0]} | loss @{marks[1]} | loss @{marks[2]} |")
    print("|---|---|---|---|---|")
    for r in rows:
        tag = " (best)" if r is best[r[0]] else ""
        print(f"| {r[0]} | {r[1]:g}{tag} | " + " | ".join(f"{v:.3f}" for v in r[2]) + " |")


def _model_8b(layers: int):
    import torch

    from models.llama3.model import Llama3
    from trainer.config import load_config

    cfg = load_config(["--model.flavor", "8B"])
    model_args = cfg.model_args
    model_args.n_layers, model_args.vocab_size = layers, 2048
    torch.manual_seed(0)
    return Llama3(model_args)


def step_time(args) -> None:
    import torch

    from trainer.config import load_config
    from trainer.optim import build_optimizer

    model = _model_8b(args.layers)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    n = sum(p.numel() for p in model.parameters())
    times: dict[str, list[float]] = {"AdamW": [], "muon": []}
    opts = {name: build_optimizer(model, load_config(["--optimizer.name", name]).optimizer, "cpu")
            for name in times}
    for _ in range(args.rounds):
        for name, opt in opts.items():
            t0 = time.perf_counter()
            opt.step()
            times[name].append(time.perf_counter() - t0)
    print(f"Llama 3 8B shape, {args.layers} layers, vocab 2048: {n / 1e6:.0f}M params, "
          f"torch threads {torch.get_num_threads()}, {args.rounds} rounds interleaved")
    print("| optimizer | step s (median) | min | max |")
    print("|---|---|---|---|")
    for name, ts in times.items():
        print(f"| {name} | {statistics.median(ts):.2f} | {min(ts):.2f} | {max(ts):.2f} |")


def bytes_table(args) -> None:
    import torch

    from trainer.config import load_config
    from trainer.muon import split_params

    cfg = load_config(["--model.flavor", args.flavor])
    spec = cfg.model_spec
    with torch.device("meta"):
        model = spec.model_cls(cfg.model_args)
    muon, adamw, _ = split_params(model.named_parameters(), cfg.optimizer.muon_params, cfg.optimizer.muon_exclude)
    g, tp, elem = args.ranks, args.tp, 2  # bf16 updates (NS's precision on GPU)
    muon_b = sum(p.numel() for p in muon) * elem / tp  # per TP rank: the FSDP group's share
    all_b = (sum(p.numel() for p in muon) + sum(p.numel() for p in adamw)) * elem / tp
    # Each matrix is sharded over the FSDP ranks (x TP): a rank holds 1 / (g tp) of the updates,
    # and each mesh dim undone is one all-to-all each way sending (size - 1) / size of it.
    muon_sent = 2 * (muon_b / g) * ((g - 1) / g + (tp - 1) / tp)
    # FSDP: all-gather in forward and again in backward, reduce-scatter of grads, in the param dtype (bf16)
    fsdp_sent = 3 * all_b * (g - 1) / g
    gib = 2 ** 30
    print(f"{args.flavor}: FSDP {g} x TP {tp}; Muon params {sum(p.numel() for p in muon) / 1e9:.2f}B, "
          f"AdamW params {sum(p.numel() for p in adamw) / 1e9:.2f}B")
    print("| traffic per rank per step | GiB | vs FSDP |")
    print("|---|---|---|")
    print(f"| FSDP: 2 all-gathers + 1 reduce-scatter, bf16 | {fsdp_sent / gib:.2f} | 1.00 |")
    print(f"| Muon assembly: all-to-alls of the bf16 updates, 2 per mesh dim | {muon_sent / gib:.2f} | {muon_sent / fsdp_sent:.3f} |")
    from trainer.muon import ns_flops

    ns = sum(ns_flops(*p.shape[-2:]) * (p.numel() // p.shape[-2:].numel()) for p in muon)
    print(f"\nNewton-Schulz (5 iterations) per step: {ns / 1e12:.1f} TFLOP for the model, each matrix on one of "
          f"the {g * tp} ranks sharding it: about {ns / (g * tp) / 1e12:.1f} TFLOP per rank")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("mode", choices=("loss", "step", "bytes"))
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--adamw-lrs", default="1.5e-3,3e-3,6e-3")
    ap.add_argument("--muon-lrs", default="3e-3,6e-3,1.2e-2")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--flavor", default="8B")
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--tp", type=int, default=1)
    args = ap.parse_args()
    {"loss": loss_sweep, "step": step_time, "bytes": bytes_table}[args.mode](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
