"""Collectives of one tensor-parallel training step, for tests/test_tp_comm.py.

    python -m torch.distributed.run --nproc-per-node 2 -m tests.tp_comm_worker CASES.json OUT_DIR

Each case runs one `Trainer.train_step` under DTensor's CommDebugMode and writes, from rank 0,
the count of every collective (CP's custom ops as cp_<kind>) and the parameters whose gradient placements differ from their
own after the step (parallelisms/grad_reduce.py settles them)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def run_case(case: dict, out: Path) -> None:
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.debug import CommDebugMode

    from parallelisms.context_parallel_comm import comm_recorder
    from trainer.config import load_config
    from trainer.train import Trainer

    trainer = Trainer(load_config(case["args"]))
    try:
        batches = trainer.next_microbatches()
        with CommDebugMode() as comm, comm_recorder() as cp:  # CP's collectives are custom ops
            trainer.train_step(batches, with_metrics=False)
        unsettled = [name for part in trainer.model_parts for name, p in part.named_parameters()
                     if isinstance(p, DTensor) and p.grad is not None and p.grad.placements != p.placements]
        counts = {str(op).split(".")[-1]: n for op, n in comm.get_comm_counts().items()}
        for name, *_ in cp.calls:
            counts[f"cp_{name}"] = counts.get(f"cp_{name}", 0) + 1
    finally:
        trainer.close(destroy_process_group=False)
    if dist.get_rank() == 0:
        (out / f"{case['name']}.json").write_text(json.dumps({"counts": counts, "unsettled": unsettled}))


if __name__ == "__main__":
    from tests.helpers import run_worker_cases
    from trainer.distributed import exit_process

    exit_process(run_worker_cases(run_case, "TP_COMM_ONLY"))
