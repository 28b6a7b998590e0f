"""Whole matrices for Muon's orthogonalisation, under FSDP, TP, their product, EP and PP.

Newton-Schulz orthogonalises a whole matrix: run on the shard a rank holds it computes
something else (the polar factor of a block is not a block of the polar factor). So the
update of every sharded Muon parameter is assembled where it is orthogonalised, as
DistMuon and Dion do, and only there, each matrix on exactly one rank of the mesh dims
that shard it:

1. the updates of the parameters that share a layout (equal mesh, placements, global
   shape) are stacked: this rank's shards, [J, m_local, n_local] (J = K parameters x
   their local leading dims);
2. the mesh dims that shard a matrix dim (the last two) are undone one at a time,
   innermost split first (`_levels`): over that mesh dim's group one all-to-all sends
   member j the j-th chunk of the stack's J rows and receives, for this rank's chunk,
   every member's slice of the sharded dim. After the last level this rank holds about
   J / ranks whole matrices, and no matrix is held twice. FSDP over a TP-sharded dim
   (FSDP2's `_StridedShard`: FSDP splits each TP shard further) is one more level, the
   innermost; it splits the work like any other (issue 30: gathering that dim instead
   left every FSDP rank orthogonalising all of its TP rank's column-wise matrices);
3. each rank runs NS on the matrices it holds;
4. the same all-to-alls in reverse order send every rank its shard of every result back.

Mesh dims that shard a leading (batch) dim stay as they are: under EP each rank holds
whole experts (`Shard(0)` on [E, m, n]), and FSDP over the experts ("efsdp") shards the
expert dim too, so expert matrices are orthogonalised where they live, with no traffic.
Replicated mesh dims (HSDP's replicas) run the same NS on the same data. Under PP
each stage's optimizer sees only its own parameters, so nothing crosses stages.

Shards follow DTensor's (and FSDP2's) chunk rule: a dim of size N over g ranks gives
member j max(0, min(N, c (j + 1)) - c j) entries, c = ceil(N / g); so do the stack's rows.

Bytes moved per step: at each level the all-to-all sends (g_l - 1) / g_l of a rank's
local share of the stacked updates, once each way: 2 sum_l (g_l - 1) / g_l x (the Muon
updates' bytes / the ranks sharding them), in NS's dtype (bf16 on GPU), against FSDP's
own (g - 1) / g x (2 all-gathers + 1 reduce-scatter) of all parameters per rank:
`python scripts/bench_muon.py bytes` prints both for real shapes (8B on FSDP 8: 0.07 of
FSDP's). gloo and NCCL run the same all-to-alls.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

try:  # the placement FSDP2 uses when it shards a dim that TP already shards
    from torch.distributed.tensor.placement_types import _StridedShard
except ImportError:  # pragma: no cover
    _StridedShard = ()


def _is_strided(p) -> bool:
    return bool(_StridedShard) and isinstance(p, _StridedShard)


def _is_shard(p) -> bool:
    return isinstance(p, Shard) or _is_strided(p)  # _StridedShard is no Shard subclass in torch 2.13


def matrix_shard_ranks(t: torch.Tensor) -> int:
    """The ranks among which each matrix (the last two dims) of `t` is split: 1 when whole here."""
    if not isinstance(t, DTensor):
        return 1
    return math.prod(t.device_mesh.size(i) for i, p in enumerate(t.placements) if _is_shard(p) and p.dim >= t.ndim - 2)


def needs_assembly(t: torch.Tensor) -> bool:
    """True for a DTensor one of whose matrix dims (the last two) is sharded over > 1 rank."""
    return matrix_shard_ranks(t) > 1


def chunk_size(n: int, g: int, j: int) -> int:
    """Entries that member j of g holds of a dim of size n (DTensor's and FSDP2's chunk rule)."""
    c = -(-n // g)
    return max(0, min(n, c * (j + 1)) - c * j)


def _levels(p: DTensor) -> list[tuple[int, int, list[int]]]:
    """(mesh dim, stacked matrix dim 1 or 2, every member's size of that dim at that split)
    of each mesh dim that shards a matrix dim of `p`, outermost split first.

    Plain shards split in mesh-dim order (DTensor's default); a `_StridedShard` (FSDP2 over
    a dim TP already shards) splits after the later mesh dims whose sizes make its
    split_factor, i.e. innermost."""
    mesh, out = p.device_mesh, []
    for r in (p.ndim - 2, p.ndim - 1):
        on_r = [(i, q) for i, q in enumerate(p.placements) if _is_shard(q) and q.dim == r and mesh.size(i) > 1]
        order = [i for i, q in on_r if not _is_strided(q)]
        strided = [(i, q) for i, q in on_r if _is_strided(q)]
        if len(strided) > 1 or any(math.prod(mesh.size(j) for j in order if j > i) != q.split_factor
                                   for i, q in strided):
            raise NotImplementedError(f"Muon assembly: unsupported placements {p.placements} on {mesh}")
        order += [i for i, _ in strided]
        n = p.shape[r]
        for i in order:  # outer to inner: each split chunks what the previous one left this rank
            g = mesh.size(i)
            out.append((i, r - p.ndim + 3, [chunk_size(n, g, j) for j in range(g)]))
            n = chunk_size(n, g, mesh.get_local_rank(i))
    return out


def _with(shape, dim: int, size: int) -> list[int]:
    s = list(shape)
    s[dim] = size
    return s


def _gather_matrix_dim(x: torch.Tensor, group, me: int, dim: int, sizes: list[int]) -> torch.Tensor:
    """[J, ..., sizes[me], ...] -> [J_me, ..., sum(sizes), ...]: member j gets chunk j of the
    J rows; this rank receives every member's slice of `dim` of its own chunk."""
    g = len(sizes)
    rows = [chunk_size(x.shape[0], g, j) for j in range(g)]
    per_row = x[0].numel() if x.shape[0] else math.prod(x.shape[1:])
    pieces = [_with((rows[me], *x.shape[1:]), dim, sizes[j]) for j in range(g)]
    out = x.new_empty(sum(math.prod(s) for s in pieces))
    dist.all_to_all_single(out, x.contiguous().view(-1), [math.prod(s) for s in pieces],
                           [r * per_row for r in rows], group=group)
    return torch.cat([t.view(s) for t, s in zip(out.split([math.prod(s) for s in pieces]), pieces)], dim=dim)


def _scatter_matrix_dim(y: torch.Tensor, group, me: int, dim: int, sizes: list[int], rows: int) -> torch.Tensor:
    """The inverse of `_gather_matrix_dim` for a stack of `rows` rows: [J_me, ..., sum(sizes), ...]
    -> [rows, ..., sizes[me], ...]."""
    g = len(sizes)
    chunks = [chunk_size(rows, g, j) for j in range(g)]
    pieces = y.split(sizes, dim=dim)
    send, start = y.new_empty(y.numel()), 0
    for t in pieces:  # one send buffer, each member's slice contiguous in it (no second copy)
        send[start:start + t.numel()].view(t.shape).copy_(t)
        start += t.numel()
    shape = _with((rows, *y.shape[1:]), dim, sizes[me])
    per_row = math.prod(shape[1:])
    out = y.new_empty(math.prod(shape))
    dist.all_to_all_single(out, send, [c * per_row for c in chunks], [t.numel() for t in pieces], group=group)
    return out.view(shape)


def orthogonalize(updates: list[torch.Tensor], params: list[torch.Tensor],
                  fn: Callable[[torch.Tensor], torch.Tensor]) -> list[torch.Tensor]:
    """`fn` ([B, m, n] -> [B, m, n], one result per matrix) applied to every whole matrix of
    `updates` (plain local tensors: this rank's shard of each update, laid out like the
    matching entry of `params`, a tensor or DTensor), each matrix on one rank of the mesh
    dims that shard it. Returns this rank's local shard of each result, in order."""
    out: list[torch.Tensor | None] = [None] * len(updates)
    groups: dict = {}
    for i, (u, p) in enumerate(zip(updates, params)):
        if not needs_assembly(p):  # whole matrices already here (plain, replicated, or sharded on a leading dim)
            out[i] = fn(u.reshape(-1, *u.shape[-2:])).reshape(u.shape)
            continue
        # Equal meshes (not the same object: FSDP and the expert plans may build their own) share a stack.
        groups.setdefault((p.device_mesh, tuple(p.placements), tuple(p.shape)), []).append(i)
    for (mesh, _, _), idx in groups.items():
        levels = _levels(params[idx[0]])
        local = updates[idx[0]].shape
        # [J, m_local, n_local]; J spelt out: a rank's shard of a matrix dim may be empty (9 rows on 4 ranks)
        x = torch.stack([updates[i] for i in idx]).reshape(len(idx) * math.prod(local[:-2]), *local[-2:])
        rows = []
        for mesh_dim, dim, sizes in reversed(levels):  # innermost split first
            rows.append(x.shape[0])
            x = _gather_matrix_dim(x, mesh.get_group(mesh_dim), mesh.get_local_rank(mesh_dim), dim, sizes)
        if x.shape[0]:  # [J_here, m, n]: whole matrices, each on this rank only
            x = fn(x)
        for (mesh_dim, dim, sizes), n in zip(levels, reversed(rows)):
            x = _scatter_matrix_dim(x, mesh.get_group(mesh_dim), mesh.get_local_rank(mesh_dim), dim, sizes, n)
        for i, shard in zip(idx, x.view(len(idx), *local)):
            out[i] = shard
    return out


__all__ = ["orthogonalize", "needs_assembly", "matrix_shard_ranks", "chunk_size"]
