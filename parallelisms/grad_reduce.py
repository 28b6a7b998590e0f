"""Gradients brought to their parameters' placements once per step, after backward.

Why: a replicated weight that reads sharded activations (a norm on the sequence-sharded
residual stream under SP, a router gate, replicated experts fed this rank's tokens) gets a
Partial gradient. FSDP2 reduces it in its reduce-scatter, but without FSDP it stays Partial,
and DTensor all-reduces it again inside every op that reads it: the norm for clipping and
each foreach op of the optimizer (four all-reduces per such weight per step with AdamW). A
Replicate gradient of a sharded weight (the vocab-sharded embedding) is likewise cut to its
shard by every op. Settling each gradient once, with the Partial sums of one mesh in a single
all-reduce, leaves the optimizer and the clipping no collective of their own.
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial, Replicate


def _partial_sum_to_replicate(grad: DTensor, param: DTensor) -> bool:
    return (grad.device_mesh.ndim == 1 and grad.device_mesh == param.device_mesh
            and isinstance(grad.placements[0], Partial) and grad.placements[0].reduce_op == "sum"
            and isinstance(param.placements[0], Replicate))


@torch.no_grad()
def settle_gradient_placements(parameters) -> None:
    """Gives every DTensor gradient its parameter's placements."""
    batched: dict = defaultdict(list)  # mesh -> params whose Partial(sum) gradient becomes Replicate
    for p in parameters:
        g = p.grad
        if not (isinstance(p, DTensor) and isinstance(g, DTensor)) or g.placements == p.placements:
            continue
        if _partial_sum_to_replicate(g, p):
            batched[g.device_mesh].append(p)
        else:
            p.grad = g.redistribute(p.device_mesh, p.placements)
    for mesh, params in batched.items():
        locals_ = [p.grad.to_local() for p in params]
        flat = torch.cat([t.reshape(-1) for t in locals_])  # [sum of numels]
        dist.all_reduce(flat, group=mesh.get_group())
        for p, local, piece in zip(params, locals_, flat.split([t.numel() for t in locals_])):
            p.grad = DTensor.from_local(piece.view_as(local), mesh, p.placements, run_check=False)
