"""Whole matrices for Muon's orthogonalisation, under FSDP, TP, their product, EP and PP.

Newton-Schulz orthogonalises a whole matrix: run on the shard a rank holds it computes
something else (the polar factor of a block is not a block of the polar factor). So the
update of every sharded Muon parameter is assembled where it is orthogonalised, as
DistMuon and Dion do, and only there, each matrix on exactly one rank of the mesh dims
that shard or replicate it:

1. the updates of the parameters that share a layout (equal mesh, placements, global
   shape) are stacked: this rank's shards, [J, m_local, n_local] (J = K parameters x
   their local leading dims). One stack at a time (`stacks`): it is built, orthogonalised
   and handed back before the next is built, so the memory beyond the optimizer's state
   is one stack's, not every update and result at once;
2. mesh dims over which the stack is replicated (HSDP's replicate dim, a Replicate
   DTensor) hold the same J rows on every member: member j keeps only the j-th chunk of
   them (no traffic), so the replicas split the NS work instead of repeating it;
3. the mesh dims that shard a matrix dim (the last two) are undone one at a time,
   innermost split first (`_levels`): over that mesh dim's group one all-to-all sends
   member j the j-th chunk of the stack's rows and receives, for this rank's chunk,
   every member's slice of the sharded dim. After the last level this rank holds about
   J / (replicas x ranks) whole matrices, and no matrix is held twice. FSDP over a
   TP-sharded dim (FSDP2's `_StridedShard`: FSDP splits each TP shard further) is one
   more level, the innermost; it splits the work like any other (issue 30: gathering
   that dim instead left every FSDP rank orthogonalising all of its TP rank's column-wise
   matrices);
4. each rank runs NS on the matrices it holds, in chunks (`ns_chunk`) whose results are
   written back into the stack, so NS's temporaries stay within about the stack's bytes;
5. the same all-to-alls in reverse order send every rank its shard of its replica's
   chunk of results back, then one all-gather per replicated mesh dim (innermost
   first) gives it every replica's chunk: its shard of every result.

Mesh dims that shard a leading (batch) dim stay as they are: under EP each rank holds
whole experts (`Shard(0)` on [E, m, n]), and FSDP over the experts ("efsdp") shards the
expert dim too, so expert matrices are orthogonalised where they live, with no traffic
(unless replicated: step 2 splits them too). Under PP each stage's optimizer sees only
its own parameters, so nothing crosses stages.

Shards follow DTensor's (and FSDP2's) chunk rule: a dim of size N over g ranks gives
member j max(0, min(N, c (j + 1)) - c j) entries, c = ceil(N / g); so do the stack's rows.

Bytes moved per step: at each level the all-to-all sends (g_l - 1) / g_l of a rank's
local share of the stacked updates, once each way: 2 sum_l (g_l - 1) / g_l x (the Muon
updates' bytes / the ranks sharding them) / R over R replicas, plus the replicas'
all-gather, which receives (R - 1) / R x (the updates' bytes / the ranks sharding them),
all in NS's dtype (bf16 on GPU), against FSDP's own (g - 1) / g x (2 all-gathers + 1
reduce-scatter) of all parameters per rank:
`python scripts/bench_muon.py bytes` prints both for real shapes (8B on FSDP 8: 0.07 of
FSDP's; without replicas). gloo and NCCL run the same collectives.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard

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


NS_CHUNK_BOUND = 1.0
"""`fn` gets the whole matrices a rank holds in chunks whose temporaries (`temporaries`:
elements per matrix) stay within NS_CHUNK_BOUND x the bytes of all those matrices (at least
one matrix a chunk). Why: NS needs 4.3x its input for a 28672 x 8192 matrix, so on all 20 of
a rank's w1/w3 matrices under llama70b TP 8 at once it held 37.5 GiB beside their 8.75 GiB;
in chunks of 4 it holds 7.5. With 1, NS's peak is about twice the matrices held (or one
matrix's NS, if more), and each chunk is still as many whole matrices as fit (each matmul
as large as unchunked). `inf`: all at once."""


def ns_chunk(count: int, m: int, n: int, temporaries: Callable[[int, int], int] | None) -> int:
    """Matrices per `fn` call on the `count` m x n matrices a rank holds: all of them without
    `temporaries`, else as many as keep `temporaries(m, n)` each within NS_CHUNK_BOUND x the
    elements of the `count` matrices (at least one)."""
    if temporaries is None or count == 0:
        return count
    return max(1, math.floor(min(count, NS_CHUNK_BOUND * count * m * n / temporaries(m, n))))


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


def _release(t: torch.Tensor) -> None:
    """Frees the bytes of a buffer that a finished collective used. Dropping the last Python
    reference is not enough: the collective's work object holds its tensors until its
    thread lets go of it (gloo's worker, after waking the caller), so the bytes were freed
    sometimes before the next buffer was allocated and sometimes after. FSDP2 frees its
    buffers the same way; on a GPU the caller's stream already waits for the collective."""
    t.untyped_storage().resize_(0)


def _send_matrix_dim(x: torch.Tensor, group, me: int, dim: int, sizes: list[int]):
    """All-to-all of a [J, ..., sizes[me], ...] stack: member j gets chunk j of the J rows.
    Returns what this rank received (every member's slice of `dim` of its own chunk, one
    after another) and each slice's shape, for `_join_matrix_dim`, so that the caller can
    free the stack before they are joined."""
    g = len(sizes)
    rows = [chunk_size(x.shape[0], g, j) for j in range(g)]
    per_row = x[0].numel() if x.shape[0] else math.prod(x.shape[1:])
    pieces = [_with((rows[me], *x.shape[1:]), dim, sizes[j]) for j in range(g)]
    out = x.new_empty(sum(math.prod(s) for s in pieces))
    dist.all_to_all_single(out, x.contiguous().view(-1), [math.prod(s) for s in pieces],
                           [r * per_row for r in rows], group=group)
    return out, pieces


def _join_matrix_dim(out: torch.Tensor, pieces: list, dim: int) -> torch.Tensor:
    """`_send_matrix_dim`'s received slices -> [J_me, ..., sum(sizes), ...]."""
    return torch.cat([t.view(s) for t, s in zip(out.split([math.prod(s) for s in pieces]), pieces)], dim=dim)


def _pack_matrix_dim(y: torch.Tensor, dim: int, sizes: list[int]) -> tuple[torch.Tensor, list[int]]:
    """[J_me, ..., sum(sizes), ...] -> one send buffer, member j's slice of `dim` contiguous
    in it (no second copy), and each slice's numel; the caller frees `y` before the all-to-all."""
    pieces = y.split(sizes, dim=dim)
    send, start = y.new_empty(y.numel()), 0
    for t in pieces:
        send[start:start + t.numel()].view(t.shape).copy_(t)
        start += t.numel()
    return send, [t.numel() for t in pieces]


def _return_matrix_dim(send: torch.Tensor, numels: list[int], shape, group, me: int, dim: int, sizes: list[int],
                       rows: int) -> torch.Tensor:
    """The inverse of `_send_matrix_dim` for a stack of `rows` rows, on `_pack_matrix_dim`'s buffer
    of results shaped `shape` [J_me, ..., sum(sizes), ...] -> [rows, ..., sizes[me], ...]."""
    g = len(sizes)
    chunks = [chunk_size(rows, g, j) for j in range(g)]
    shape = _with((rows, *shape[1:]), dim, sizes[me])
    per_row = math.prod(shape[1:])
    out = send.new_empty(math.prod(shape))
    dist.all_to_all_single(out, send, [c * per_row for c in chunks], numels, group=group)
    return out.view(shape)


def replicate_dims(t: torch.Tensor) -> list[int]:
    """The mesh dims (of size > 1) over which `t` is replicated: their ranks hold the same data."""
    if not isinstance(t, DTensor):
        return []
    return [i for i, q in enumerate(t.placements) if isinstance(q, Replicate) and t.device_mesh.size(i) > 1]


def matrix_replicas(t: torch.Tensor) -> int:
    """The ranks among which the matrices of `t` are split because they hold the same ones (1: none)."""
    return math.prod(t.device_mesh.size(i) for i in replicate_dims(t)) if replicate_dims(t) else 1


def stacks(params: list[torch.Tensor]) -> list[list[int]]:
    """Indices of `params` grouped into stacks: those sharded or replicated on equal layouts
    (equal mesh, placements and global shape; equal meshes need not be the same object: FSDP
    and the expert plans may build their own) share one; any other is a stack of its own.
    In order of each stack's first member: every rank of a mesh has the same parameters in
    the same order, so all visit the stacks that issue collectives in the same order."""
    out: dict = {}
    for i, p in enumerate(params):
        shared = needs_assembly(p) or replicate_dims(p)
        out.setdefault((p.device_mesh, tuple(p.placements), tuple(p.shape)) if shared else i, []).append(i)
    return list(out.values())


def _replica_rows(n: int, mesh, dims: list[int]) -> tuple[int, int, list[int]]:
    """(first row, rows, rows before each split) of the stack's n rows this rank takes over the
    replicated mesh dims, outermost first, by the chunk rule."""
    lo, before = 0, []
    for d in dims:
        g, me = mesh.size(d), mesh.get_local_rank(d)
        before.append(n)
        lo += min(n, -(-n // g) * me)
        n = chunk_size(n, g, me)
    return lo, n, before


def _gather_rows(x: torch.Tensor, group, g: int, rows: int) -> torch.Tensor:
    """[chunk of rows, ...] on each of the g members -> [rows, ...]: their chunks in order
    (padded to the largest chunk for one all-gather, then cut)."""
    c = -(-rows // g)
    send = x
    if x.shape[0] != c:
        send = x.new_zeros((c, *x.shape[1:]))
        send[:x.shape[0]].copy_(x)
    out = x.new_empty((g * c, *x.shape[1:]))
    dist.all_gather_into_tensor(out, send, group=group)
    return out[:rows]


def _orthogonalize_stack(params: list[torch.Tensor], idx: list[int], update, fn, apply,
                         dtype: torch.dtype, device, temporaries) -> None:
    p = params[idx[0]]
    local = p.to_local().shape if isinstance(p, DTensor) else p.shape
    lead, matrix = math.prod(local[:-2]), local[-2:]
    mesh, reps = (p.device_mesh, replicate_dims(p)) if isinstance(p, DTensor) else (None, [])
    # The replicas hold the same stack: each takes a chunk of its rows (no traffic to split it).
    lo, n, before = _replica_rows(len(idx) * lead, mesh, reps)
    # [n, m_local, n_local]; n spelt out: a rank's shard of a matrix dim may be empty (9 rows on 4 ranks)
    x = torch.empty((n, *matrix), dtype=dtype, device=device if device is not None else p.device)
    for k, i in enumerate(idx):
        u = update(i).reshape(lead, *matrix)  # every parameter's, for its momentum; its rows in range kept
        a, b = max(lo, k * lead), min(lo + n, (k + 1) * lead)
        if a < b:
            x[a - lo:b - lo].copy_(u[a - k * lead:b - k * lead])  # in NS's dtype, on the training device
        del u
    levels = _levels(p) if needs_assembly(p) else []
    rows = []
    for mesh_dim, dim, sizes in reversed(levels):  # innermost split first
        rows.append(x.shape[0])
        out, pieces = _send_matrix_dim(x, mesh.get_group(mesh_dim), mesh.get_local_rank(mesh_dim), dim, sizes)
        _release(x)  # sent: freed before the join, so a level holds two stacks' bytes, not three
        x = _join_matrix_dim(out, pieces, dim)
        _release(out)
    # [J_here, m, n]: whole matrices, each on this rank only; each chunk's result back in its rows.
    # On CPU a matrix's NS does not depend on the batch (bitwise equal to unchunked); a GPU's
    # batched matmuls may pick other kernels for another batch size (equal within rounding).
    step = ns_chunk(x.shape[0], *x.shape[1:], temporaries)
    for s in range(0, x.shape[0], step or 1):
        x[s:s + step] = fn(x[s:s + step])
    for (mesh_dim, dim, sizes), r in zip(levels, reversed(rows)):
        shape = x.shape
        send, numels = _pack_matrix_dim(x, dim, sizes)
        del x  # packed: freed before the receive buffer is allocated
        x = _return_matrix_dim(send, numels, shape, mesh.get_group(mesh_dim), mesh.get_local_rank(mesh_dim), dim,
                               sizes, r)
        _release(send)
    for d, r in zip(reversed(reps), reversed(before)):  # every replica's rows back, innermost split first
        x = _gather_rows(x, mesh.get_group(d), mesh.size(d), r)
    for k, i in enumerate(idx):
        apply(i, x[k * lead:(k + 1) * lead].view(local))


@torch.no_grad()  # gloo's all-gather writes into views of its output, which grad mode forbids
def orthogonalize(params: list[torch.Tensor], update: Callable[[int], torch.Tensor],
                  fn: Callable[[torch.Tensor], torch.Tensor], apply: Callable[[int, torch.Tensor], None],
                  dtype: torch.dtype, device: torch.device | None = None,
                  temporaries: Callable[[int, int], int] | None = None) -> None:
    """`fn` ([B, m, n] -> [B, m, n], one result per matrix) applied to every whole matrix of
    the updates of `params` (tensors or DTensors), a stack (`stacks`) at a time, so that the
    memory beyond the optimizer's state is one stack's: for each parameter of the stack,
    `update(i)` gives this rank's local shard of the update of `params[i]` (laid out like
    it), copied into the stack in `dtype` on `device` (None: the parameter's); each matrix
    is orthogonalised on one rank of the mesh dims that shard or replicate it, in chunks
    (`ns_chunk`: all at once without `temporaries`, the elements `fn` allocates per m x n
    matrix); then `apply(i, result)` gets this rank's local shard of each result."""
    for idx in stacks(params):
        _orthogonalize_stack(params, idx, update, fn, apply, dtype, device, temporaries)


__all__ = ["orthogonalize", "ns_chunk", "NS_CHUNK_BOUND", "stacks", "needs_assembly", "matrix_shard_ranks", "matrix_replicas", "replicate_dims",
           "chunk_size"]
