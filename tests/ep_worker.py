"""Runs several MoE training layouts in one torchrun launch; dumps full params, grads, buffers.

    python -m torch.distributed.run --nproc-per-node N -m tests.ep_worker CASES.json OUT_DIR

CASES.json: a list of {"name", "args": [CLI overrides], optional "copy": [src, dst] (rank 0
copies a checkpoint folder first)}. One process group serves every case; each Trainer
builds its own mesh. For each case, the rank at dp/tp coordinate 0 of every pipeline stage
writes OUT_DIR/<name>.stage<pp>.pt = {"losses", "params", "grads", "buffers", "metrics"}:
unsharded values (DTensor.full_tensor()) under the model's own names, grads of the last
step, params and expert_bias after it. Also registers the test flavor `ep_test`.
"""

from __future__ import annotations

import gc
import shutil
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from models.deepseek_v3.args import DEEPSEEK_V3_FLAVORS, DeepSeekV3Args  # noqa: E402

# Tiny DeepSeek V3: 1 dense + 2 MoE blocks, 8 experts top-2, one shared expert, MLA with q LoRA.
EP_TEST = DeepSeekV3Args(
    vocab_size=2048, dim=64, n_layers=3, n_dense_layers=1, inter_dim=128, max_seq_len=256,
    moe_inter_dim=32, n_routed_experts=8, n_shared_experts=1, n_activated_experts=2,
    n_expert_groups=1, n_limited_groups=1, score_func="sigmoid", route_scale=1.0,
    n_heads=4, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
    rope_factor=1.0,
)
DEEPSEEK_V3_FLAVORS.setdefault("ep_test", EP_TEST)

# Routing skew written into the seed checkpoint's expert_bias: experts 6 and 7 are never
# picked (sigmoid scores are in (0, 1)), expert 0 is favoured. With EP 4, EP rank 3 owns
# exactly experts 6 and 7, so it receives zero rows from every peer.
SKEW_BIAS = [0.03, 0.01, 0.0, 0.0, 0.0, -0.01, -10.0, -10.0]
WRAPPERS = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")


def clean(name: str) -> str:
    for w in WRAPPERS:
        name = name.replace(w, "")
    return name


def full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        t = t.full_tensor()
    return t.detach().to("cpu", copy=True)


def snapshot(model_parts) -> dict:
    out: dict = {"params": {}, "grads": {}, "buffers": {}}
    for part in model_parts:
        for name, p in part.named_parameters():
            out["params"][clean(name)] = full(p)
            if p.grad is not None:
                out["grads"][clean(name)] = full(p.grad)
        for name, b in part.named_buffers():
            if name.endswith("expert_bias"):
                out["buffers"][clean(name)] = full(b)
    return out


def write_seed_checkpoint(args: list[str]) -> None:
    """A one-process seed checkpoint whose MoE layers carry SKEW_BIAS."""
    from trainer.config import load_config
    from trainer.train import Trainer

    trainer = Trainer(load_config(args))
    with torch.no_grad():
        for part in trainer.model_parts:
            for name, b in part.named_buffers():
                if name.endswith("expert_bias"):
                    b.copy_(torch.tensor(SKEW_BIAS, dtype=b.dtype))
    try:
        trainer.train()
    finally:
        trainer.close()


def run_case(case: dict, out: Path) -> None:
    from tests.helpers import read_metrics
    from trainer.config import load_config
    from trainer.train import Trainer

    rank = dist.get_rank()
    if "copy" in case:
        src, dst = case["copy"]
        if rank == 0:
            shutil.rmtree(dst, ignore_errors=True)
            shutil.copytree(src, dst)
        dist.barrier()
    cfg = load_config(case["args"])
    trainer = Trainer(cfg)
    try:
        losses = trainer.train()
    finally:
        trainer.close(destroy_process_group=False)
    record = {"losses": losses, **snapshot(trainer.model_parts)}
    # Forwards in which some EP rank received no token at all, summed over ranks.
    empty = torch.tensor([sum(getattr(getattr(m, "token_dispatcher", None), "empty_calls", 0)
                              for part in trainer.model_parts for m in part.modules())])
    dist.all_reduce(empty)
    record["empty_receives"] = int(empty.item())
    if trainer.dims.coordinate("dp") == 0 and trainer.dims.coordinate("tp") == 0:
        if trainer.is_logging_rank:
            record["metrics"] = read_metrics(cfg.job.dump_folder)
        torch.save(record, out / f"{case['name']}.stage{trainer.dims.coordinate('pp')}.pt")
    if rank == 0:
        print(f"[ep_worker] {case['name']}: losses {losses}", flush=True)
    del trainer
    gc.collect()
    dist.barrier()


def main() -> int:
    from tests.helpers import run_worker_cases

    return run_worker_cases(run_case, "EP_WORKER_ONLY", timeout_s=240)


if __name__ == "__main__":
    from trainer.distributed import exit_process
    exit_process(main())
