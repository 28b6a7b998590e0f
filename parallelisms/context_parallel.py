"""Context parallelism (CP): every CP rank holds a slice of each sequence.

User guide: docs/context_parallel.md. The collectives, their autograd and the
load-balanced ("head-tail") layout are in `parallelisms/context_parallel_comm.py`.

Everything outside attention is position-wise, so it runs unchanged on a rank's
seq_len / cp tokens; only attention needs the other ranks' tokens. The CP plan is
applied from outside, like the TP plan:

- each attention's `sdpa` module (`models.common.attention.SDPA`, called as
  `sdpa(q, k, v)` with q [B, Hq, S_local, D], k/v [B, Hkv, S_local, D(v)], causal) is
  replaced by a `ContextParallelAttention` that keeps the original as `inner` (for its
  softmax scale and its local kernel choice);
- a forward pre-hook on the model part passes the RoPE positions of the rank's tokens
  (`positions=`) when the caller gave none, so pipeline schedules need nothing new;
- `shard_microbatch` cuts inputs and labels the same way before the forward.

Methods (`parallelism.context_parallel_method`):
- `allgather`: K and V (the Hkv heads, never repeated ones; one packed buffer) are
  all-gathered into the full sequence; each of the rank's two query chunks attends to
  the key prefix that ends with its own chunk, with a causal mask aligned to the lower
  right (query i of chunk j sees keys up to j*c + i). The backward reduce-scatters dK/dV.
  MLA (DeepSeek) gathers instead its per-token latent (576 values for V3, not the
  40960 of the expanded k and v) at the model's `attention.kv_latent` hook point
  (`SequenceGather`); k and v then reach the CP attention already gathered.
- `alltoall` (Ulysses): one all-to-all turns q, k, v from sequence-sharded (all heads)
  into head-sharded (Hq / cp heads, full sequence), the model's own SDPA runs causal on
  that, and a second all-to-all brings the output back. Needs the local head count
  (after TP) divisible by cp; KV heads are repeated only as far as needed to divide.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from parallelisms.context_parallel_comm import (
    CP_SAVE_OPS, cp_all_to_all, gather_sequence, local_positions, natural_order, rank_chunks, rank_order,
    reorder_chunks, shard_sequence)

CP_METHODS = ("allgather", "alltoall")

__all__ = ["CP_METHODS", "CP_SAVE_OPS", "ContextParallelAttention", "apply_context_parallel",
           "check_context_parallel_layout", "shard_microbatch", "kv_repeat_for_alltoall"]


# ---------------------------------------------------------------------------
# Layout checks (config time: one line each)
# ---------------------------------------------------------------------------

def kv_repeat_for_alltoall(n_heads: int, n_kv_heads: int, cp: int) -> int | None:
    """How many times all-to-all CP repeats each KV head so that cp divides them (1 if it
    already does), or None when the q heads cannot be split over cp that way."""
    if n_heads % cp:
        return None
    repeat = cp // math.gcd(n_kv_heads, cp)
    return repeat if (n_heads // n_kv_heads) % repeat == 0 else None


def check_context_parallel_layout(model_args, *, cp: int, tp: int, method: str, seq_len: int,
                                  sequence_parallel: bool, float8_filter: list[str] | None = None) -> None:
    """`float8_filter`: float8.filter_fqns when float8 is on, else None."""
    from configuration.fields import ConfigError

    if cp <= 1:
        return
    if method == "allgather" and getattr(model_args, "kv_lora_rank", 0) and float8_filter is not None:
        from parallelisms.float8 import name_matches

        if not name_matches("layers.0.attention.wkv_b", float8_filter):
            # Each CP rank's wkv_b sees the whole gathered latent but only its own queries' share of
            # its gradient: cast to float8 part by part, then summed, it rounds unlike one rank's
            # (measured: after 3 steps as far from one rank's float8 as float8 is from fp32).
            raise ConfigError(
                "config error: parallelism.context_parallel_method: allgather gathers MLA's latent before wkv_b, "
                "so under float8 each CP rank casts a partial gradient of wkv_b's output; use "
                "context_parallel_method = \"alltoall\" or add wkv_b to float8.filter_fqns")
    if seq_len % (2 * cp):
        raise ConfigError(
            f"config error: training.seq_len: {seq_len} is not divisible by 2 x context_parallel_degree = "
            f"{2 * cp} (each CP rank holds two chunks); use a multiple of {2 * cp}")
    if sequence_parallel and tp > 1 and (seq_len // cp) % tp:
        raise ConfigError(
            f"config error: training.seq_len: seq_len / cp = {seq_len // cp} is not divisible by "
            f"tensor_parallel_degree {tp} (sequence parallel shards each CP rank's tokens); use a multiple "
            f"of {2 * cp * tp // math.gcd(2, tp)}")
    n_heads = getattr(model_args, "n_heads", None)
    if method == "alltoall" and n_heads is not None:
        n_kv = getattr(model_args, "n_kv_heads", None) or n_heads
        local, local_kv = n_heads // tp, max(n_kv // tp, 1)
        if kv_repeat_for_alltoall(local, local_kv, cp) is None:
            raise ConfigError(
                f"config error: parallelism.context_parallel_method: alltoall splits the {local} local attention "
                f"heads (after TP {tp}) over context_parallel_degree {cp}, which does not divide them; use "
                "context_parallel_method = \"allgather\" or a CP degree that divides the heads")


# ---------------------------------------------------------------------------
# Attention
# ---------------------------------------------------------------------------

_CPU_MASKS: dict = {}


def lower_right_mask(q_len: int, k_len: int, dtype: torch.dtype, device: torch.device):
    """The mask that lets query i see keys up to i + k_len - q_len.

    Off CPU: a `CausalBias`, which CUDA's flash / memory-efficient kernels apply without
    materialising anything. On CPU the fused kernel needs a real additive mask (and keeps
    it for backward): one is built per shape, dtype and device and shared by every layer
    and step, so it costs q_len x k_len elements once, not per layer. Built with dispatch
    modes off, so that op-level SAC never sees it (creating the tensor subclass under its
    mode fails, and a cache hit must not change the ops the recompute replays).

    Under torch.compile (which traces neither the cache nor `CausalBias`) CUDA runs flex
    attention instead (`attend_prefix`, no mask at all); only CPU builds a boolean mask
    inside the graph (q_len x k_len bytes per call: flex has no CPU backward in torch 2.13)."""
    if torch.compiler.is_compiling():
        return torch.ones(q_len, k_len, dtype=torch.bool, device=device).tril(k_len - q_len)
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes():
        if device.type != "cpu":
            from torch.nn.attention.bias import causal_lower_right

            return causal_lower_right(q_len, k_len)
        key = (q_len, k_len, dtype, device)
        if key not in _CPU_MASKS:
            if len(_CPU_MASKS) > 64:
                _CPU_MASKS.clear()
            visible = torch.ones(q_len, k_len, dtype=torch.bool, device=device).tril(k_len - q_len)
            _CPU_MASKS[key] = torch.zeros(q_len, k_len, dtype=dtype, device=device).masked_fill(
                ~visible, float("-inf"))
        return _CPU_MASKS[key]


FLEX_BLOCK = 128  # flex attention's tile


def flex_under_compile(device: torch.device) -> bool:
    """Whether compiled CP attention runs flex (CUDA) rather than SDPA with a bool mask (CPU)."""
    return device.type == "cuda"


def lower_right_block_mask(q_len: int, k_len: int, device: torch.device):
    """The flex BlockMask of lower-right causal attention (query i sees keys <= i + k_len -
    q_len), from tile bounds: [q_len / 128, k_len / 128] tiles, never a [q_len, k_len] mask.
    A kv tile is full when its last key is visible to the q tile's first query, partial when
    only its first key is visible to the q tile's last query (ragged edge tiles are partial)."""
    from torch.nn.attention.flex_attention import BlockMask

    offset = k_len - q_len
    q_start = torch.arange(-(-q_len // FLEX_BLOCK), device=device) * FLEX_BLOCK
    k_start = torch.arange(-(-k_len // FLEX_BLOCK), device=device) * FLEX_BLOCK
    q_end = torch.clamp_max(q_start + FLEX_BLOCK - 1, q_len - 1)
    k_end = torch.clamp_max(k_start + FLEX_BLOCK - 1, k_len - 1)
    full = k_end[None, :] <= q_start[:, None] + offset  # [nq, nk]
    if q_len % FLEX_BLOCK:
        full[-1, :] = False
    if k_len % FLEX_BLOCK:
        full[:, -1] = False
    partial = (k_start[None, :] <= q_end[:, None] + offset) & ~full

    def sparse(tiles: torch.Tensor):
        # [1, 1, nq] counts and [1, 1, nq, nk] indices, the listed tiles first in ascending order.
        order = torch.argsort((~tiles).to(torch.int8), dim=-1, stable=True)
        return tiles.sum(-1, dtype=torch.int32)[None, None], order.to(torch.int32)[None, None]

    def lower_right(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx + offset

    return BlockMask.from_kv_blocks(*sparse(partial), *sparse(full), BLOCK_SIZE=FLEX_BLOCK, mask_mod=lower_right,
                                    seq_lengths=(q_len, k_len))


def attend_prefix(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None,
                  memory_probe: bool = False) -> torch.Tensor:
    """Causal attention of the last q.shape[2] positions of a prefix over all k.shape[2]
    keys of it (mask aligned to the lower right). GQA: k/v may have fewer heads. As in
    `SDPA`, a narrower v (MLA) is zero-padded to the q/k head dim for the fused kernels.

    `memory_probe` (the memory estimator, on fake tensors only): a top-left causal call
    instead, which keeps for backward exactly what CUDA's mask-free lower-right kernel
    keeps (q, k, v, out, logsumexp), without the CPU mask; its values are not used.

    Under torch.compile on CUDA: flex attention with a lower-right BlockMask, traced into the
    block's graph (GQA and Dv != Dqk natively, no padding, no [q, k] mask). SDPA with a bool
    mask would fall back to the math kernel there (flash refuses masks, the efficient kernel
    GQA), which materialises [q, k] scores: an OOM at 128k."""
    if torch.compiler.is_compiling() and not memory_probe and flex_under_compile(q.device):
        from torch.nn.attention.flex_attention import flex_attention

        block_mask = lower_right_block_mask(q.shape[2], k.shape[2], q.device)
        return flex_attention(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    pad = q.shape[-1] - v.shape[-1]
    if pad > 0:
        v = F.pad(v, (0, pad))
    gqa = q.shape[1] != k.shape[1]
    if memory_probe:
        from torch._subclasses.fake_tensor import FakeTensor

        if not isinstance(q, FakeTensor):
            raise RuntimeError("memory_probe attention gives wrong values: use it on fake tensors only")
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
    else:
        mask = lower_right_mask(q.shape[2], k.shape[2], q.dtype, q.device)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
    return out[..., : out.shape[-1] - pad] if pad > 0 else out


class ContextParallelAttention(nn.Module):
    """`sdpa(q, k, v)` over a CP-sharded sequence; see the module docstring.

    With allgather, k and v may arrive already gathered (k.shape[2] == cp * q.shape[2]):
    MLA's latent was gathered by `SequenceGather` at `attention.kv_latent`.
    `memory_probe` is set by the memory estimator only, on the model it assembles on fake
    tensors (`trainer.memory.probes.use_memory_probes`; see `attend_prefix`)."""

    memory_probe = False

    def __init__(self, inner: nn.Module, cp_mesh, method: str):
        super().__init__()
        if method not in CP_METHODS:
            raise ValueError(f"context parallel method {method!r} is not one of {CP_METHODS}")
        self.inner = inner
        self.method = method
        self.cp = cp_mesh.size()
        self.rank = cp_mesh.get_local_rank()
        self.group_name = cp_mesh.get_group().group_name

    @property
    def scale(self) -> float | None:
        return getattr(self.inner, "scale", None)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask=None) -> torch.Tensor:
        if mask is not None:  # the config refuses data.document_masking with CP; reaching here is a bug
            raise NotImplementedError("context parallel attention takes no document mask")
        if self.method == "alltoall":
            return self._alltoall(q, k, v)
        if k.shape[2] == q.shape[2]:
            dk = k.shape[-1]
            # One buffer for K and V: [B, Hkv, S_local, Dk + Dv] -> [B, Hkv, S, Dk + Dv], sequence order.
            kv = gather_sequence(torch.cat([k, v], dim=-1), self.group_name, self.cp, dim=2)
            k, v = kv.split([dk, kv.shape[-1] - dk], dim=-1)
        elif k.shape[2] != self.cp * q.shape[2]:
            raise ValueError(f"CP attention: {k.shape[2]} keys for {q.shape[2]} local queries at cp {self.cp}")
        return self.attend_gathered(q, k, v)

    def attend_gathered(self, q, k, v):
        """Each of the rank's two query chunks [B, Hq, c, D] against its key prefix of the
        gathered k, v [B, Hkv, S, D(v)]."""
        c = q.shape[2] // 2
        outs = []
        for slot, chunk in enumerate(rank_chunks(self.cp, self.rank)):
            end = (chunk + 1) * c
            q_chunk = q[:, :, slot * c:(slot + 1) * c]
            if end == c:  # the first chunk: plain causal, the model's own kernel
                outs.append(self.inner(q_chunk, k[:, :, :end], v[:, :, :end]))
            else:
                outs.append(attend_prefix(q_chunk, k[:, :, :end], v[:, :, :end], self.scale, self.memory_probe))
        return torch.cat(outs, dim=2)

    # ---- alltoall (Ulysses) ----
    def _alltoall(self, q, k, v):
        cp = self.cp
        repeat = kv_repeat_for_alltoall(q.shape[1], k.shape[1], cp)
        if repeat is None:
            raise ValueError(f"alltoall CP: {q.shape[1]} q heads / {k.shape[1]} KV heads cannot be split over {cp}")
        if repeat > 1:  # keeps the GQA grouping: q head h still reads KV head h // (Hq / Hkv)
            k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        q, k, v = self._seq_to_heads([q, k, v])
        return self._heads_to_seq(self.inner(q, k, v))

    def _seq_to_heads(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """[B, H, S_local, D] each -> [B, H / cp, S, D] each (sequence order), one all-to-all."""
        cp = self.cp
        # [B, H, S_local, D] -> [cp (destination head group), B * H / cp * S_local * D]
        packed = [t.reshape(t.shape[0], cp, t.shape[1] // cp, *t.shape[2:]).movedim(1, 0).reshape(cp, -1)
                  for t in tensors]
        received = cp_all_to_all(torch.cat(packed, dim=1), self.group_name, cp)
        outs = []
        for t, part in zip(tensors, received.split([p.shape[1] for p in packed], dim=1)):
            b, h, s, d = t.shape
            # [cp (source rank), B, H / cp, S_local, D] -> [B, H / cp, cp * S_local, D], rank order
            full = part.reshape(cp, b, h // cp, s, d).movedim(0, 2).reshape(b, h // cp, cp * s, d)
            outs.append(reorder_chunks(full, natural_order(cp), dim=2))
        return outs

    def _heads_to_seq(self, out: torch.Tensor) -> torch.Tensor:
        """[B, H / cp, S, Dv] (sequence order) -> [B, H, S_local, Dv]."""
        cp = self.cp
        b, h, s, d = out.shape
        # [B, H / cp, S, Dv] -> [cp (destination rank), B, H / cp, S_local, Dv]
        send = reorder_chunks(out, rank_order(cp), dim=2).reshape(b, h, cp, s // cp, d).movedim(2, 0)
        received = cp_all_to_all(send.contiguous(), self.group_name, cp)
        # [cp (source head group), B, H / cp, S_local, Dv] -> [B, H, S_local, Dv]
        return received.movedim(0, 1).reshape(b, cp * h, s // cp, d)


# ---------------------------------------------------------------------------
# Plan and batch
# ---------------------------------------------------------------------------

class _PositionsHook:
    """Forward pre-hook of a model part: positions of this rank's tokens for RoPE."""

    def __init__(self, cp: int, rank: int):
        self.cp, self.rank = cp, rank
        self._cache: dict = {}

    def __call__(self, module, args, kwargs):
        if kwargs.get("positions") is not None or not args:
            return args, kwargs
        x = args[0]
        key = (x.shape[1], x.device)
        if key not in self._cache:
            self._cache[key] = local_positions(x.shape[1] * self.cp, self.cp, self.rank, device=x.device)
        return args, {**kwargs, "positions": self._cache[key]}


class SequenceGather(nn.Module):
    """[B, S_local, ...] -> [B, S, ...] in sequence order over the CP group; backward
    reduce-scatters. Installed at MLA's `kv_latent` hook point (allgather method)."""

    def __init__(self, cp_mesh):
        super().__init__()
        self.cp = cp_mesh.size()
        self.group_name = cp_mesh.get_group().group_name

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gather_sequence(x, self.group_name, self.cp, dim=1)


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, new)


def _swap_attention(model: nn.Module, cp_mesh, method: str) -> list[str]:
    from models.common.attention import SDPA

    replaced = []
    for name, module in list(model.named_modules()):
        if isinstance(module, SDPA):
            _replace(model, name, ContextParallelAttention(module, cp_mesh, method))
        elif name.endswith("attention.kv_latent") and method == "allgather":
            _replace(model, name, SequenceGather(cp_mesh))
        else:
            continue
        replaced.append(name)
    return replaced


def apply_context_parallel(model: nn.Module, cp_mesh, method: str) -> list[str]:
    """Swaps every attention core (`SDPA`) of `model` (one model part) for its CP version
    and installs the positions hook; with allgather, MLA's `kv_latent` hook points
    become `SequenceGather`. MoE layers sum their balance-loss pick counts over CP (each
    rank holds a slice of every sequence; parallelisms/sequence_shards.py). Returns the
    module names replaced."""
    from parallelisms.sequence_shards import add_sequence_shard_mesh

    replaced = _swap_attention(model, cp_mesh, method)
    add_sequence_shard_mesh(model, cp_mesh)
    model.register_forward_pre_hook(_PositionsHook(cp_mesh.size(), cp_mesh.get_local_rank()), with_kwargs=True)
    return replaced


def cpu_mask_bytes(seq_len: int, cp: int, method: str, esize: int) -> int:
    """The additive masks a CPU run keeps (once per rank, shared by every layer) under
    allgather: c x (j + 1) c for each of the worst rank's chunks j except chunk 0."""
    if cp <= 1 or method != "allgather":
        return 0
    c = seq_len // (2 * cp)
    return c * c * (2 * cp + 1) * esize


def shard_microbatch(inputs: torch.Tensor, labels: torch.Tensor, cp_mesh) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, S] inputs and labels -> this CP rank's [B, S / cp] (the same two chunks of each)."""
    cp, rank = cp_mesh.size(), cp_mesh.get_local_rank()
    return shard_sequence(inputs, cp, rank), shard_sequence(labels, cp, rank)
