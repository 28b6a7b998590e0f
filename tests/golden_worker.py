"""Runs golden-curve cases under a parallel layout, all in one torchrun launch.

    python -m torch.distributed.run --nproc-per-node N -m tests.golden_worker CASES.json OUT_DIR

CASES.json is a list of {"name", "args", "stop_after"}: each case trains with `args` (which
keep the golden's training.steps, so the LR schedule is the golden's) and stops after
`stop_after` steps, through the trainer's own early-stop path. The curves are read back from
each case's metrics.jsonl (written by the rank that holds the loss).
"""

from __future__ import annotations

import gc
import sys
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def run_case(case: dict, out: Path) -> None:
    from trainer.config import load_config
    from trainer.train import Trainer

    trainer = Trainer(load_config(case["args"]))
    trainer.preemption.requested = lambda: trainer.step >= case["stop_after"]
    try:
        losses = trainer.train()
    finally:
        trainer.close(destroy_process_group=False)
    if dist.get_rank() == 0:
        print(f"[golden_worker] {case['name']}: {losses}", flush=True)
    del trainer
    gc.collect()
    dist.barrier()


def main() -> int:
    from tests.helpers import run_worker_cases

    return run_worker_cases(run_case, "GOLDEN_ONLY", timeout_s=300)


if __name__ == "__main__":
    from trainer.distributed import exit_process
    exit_process(main())
