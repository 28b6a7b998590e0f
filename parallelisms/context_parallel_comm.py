"""The collectives of context parallelism (CP), as custom ops, and the load-balanced layout.

Why custom ops (`torch.ops.titanlite.cp_*`) rather than `torch.distributed` calls in the
attention code:
- op-level activation checkpointing decides per dispatched op what to keep. A custom op
  reaches its policy as one op with its own name, so the CP plan can tell it "always
  save `titanlite.cp_all_gather` / `titanlite.cp_all_to_all`" (`CP_SAVE_OPS`) and the
  recompute returns the cached result instead of communicating again, independently of
  what the policy does with tensor-parallel (SP) all-gathers, which are
  `_c10d_functional` ops;
- the autograd rule sits next to the forward: the backward of an all-gather is a
  reduce-scatter (sum) of the gathered gradient, the backward of the equal-split
  all-to-all used here is the same all-to-all (it is its own inverse);
- torch.compile sees an opaque op with a shape rule (`register_fake`), never a
  process group object.

`comm_recorder()` records every payload these ops move (tests count recompute
collectives with it, `scripts/bench_context_parallel.py` reports bytes per layer).

Load-balanced ("head-tail") layout: the sequence is cut into 2*cp chunks of
c = seq_len / (2*cp) tokens and CP rank r holds chunks r and 2*cp-1-r, in that order.
Under the causal mask the work of a query chunk grows with its index, so every rank
gets the same total work ((r + 1) + (2*cp - r) = 2*cp + 1 key chunks).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


# ---------------------------------------------------------------------------
# Payload recording
# ---------------------------------------------------------------------------

@dataclass
class CommRecord:
    """What the CP collectives moved while a `comm_recorder()` was open.

    `calls` holds (op name, full buffer bytes, group size) per call; the bytes each rank
    puts on the wire for a buffer of N bytes over g ranks is N * (g - 1) / g for all of
    them (all-gather: the gathered buffer; reduce-scatter and all-to-all: the input)."""

    calls: list = field(default_factory=list)

    def count(self, name: str | None = None) -> int:
        return sum(1 for c in self.calls if name is None or c[0] == name)

    def wire_bytes(self) -> float:
        return sum(n * (g - 1) / g for _, n, g in self.calls)


_RECORDERS: list[CommRecord] = []


@contextlib.contextmanager
def comm_recorder():
    record = CommRecord()
    _RECORDERS.append(record)
    try:
        yield record
    finally:
        _RECORDERS.remove(record)


def _note(name: str, nbytes: int, group_size: int) -> None:
    for record in _RECORDERS:
        record.calls.append((name, nbytes, group_size))


# torch 2.13 renamed the single-tensor collectives (the old names warn).
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _group(name: str):
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(name)


# ---------------------------------------------------------------------------
# Custom ops. All work on dim 0 (callers move the split dimension there).
# ---------------------------------------------------------------------------

@torch.library.custom_op("titanlite::cp_all_gather", mutates_args=())
def cp_all_gather(x: torch.Tensor, group_name: str, group_size: int) -> torch.Tensor:
    """[n, ...] on each rank -> [group_size * n, ...], rank order."""
    out = x.new_empty((group_size * x.shape[0], *x.shape[1:]))
    _all_gather(out, x.contiguous(), group=_group(group_name))
    _note("all_gather", out.numel() * out.element_size(), group_size)
    return out


@cp_all_gather.register_fake
def _(x, group_name, group_size):
    return x.new_empty((group_size * x.shape[0], *x.shape[1:]))


@torch.library.custom_op("titanlite::cp_reduce_scatter", mutates_args=())
def cp_reduce_scatter(x: torch.Tensor, group_name: str, group_size: int) -> torch.Tensor:
    """[group_size * n, ...] -> [n, ...]: the sum over ranks of this rank's slice."""
    out = x.new_empty((x.shape[0] // group_size, *x.shape[1:]))
    _reduce_scatter(out, x.contiguous(), op=dist.ReduceOp.SUM, group=_group(group_name))
    _note("reduce_scatter", x.numel() * x.element_size(), group_size)
    return out


@cp_reduce_scatter.register_fake
def _(x, group_name, group_size):
    return x.new_empty((x.shape[0] // group_size, *x.shape[1:]))


@torch.library.custom_op("titanlite::cp_all_to_all", mutates_args=())
def cp_all_to_all(x: torch.Tensor, group_name: str, group_size: int) -> torch.Tensor:
    """[group_size, ...]: slice j goes to rank j; the result's slice i came from rank i."""
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    dist.all_to_all_single(out, x.contiguous(), group=_group(group_name))
    _note("all_to_all", x.numel() * x.element_size(), group_size)
    return out


@cp_all_to_all.register_fake
def _(x, group_name, group_size):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _save_group(ctx, inputs, output):
    ctx.group_name, ctx.group_size = inputs[1], inputs[2]


cp_all_gather.register_autograd(
    lambda ctx, grad: (cp_reduce_scatter(grad, ctx.group_name, ctx.group_size), None, None),
    setup_context=_save_group)
cp_reduce_scatter.register_autograd(
    lambda ctx, grad: (cp_all_gather(grad, ctx.group_name, ctx.group_size), None, None),
    setup_context=_save_group)
cp_all_to_all.register_autograd(
    lambda ctx, grad: (cp_all_to_all(grad, ctx.group_name, ctx.group_size), None, None),
    setup_context=_save_group)

# What op-level SAC must always save under CP: then a recompute never communicates.
CP_SAVE_OPS = frozenset({torch.ops.titanlite.cp_all_gather, torch.ops.titanlite.cp_all_to_all})


# ---------------------------------------------------------------------------
# Load-balanced layout
# ---------------------------------------------------------------------------

def rank_chunks(cp: int, rank: int) -> tuple[int, int]:
    """The two chunk indices (of 2*cp) that CP rank `rank` holds, in its local order."""
    return rank, 2 * cp - 1 - rank


def local_positions(seq_len: int, cp: int, rank: int, device=None) -> torch.Tensor:
    """[seq_len / cp] global token positions this rank holds, in local order."""
    c = seq_len // (2 * cp)
    return torch.cat([torch.arange(i * c, (i + 1) * c, device=device) for i in rank_chunks(cp, rank)])


def shard_sequence(x: torch.Tensor, cp: int, rank: int, dim: int = 1) -> torch.Tensor:
    """This rank's two chunks of `x` along `dim` (a copy, length x.shape[dim] / cp)."""
    chunks = x.chunk(2 * cp, dim=dim)
    return torch.cat([chunks[i] for i in rank_chunks(cp, rank)], dim=dim)


def natural_order(cp: int) -> list[int]:
    """Index into the 2*cp chunks of a rank-ordered buffer (rank 0's two chunks, then
    rank 1's, ...) that yields sequence order: natural chunk j sits at 2j for j < cp and
    at 2(2cp-1-j)+1 otherwise."""
    return [2 * j if j < cp else 2 * (2 * cp - 1 - j) + 1 for j in range(2 * cp)]


def rank_order(cp: int) -> list[int]:
    """The inverse of `natural_order`: sequence-ordered chunks -> rank order."""
    inverse = [0] * (2 * cp)
    for pos, j in enumerate(natural_order(cp)):
        inverse[j] = pos
    return inverse


_INDEX_TENSORS: dict = {}


def _index_tensor(index: list[int], like: torch.Tensor) -> torch.Tensor:
    """`index` as a tensor on `like`'s device, made once (no host-to-device copy per layer),
    outside any dispatch mode (SAC must not see a cache hit change the op sequence); made
    in place for fake tensors (the memory estimator) and under torch.compile."""
    from torch._subclasses.fake_tensor import is_fake

    device = like.device
    if torch.compiler.is_compiling() or is_fake(like) or device.type == "meta":
        return torch.tensor(index, device=device)
    key = (tuple(index), device)
    if key not in _INDEX_TENSORS:
        from torch.utils._python_dispatch import _disable_current_modes

        with _disable_current_modes():
            _INDEX_TENSORS[key] = torch.tensor(index, device=device)
    return _INDEX_TENSORS[key]


def reorder_chunks(x: torch.Tensor, index: list[int], dim: int) -> torch.Tensor:
    """Permutes the len(index) equal chunks of `x` along `dim`."""
    n = len(index)
    shape = x.shape
    # [..., S, ...] -> [..., n, S / n, ...]
    chunked = x.reshape(*shape[:dim], n, shape[dim] // n, *shape[dim + 1:])
    return chunked.index_select(dim, _index_tensor(index, x)).reshape(shape)


def unshard_sequence(shards: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """Inverse of `shard_sequence` given every rank's shard (rank order)."""
    cp = len(shards)
    return reorder_chunks(torch.cat(shards, dim=dim), natural_order(cp), dim)


def gather_sequence(x: torch.Tensor, group_name: str, cp: int, dim: int) -> torch.Tensor:
    """All-gathers this rank's shard along `dim` into the full sequence, natural order;
    the backward reduce-scatters the gradient."""
    moved = x.movedim(dim, 0)  # [S_local, ...]
    full = cp_all_gather(moved, group_name, cp)  # [S, ...] in rank order
    return reorder_chunks(full, natural_order(cp), 0).movedim(0, dim)
