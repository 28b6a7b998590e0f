"""Runs multi-rank activation-checkpointing cases in one torchrun launch; dumps what the SAC cache keeps.

    python -m torch.distributed.run --nproc-per-node N -m tests.ac_worker CASES.json OUT_DIR

CASES.json: a list of {"name", "args": [CLI overrides]}. Each case trains (usually one step)
under a `SavedActivationCounter` that also records the size of every tensor the SAC cache
keeps; rank 0 writes OUT_DIR/<name>.pt = {"losses", "grads" (unsharded, last step),
"sac_cache", "autograd" (bytes, this rank), "kept_numels" (sorted, this rank),
"expert_gather_numels" (per MoE layer: the elements of one all-gather of its routed-expert
FSDP unit, i.e. its local-EP experts), "trace" (this case's AC_TRACE lines, rank 0)}. Importing tests.ep_worker registers the tiny
DeepSeek flavor `ep_test`.
"""

from __future__ import annotations

import gc
import logging
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import tests.ep_worker as ep_worker  # noqa: E402 - registers the `ep_test` flavor
from parallelisms.ac_measure import SavedActivationCounter  # noqa: E402


class KeptRecorder(SavedActivationCounter):
    """The exact counter, also listing the element counts of the SAC-cached tensors."""

    def __init__(self, exclude):
        super().__init__(exclude)
        self.kept_numels: list[int] = []

    def add(self, obj, source):
        if source == "sac_cache":
            for t in obj if isinstance(obj, (list, tuple)) else [obj]:
                if isinstance(t, torch.Tensor):
                    self.kept_numels.append(t.numel())
        super().add(obj, source)


def _expert_gather_numels(model_parts, ep: int) -> list[int]:
    from models.common.moe import GroupedExperts
    return [sum(p.numel() for p in m.parameters()) // ep
            for part in model_parts for m in part.modules() if isinstance(m, GroupedExperts)]


def run_case(case: dict, out: Path) -> None:
    from trainer.config import load_config
    from trainer.train import Trainer

    from parallelisms.activation_checkpoint import reset_ac_trace

    reset_ac_trace()
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda r: lines.append(r.getMessage())  # type: ignore[method-assign]
    logging.getLogger("ac").addHandler(handler)
    cfg = load_config(case["args"])
    trainer = Trainer(cfg)
    exclude = [t for part in trainer.model_parts for t in list(part.parameters()) + list(part.buffers())]
    try:
        with KeptRecorder(exclude) as counter:
            losses = trainer.train()
    finally:
        trainer.close(destroy_process_group=False)
        logging.getLogger("ac").removeHandler(handler)
    record = {"trace": [line for line in lines if line.startswith("AC_TRACE")], "losses": losses, **ep_worker.snapshot(trainer.model_parts), "sac_cache":
              counter.bytes_by_source["sac_cache"], "autograd": counter.bytes_by_source["autograd"],
              "kept_numels": sorted(counter.kept_numels),
              "expert_gather_numels": _expert_gather_numels(trainer.model_parts, trainer.dims.ep)}
    if dist.get_rank() == 0:
        torch.save(record, out / f"{case['name']}.pt")
        print(f"[ac_worker] {case['name']}: losses {losses} sac_cache {record['sac_cache']}", flush=True)
    del trainer, counter
    gc.collect()
    dist.barrier()


def main() -> int:
    from tests.helpers import run_worker_cases

    return run_worker_cases(run_case, "AC_WORKER_ONLY", timeout_s=240)


if __name__ == "__main__":
    from trainer.distributed import exit_process
    exit_process(main())
