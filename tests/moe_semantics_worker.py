"""Runs MoE training cases and records what the semantics table of docs/moe.md is about.

    python -m torch.distributed.run --nproc-per-node 2 -m tests.moe_semantics_worker CASES.json OUT_DIR

For each case the rank at dp, cp and tp coordinate 0 of every pipeline stage writes
OUT_DIR/<name>.stage<pp>.pt = {"losses", "loads", "params", "grads", "buffers"}: `loads` is
one [L, E] tensor per step ([0] on a stage without MoE layers), the expert loads each bias update used (summed over the stage's
ranks, the MoE layers of this stage in order); the rest as tests/ep_worker.py writes them
(unsharded; grads of the last step; expert_bias after it). Importing this module registers
the DeepSeek `ep_test` flavor (1 dense + 2 MoE blocks, 8 experts top 2).
"""

from __future__ import annotations

import contextlib
import gc
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.ep_worker import snapshot  # noqa: E402  (also registers the `ep_test` flavor)


@contextlib.contextmanager
def recording_loads():
    """Yields a list that gets, per optimizer step, the [L, E] loads behind the bias update
    (what `update_moe_load_balance_bias` returns), for every MoE model spec."""
    import models.common.moe_balance as balance

    loads: list[torch.Tensor] = []

    def update(*args, **kwargs):
        counts = real(*args, **kwargs)
        loads.append(counts.clone() if counts is not None else torch.empty(0))  # (a stage without MoE layers)
        return counts

    real = balance.update_moe_load_balance_bias  # what `moe_post_optimizer_step` calls, for every MoE spec
    balance.update_moe_load_balance_bias = update
    try:
        yield loads
    finally:
        balance.update_moe_load_balance_bias = real


def train(args: list[str], destroy_process_group: bool = True):
    """(record, trainer) of a run of `args` in this process (one rank, or one of torchrun's)."""
    from trainer.config import load_config
    from trainer.train import Trainer

    trainer = Trainer(load_config(args))
    with recording_loads() as loads:
        try:
            losses = trainer.train()
        finally:
            trainer.close(destroy_process_group=destroy_process_group)
    return {"losses": losses, "loads": loads, **snapshot(trainer.model_parts)}, trainer


def run_case(case: dict, out: Path) -> None:
    import torch.distributed as dist

    record, trainer = train(case["args"], destroy_process_group=False)
    if all(trainer.dims.coordinate(d) == 0 for d in ("dp", "cp", "tp")):
        torch.save(record, out / f"{case['name']}.stage{trainer.dims.coordinate('pp')}.pt")
    del trainer
    gc.collect()
    dist.barrier()


if __name__ == "__main__":
    from tests.helpers import run_worker_cases

    from trainer.distributed import exit_process
    exit_process(run_worker_cases(run_case, "MOE_SEMANTICS_ONLY"))
