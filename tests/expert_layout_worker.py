"""The routed experts stored for the float8 kernel (`GroupedExperts.store_for_kernel`) under
the trainer's sharding order (EP on a one-rank "ep" mesh, then FSDP2 on a one-rank mesh,
then materialise and init), against the plain layout: one forward + backward each, on the
plain grouped GEMM (the float8 kernel is CUDA SM90+ only). Prints JSON: the losses, whether
the state dicts are equal, and the worst relative grad difference.

    python -m tests.expert_layout_worker

Run in a subprocess by tests/test_float8_expert_layout.py (it initialises a process group).
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def run(kernel_layout: bool) -> tuple[float, dict, dict]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from models import get_model_spec
    from models.common.moe import GroupedExperts
    from parallelisms.expert_parallel import apply_expert_parallel
    from parallelisms.float8 import enable_float8_grouped_experts

    spec = get_model_spec("deepseek_v3")
    args = dataclasses.replace(spec.flavors["debug"], n_layers=2)
    with torch.device("meta"):
        model = spec.model_cls(args)
    if kernel_layout:
        enable_float8_grouped_experts(model, None)
        for m in model.modules():
            if isinstance(m, GroupedExperts):
                m.float8_grouped_mm = False  # the stored layout, the plain kernel
    apply_expert_parallel(model, init_device_mesh("cpu", (1,), mesh_dim_names=("ep",)))
    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("dp_shard",))
    for block in model.layers.values():
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.init_weights()
    tokens = torch.randint(0, args.vocab_size, (2, 32), generator=torch.Generator().manual_seed(1))
    loss = model(tokens).float().square().mean()
    loss.backward()
    full = lambda t: t.full_tensor() if hasattr(t, "full_tensor") else t  # noqa: E731
    state = {k: full(v).clone() for k, v in model.state_dict().items()}
    grads = {n: full(p.grad) for n, p in model.named_parameters()}
    if kernel_layout:  # the grads of stored [E, N, K] params, back to [E, K, N]
        grads = {n: g.mT if ".experts.w" in n and "shared" not in n else g for n, g in grads.items()}
    return loss.item(), state, grads


def main() -> None:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        (l0, s0, g0), (l1, s1, g1) = run(False), run(True)
        worst = max(((g0[n] - g1[n]).abs().max() / g0[n].abs().max().clamp_min(1e-12)).item() for n in g0)
        print(json.dumps({"loss_plain": l0, "loss_kernel": l1, "state_equal": s0.keys() == s1.keys() and all(
            torch.equal(s0[k], s1[k]) for k in s0), "experts": sum(".experts.w" in k for k in s0),
            "max_grad_rel": worst}))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    from trainer.distributed import exit_process
    main()
    exit_process(0)
