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
`python scripts/bench_muon.py bytes` prints both for real shapes (8B on FSDP 8: 0.07 of
FSDP's). On gloo (CPU) DTensor has no all-to-all and falls back to an all-gather and a
local chunk: the same results, g times the bytes; NCCL runs the all-to-all.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

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


def _as_dtensor(local: torch.Tensor, like: DTensor, placements) -> DTensor:
    return DTensor.from_local(local, like.device_mesh, placements, run_check=False, shape=like.shape,
                              stride=like.stride())


def orthogonalize(updates: list[torch.Tensor], params: list[torch.Tensor],
                  fn: Callable[[torch.Tensor], torch.Tensor]) -> list[torch.Tensor]:
    """`fn` ([B, m, n] -> [B, m, n], one result per matrix) applied to every whole matrix of
    `updates` (plain local tensors: this rank's shard of each update, laid out like the
    matching entry of `params`, a tensor or DTensor). Returns this rank's local shard of
    each result, in order."""
    out: list[torch.Tensor | None] = [None] * len(updates)
    groups: dict = {}
    resolved: dict[int, tuple] = {}
    for i, (u, p) in enumerate(zip(updates, params)):
        if not needs_assembly(p):  # whole matrices already here (plain, replicated, or sharded on a leading dim)
            out[i] = fn(u.reshape(-1, *u.shape[-2:])).reshape(u.shape)
            continue
        if _StridedShard and any(isinstance(q, _StridedShard) for q in p.placements):
            # FSDP over a TP-sharded dim: the stack cannot carry the interleaved layout, so that
            # mesh dim is all-gathered first (its bytes: an all-gather, not an all-to-all).
            plain = tuple(Replicate() if isinstance(q, _StridedShard) else q for q in p.placements)
            updates[i] = _as_dtensor(u, p, p.placements).redistribute(p.device_mesh, plain).to_local()
            resolved[i] = plain
        placements = resolved.get(i, tuple(p.placements))
        groups.setdefault((id(p.device_mesh), placements, tuple(p.shape)), []).append(i)
    for (_, placements, _), idx in groups.items():
        ref = params[idx[0]]
        mesh, src = ref.device_mesh, tuple(_shifted(q) for q in placements)
        dst = tuple(Shard(0) if _is_shard(q) and q.dim >= ref.ndim - 2 else s for q, s in zip(placements, src))
        shape = torch.Size((len(idx), *ref.shape))
        stride = torch.empty(shape, device="meta").stride()
        # [K, local...]: this rank's shard of each update, as one DTensor of K whole updates
        stack = DTensor.from_local(torch.stack([updates[i] for i in idx]), mesh, src, run_check=False,
                                   shape=shape, stride=stride)
        whole = stack.redistribute(mesh, dst).to_local()  # [K_here, ...whole matrices]
        done = fn(whole.reshape(-1, *whole.shape[-2:])).reshape(whole.shape)
        back = DTensor.from_local(done, mesh, dst, run_check=False, shape=shape, stride=stride)
        local = back.redistribute(mesh, src).to_local()  # [K, local...]
        for k, i in enumerate(idx):
            out[i] = local[k]
            if i in resolved:  # back to the interleaved shard (a local slice)
                out[i] = _as_dtensor(out[i], params[i], resolved[i]).redistribute(
                    params[i].device_mesh, params[i].placements).to_local()
    return out


__all__ = ["orthogonalize", "needs_assembly"]
