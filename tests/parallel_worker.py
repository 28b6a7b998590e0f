"""Runs several training layouts in one torchrun launch and dumps full params/grads.

    python -m torch.distributed.run --nproc-per-node N tests/parallel_worker.py CASES.json OUT_DIR

CASES.json is a list of {"name": str, "args": [CLI overrides...], optional "copy": [src, dst]
(rank 0 copies a checkpoint folder before the case), optional "dump_loaded": bool (also dump
the params right after the Trainer is built, i.e. after a checkpoint load), optional "import":
a module to import first (e.g. one that registers test flavors)}. All ranks run
the cases in order; one process group serves them all (each Trainer builds its own mesh).

For each case, one rank per pipeline stage (dp, cp and tp coordinate 0) writes
OUT_DIR/<name>.stage<pp rank>.pt with {"losses", "params", "grads", ["loaded"]}: unsharded
(DTensor.full_tensor()) values under the model's own parameter names. Grads are those of
the last step (after clipping), params are those after the last optimizer step.
"""

from __future__ import annotations

import gc
import importlib
import shutil
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")


def clean_name(name: str) -> str:
    for p in WRAPPER_PREFIXES:
        name = name.replace(p, "")
    return name


def full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        t = t.full_tensor()
    return t.detach().to("cpu", copy=True)


def gather_state(model_parts, with_grads: bool) -> tuple[dict, dict]:
    params, grads = {}, {}
    for part in model_parts:
        for name, p in part.named_parameters():
            name = clean_name(name)
            params[name] = full(p)
            if with_grads and p.grad is not None:
                grads[name] = full(p.grad)
    return params, grads


def run_case(case: dict, out: Path) -> None:
    from trainer.config import load_config
    from trainer.train import Trainer

    rank = dist.get_rank()
    if "import" in case:
        importlib.import_module(case["import"])
    if "copy" in case:
        src, dst = case["copy"]
        if rank == 0:
            shutil.rmtree(dst, ignore_errors=True)
            shutil.copytree(src, dst)
        dist.barrier()
    t0 = time.perf_counter()
    cfg = load_config(case["args"])
    trainer = Trainer(cfg)
    writer = all(trainer.dims.coordinate(d) == 0 for d in ("dp", "cp", "tp"))
    record: dict = {}
    if case.get("dump_loaded"):
        record["loaded"], _ = gather_state(trainer.model_parts, with_grads=False)
        record["loaded_step"] = trainer.step
    try:
        record["losses"] = trainer.train()
    finally:
        trainer.close(destroy_process_group=False)
    record["params"], record["grads"] = gather_state(trainer.model_parts, with_grads=True)
    record["seconds"] = time.perf_counter() - t0
    if writer:
        torch.save(record, out / f"{case['name']}.stage{trainer.dims.coordinate('pp')}.pt")
    if rank == 0:
        print(f"[worker] case {case['name']}: {record['seconds']:.1f} s, losses {record['losses']}", flush=True)
    del trainer
    gc.collect()
    # A fresh compile cache for the next case, as a run in its own process has: dynamo's cache is
    # per code object, so a model with other shapes would recompile attention with dynamic shapes,
    # and SDPA refuses a symbolic `enable_gqa`.
    torch._dynamo.reset()
    dist.barrier()


def main() -> int:
    from tests.helpers import run_worker_cases

    return run_worker_cases(run_case, "WORKER_ONLY", timeout_s=300)


if __name__ == "__main__":
    from trainer.distributed import exit_process
    exit_process(main())
