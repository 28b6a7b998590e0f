"""Hot-path cost of the non-finite guard (trainer/step_guard.py): step time with the guard on
(training.max_skipped_steps 3, the default) and off (0), interleaved in one process.

    python scripts/bench_step_guard.py [--config llama_debug.toml] [--rounds 6] [--steps 5] [overrides ...]

The guard adds no collective (the loss all-reduce it needs already ran every step; it only
runs before the optimizer step now) and moves the step's one host sync before
`optimizer.step()`. One Trainer runs rounds of `--steps` steps, switching the guard on and
off between rounds, so both see the same model, data stream and machine noise. Prints the
median seconds per step of each and the difference.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="llama_debug.toml")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps", type=int, default=5)
    args, overrides = ap.parse_known_args()
    import tempfile

    from trainer.config import load_config
    from trainer.train import Trainer, setup_logging

    setup_logging()
    import logging

    logging.getLogger("trainer").setLevel(logging.WARNING)
    total = 1 + args.rounds * 2 * args.steps
    with tempfile.TemporaryDirectory() as dump:
        cfg = load_config(["--config", args.config, "--training.steps", str(total), "--metrics.log_freq", "1000000",
                           "--metrics.enable_tensorboard", "false", "--job.dump_folder", dump, *overrides])
        trainer = Trainer(cfg)
        per_step: dict[str, list[float]] = {"guard on": [], "guard off": []}
        try:
            trainer.step = 1
            trainer.train_step(trainer.next_microbatches())  # warm-up
            for _ in range(args.rounds):
                for name, max_skipped in (("guard on", 3), ("guard off", 0)):
                    trainer.guard.max_skipped = max_skipped
                    t0 = time.perf_counter()
                    for _ in range(args.steps):
                        trainer.step += 1
                        trainer.train_step(trainer.next_microbatches(), with_metrics=False)
                    per_step[name].append((time.perf_counter() - t0) / args.steps)
        finally:
            trainer.close()
    on, off = (statistics.median(per_step[k]) for k in ("guard on", "guard off"))
    print(f"{args.config} {' '.join(overrides)}: {args.rounds} interleaved rounds x {args.steps} steps")
    print(f"{'':<10}{'median s/step':>14}{'min':>9}{'max':>9}")
    for name, ts in per_step.items():
        print(f"{name:<10}{statistics.median(ts):>14.4f}{min(ts):>9.4f}{max(ts):>9.4f}")
    print(f"difference: {100 * (on - off) / off:+.1f}% (on vs off)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
