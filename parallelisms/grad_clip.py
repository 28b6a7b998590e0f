"""Gradient-norm clipping across every mesh dimension.

Gradients may be DTensors on different meshes (dense params on dp x tp, experts on
an EP mesh) or plain tensors on one pipeline stage only. We take the norm of each
group on its own mesh (DTensor reduces over that mesh), sum the squares, and
all-reduce over the PP group so every stage clips by the same global norm.
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


@torch.no_grad()
def clip_grad_norm_(parameters, max_norm: float, pp_group=None, foreach: bool | None = None) -> torch.Tensor:
    """Clips in place and returns the total (pre-clip) L2 norm, identical on every rank."""
    params = [p for p in parameters if p.grad is not None]
    groups: dict = defaultdict(list)
    for p in params:
        key = (p.grad.device_mesh, p.grad.placements) if isinstance(p.grad, DTensor) else None
        groups[key].append(p.grad)
    device = params[0].grad.device if params else torch.device("cpu")
    # CPU's fp32 norm kernel accumulates poorly: on a 2048 x 256 gradient it was off by 2e-4
    # relative, enough to change the clipping factor between layouts (a sharded tensor's norm
    # is summed from smaller, more exact pieces). Accumulate in fp64 there; CUDA's fp32
    # reductions are tree-shaped and accurate.
    acc = torch.float64 if device.type == "cpu" else torch.float32
    total_sq = torch.zeros((), dtype=acc, device=device)
    for grads in groups.values():
        if foreach is False:
            norms = [torch.linalg.vector_norm(g, 2.0, dtype=acc) for g in grads]
        else:
            norms = torch._foreach_norm(grads, 2.0, dtype=acc)
        norm = torch.linalg.vector_norm(torch.stack(list(norms)), 2.0)  # stays a partial norm on DTensors
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        total_sq = total_sq + norm.to(device) ** 2
    if pp_group is not None:
        dist.all_reduce(total_sq, group=pp_group)
    total = total_sq.sqrt().float()
    if max_norm > 0 and params:
        # Same coefficient as torch.nn.utils.clip_grads_with_norm_, applied per group: one
        # foreach op may not mix DTensors of different meshes, or DTensors and plain tensors.
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for grads in groups.values():
            if foreach is False:
                for g in grads:
                    g.mul_(coef.to(g.device))
            else:
                torch._foreach_mul_(grads, coef.to(grads[0].device))
    return total
