"""Exact counters of what activation checkpointing costs: bytes kept for backward, FLOPs.

Why a module of its own: only benches, tests and the memory estimator count; the
training path never imports this file (the policies report what the SAC cache keeps
through `ac_sac.SAC_CACHE_LISTENERS`, which a counter here joins while it is active).

- `SavedActivationCounter`: a context manager counting the activation bytes kept for
  backward, including what the op-level SAC cache holds (an outer saved-tensors hook
  cannot see that);
- `saved_activation_bytes(block, *inputs, mode=..., ...)`: one block's exact count
  under a mode, run as `apply_activation_checkpointing` would wrap it; works on real
  tensors, under `FakeTensorMode` and on the meta device;
- `flop_counter()`: `FlopCounterMode` that also counts CPU flash attention (forward and
  backward) and MoE grouped GEMMs (`cpu_attention_flop_mapping`, `extra_flop_mapping`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn as nn

from parallelisms.ac_ops import cpu_attention_flop_mapping, extra_flop_mapping
from parallelisms.ac_sac import SAC_CACHE_LISTENERS, plain_tensors
from parallelisms.activation_checkpoint import ActivationCheckpointConfig, policy_for, unwrap_block


def _storage_key(t: torch.Tensor):
    from torch.multiprocessing.reductions import StorageWeakRef
    return StorageWeakRef(t.untyped_storage())


def _is_parameter(t: torch.Tensor) -> bool:
    return isinstance(t, nn.Parameter) or isinstance(getattr(t, "_base", None), nn.Parameter)


class SavedActivationCounter:
    """Context manager counting the activation bytes kept for backward.

    Two sources are counted, deduplicated by storage:

    - `autograd`: tensors autograd saves outside checkpointed regions, seen through an
      outer `torch.autograd.graph.saved_tensors_hooks` (for a checkpointed block this is
      only the block's inputs, which the checkpoint keeps to re-run it);
    - `sac_cache`: outputs that the op-level policy keeps in the SAC cache, reported by
      the policy (`ctx.op_output` on torch 2.13). An outer hook cannot see these.

    Not counted: parameters and views of parameters (also FSDP's unsharded ones), any
    tensor sharing storage with a tensor in `exclude` (pass the model's parameters and
    buffers, and constant inputs such as RoPE tables). The byte count of a tensor is the
    size of its whole storage, since a saved view keeps all of it alive.
    Works with real tensors, FakeTensorMode and the meta device (only storage sizes are read).
    """

    def __init__(self, exclude: Iterable[torch.Tensor] = ()):
        self._exclude = {_storage_key(p) for t in exclude for p in plain_tensors(t)}
        self._seen: set = set()
        self.bytes_by_source = {"autograd": 0, "sac_cache": 0}
        self.num_tensors = 0
        self._hooks = None

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes_by_source.values())

    def add(self, obj: Any, source: str) -> None:
        if isinstance(obj, (list, tuple)):
            for o in obj:
                self.add(o, source)
            return
        if not isinstance(obj, torch.Tensor) or _is_parameter(obj):
            return
        for t in plain_tensors(obj):
            if _is_parameter(t):
                continue
            try:
                key = _storage_key(t)
                nbytes = t.untyped_storage().nbytes()
            except Exception:  # noqa: BLE001 - storage-less tensors: count the tensor itself
                key, nbytes = ("id", id(t)), t.numel() * t.element_size()
            if key in self._exclude or key in self._seen:
                continue
            self._seen.add(key)
            self.bytes_by_source[source] += int(nbytes)
            self.num_tensors += 1

    def _pack(self, t):
        self.add(t, "autograd")
        return t

    def __enter__(self) -> SavedActivationCounter:
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        SAC_CACHE_LISTENERS.append(self)
        return self

    def __exit__(self, *exc) -> None:
        SAC_CACHE_LISTENERS.remove(self)
        self._hooks.__exit__(*exc)
        self._hooks = None


def saved_activation_bytes(block: nn.Module, *inputs: Any, mode: str = "op",
                           cfg: ActivationCheckpointConfig | None = None, spec=None,
                           extra_save_ops: Iterable = (), force_recompute_fqns: Iterable[str] = (),
                           layer_id: int = 0, breakdown: bool = False, **kwargs: Any):
    """Exact activation bytes one block keeps for backward under `mode`.

    Runs `block(*inputs, **kwargs)` once (forward only, under grad mode) exactly as
    `apply_activation_checkpointing` would wrap it (same policy, from `cfg`, `spec`,
    `extra_save_ops` and `force_recompute_fqns`), without modifying `block`, and counts
    with `SavedActivationCounter`: autograd-saved tensors outside the checkpoint (for
    `full`/`op`: the block inputs) plus the SAC cache (for `op`).

    - mode: none | full | op | budget (measured by one call first, as in training) |
      selective (then `layer_id` decides whether this block is checkpointed, as in the
      trainer) | memory_budget (raises: the compile partitioner decides, there is no eager
      equivalent) | True/False.
    - cfg: supplies `selective_layer_interval` and `force_recompute_mm_fqns`.
    - Pass hidden-state inputs with `requires_grad=True`, as in training. Inputs that do
      not require grad (RoPE tables, masks) are treated as constants owned by the caller
      and not counted; nor are the block's parameters and buffers.
    - Works on real tensors, under `FakeTensorMode` (build the block and inputs under it)
      and on the meta device; nothing is allocated for real in the latter two.

    Returns an int, or `(total, {"autograd": .., "sac_cache": ..})` with `breakdown=True`.
    """
    from torch.utils.checkpoint import checkpoint
    cfg = dataclasses.replace(cfg or ActivationCheckpointConfig(), mode=mode)
    policy = policy_for(cfg, spec=spec, extra_save_ops=extra_save_ops, force_recompute_fqns=force_recompute_fqns)
    kind = policy.block_mode(layer_id)
    if kind == "memory_budget":
        raise ValueError("saved_activation_bytes: memory_budget is decided by the compile partitioner; "
                         "there is no eager count")
    block = unwrap_block(block)
    exclude = list(block.parameters()) + list(block.buffers())
    exclude += [t for t in inputs if isinstance(t, torch.Tensor) and not t.requires_grad]
    ckpt = None if kind == "none" else {**policy.checkpoint_kwargs(block, prefix=f"layers.{layer_id}"),
                                        "preserve_rng_state": False}
    try:
        if ckpt is not None and not policy.calibrated(block, f"layers.{layer_id}"):
            with torch.enable_grad():  # a policy that records the block first (op's recompute plan, budget)
                checkpoint(block, *inputs, use_reentrant=False, **ckpt, **kwargs)
        with torch.enable_grad(), SavedActivationCounter(exclude) as counter:
            if ckpt is None:
                block(*inputs, **kwargs)
            else:
                checkpoint(block, *inputs, use_reentrant=False, **ckpt, **kwargs)
    finally:
        if ckpt is not None:
            policy.release(ckpt)
    if breakdown:
        return counter.total_bytes, dict(counter.bytes_by_source)
    return counter.total_bytes


def flop_counter(**kwargs) -> torch.utils.flop_counter.FlopCounterMode:
    """FlopCounterMode(display=False) that also counts CPU flash attention and grouped GEMMs."""
    from torch.utils.flop_counter import FlopCounterMode
    kwargs.setdefault("display", False)
    mapping = {**extra_flop_mapping(), **kwargs.pop("custom_mapping", {})}
    return FlopCounterMode(custom_mapping=mapping, **kwargs)


__all__ = ["SavedActivationCounter", "cpu_attention_flop_mapping", "extra_flop_mapping", "flop_counter",
           "saved_activation_bytes"]
