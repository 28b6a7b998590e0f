"""Whole matrices for Muon's orthogonalisation, under FSDP, TP, their product, EP and PP.

Newton-Schulz orthogonalises a whole matrix: run on the shard a rank holds it computes
something else (the polar factor of a block is not a block of the polar factor). So the
update of every sharded Muon parameter is assembled where it is orthogonalised, as
DistMuon and Dion do, and only there:

1. the updates of the parameters that share a layout (mesh, placements, global shape)
   are stacked into one DTensor [K, ...], whose placements are the parameter's shifted
   by the new leading dim;
2. that stack is redistributed so that each mesh dim which shards a *matrix* dim
   (the last two) shards the stack dim instead: `Shard(r) -> Shard(0)` is one
   all-to-all per mesh dim, after which each rank holds about K / ranks whole matrices
   (round-robin in blocks), not one K-th of every matrix;
3. each rank runs NS on the matrices it holds;
4. the reverse redistribution sends every rank its shard of every result back.

Mesh dims that shard a leading (batch) dim stay as they are: under EP each rank holds
whole experts (`Shard(0)` on [E, m, n]), and FSDP over the experts ("efsdp") shards the
expert dim too, so expert matrices are orthogonalised where they live, with no traffic.
Replicated mesh dims (HSDP's replicas) run the same NS on the same data. Under PP
each stage's optimizer sees only its own parameters, so nothing crosses stages.

Bytes moved per step: each of the two all-to-alls sends (g - 1) / g of a rank's local
share of the sharded Muon updates (g: ranks of the mesh dims being gathered), i.e.
2 (g - 1) / g^2 x the Muon updates' bytes per rank, in NS's dtype (bf16 on GPU), against
FSDP's own (g - 1) / g x (2 all-gathers + 1 reduce-scatter) of all parameters per rank:
`python scripts/bench_muon.py bytes` prints both for real shapes (8B on FSDP 8: 0.15 of
FSDP's). On gloo (CPU) DTensor has no all-to-all and falls back to an all-gather and a
local chunk: the same results, g times the bytes; NCCL runs the all-to-all.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.distributed.tensor import DTensor, Shard

try:  # the placement FSDP2 uses when it shards a dim that TP already shards
    from torch.distributed.tensor.placement_types import _StridedShard
except ImportError:  # pragma: no cover
    _StridedShard = ()


def _is_shard(p) -> bool:
    return isinstance(p, Shard)  # _StridedShard subclasses Shard


def _shifted(p):
    """The placement of one parameter's placement in the stack (one more leading dim)."""
    if not _is_shard(p):
        return p
    if _StridedShard and isinstance(p, _StridedShard):
        return _StridedShard(p.dim + 1, split_factor=p.split_factor)
    return Shard(p.dim + 1)


def needs_assembly(t: torch.Tensor) -> bool:
    """True for a DTensor one of whose matrix dims (the last two) is sharded."""
    if not isinstance(t, DTensor):
        return False
    return any(_is_shard(p) and p.dim >= t.ndim - 2 for p in t.placements)


def _layout_key(t: DTensor):
    return (id(t.device_mesh), tuple(t.placements), tuple(t.shape))


def orthogonalize(updates: list[torch.Tensor], params: list[torch.Tensor],
                  fn: Callable[[torch.Tensor], torch.Tensor]) -> list[torch.Tensor]:
    """`fn` ([B, m, n] -> [B, m, n], one result per matrix) applied to every whole matrix of
    `updates` (plain local tensors: this rank's shard of each update, laid out like the
    matching entry of `params`, a tensor or DTensor). Returns this rank's local shard of
    each result, in order."""
    out: list[torch.Tensor | None] = [None] * len(updates)
    groups: dict = {}
    for i, (u, p) in enumerate(zip(updates, params)):
        if needs_assembly(p):
            groups.setdefault(_layout_key(p), []).append(i)
        else:  # whole matrices already here (plain, replicated, or sharded on a leading dim)
            out[i] = fn(u.reshape(-1, *u.shape[-2:])).reshape(u.shape)
    for idx in groups.values():
        ref = params[idx[0]]
        mesh, src = ref.device_mesh, tuple(_shifted(p) for p in ref.placements)
        dst = tuple(Shard(0) if _is_shard(p) and p.dim >= ref.ndim - 2 else q for p, q in zip(ref.placements, src))
        shape = (len(idx), *ref.shape)
        stride = torch.empty(shape, device="meta").stride()
        # [K, local...]: this rank's shard of each update, as one DTensor of K whole updates
        stack = DTensor.from_local(torch.stack([updates[i] for i in idx]), mesh, src, run_check=False,
                                   shape=torch.Size(shape), stride=stride)
        whole = stack.redistribute(mesh, dst).to_local()  # [K_here, ...whole matrices]
        done = fn(whole.reshape(-1, *whole.shape[-2:])).reshape(whole.shape)
        back = DTensor.from_local(done, mesh, dst, run_check=False, shape=torch.Size(shape), stride=stride)
        local = back.redistribute(mesh, src).to_local()  # [K, local...]
        for k, i in enumerate(idx):
            out[i] = local[k]
    return out


__all__ = ["orthogonalize", "needs_assembly"]
