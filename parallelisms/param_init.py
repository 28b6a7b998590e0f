"""Layout-independent weight init: any parallel layout from one seed gives one process's weights.

A model's `init_weights` draws from the global RNG in module order. Under FSDP, TP or
PP that cannot reproduce one process: each rank holds other pieces of the tensors (and
pipeline stages hold other blocks), and CPU DTensors have no offset-based RNG that
would let a shard draw exactly its part of the full tensor's random stream.

So every parameter gets its own stream instead, seeded from (seed, its name), and a
random op on it draws the *full* tensor from that stream and keeps the slice this rank
owns. `layout_independent_init(parts, seed)` runs each part's `init_weights` under a
dispatch mode that does this for every random in-place op (`uniform_`, `normal_`, ...)
on a parameter; everything else (ones, zeros, the arithmetic of `trunc_normal_`) runs
as usual on the local shard. Names are the model's own (wrapper prefixes dropped), so
1 rank, FSDP, TP, PP and their products all produce the same values.

The cost: each rank generates every parameter of its parts at full size, one at a
time (peak: the largest tensor, e.g. the embedding). On a GPU that is a few seconds
for 8B; one process pays the same.
"""

from __future__ import annotations

import hashlib

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.utils._python_dispatch import TorchDispatchMode

# In-place random ops that fill a tensor (every overload); their first argument is the tensor.
_RANDOM_OPS = {getattr(torch.ops.aten, name) for name in
               ("uniform_", "normal_", "bernoulli_", "exponential_", "geometric_", "log_normal_", "cauchy_", "random_")}
_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")


def canonical_name(name: str) -> str:
    """A parameter name without AC / compile / FSDP wrapper components."""
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def _stream_seed(seed: int, name: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little") & (2**63 - 1)


class _PerParameterRNG(TorchDispatchMode):
    def __init__(self, names: dict[int, str], seed: int):
        super().__init__()
        self.names = names  # id(parameter) -> canonical name
        self.seed = seed
        self.generators: dict[str, torch.Generator] = {}

    def _generator(self, name: str, device: torch.device) -> torch.Generator:
        gen = self.generators.get(name)
        if gen is None:
            gen = torch.Generator(device=device).manual_seed(_stream_seed(self.seed, name))
            self.generators[name] = gen
        return gen

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        target = args[0] if args else None
        name = self.names.get(id(target)) if func.overloadpacket in _RANDOM_OPS else None
        if name is None:
            return func(*args, **kwargs)
        local = target.to_local() if isinstance(target, DTensor) else target
        full = torch.empty(target.shape, dtype=target.dtype, device=local.device)
        func(full, *args[1:], **{**kwargs, "generator": self._generator(name, local.device)})
        if isinstance(target, DTensor):
            # Each rank slices its own shard of the full tensor: no communication.
            full = distribute_tensor(full, target.device_mesh, target.placements, src_data_rank=None).to_local()
        local.copy_(full)
        return target


@torch.no_grad()
def layout_independent_init(parts: list[nn.Module], seed: int, buffer_device: torch.device) -> None:
    """Runs `part.init_weights(buffer_device=...)` on every (materialised) part with one
    random stream per parameter name, so the result does not depend on the layout."""
    for part in parts:
        names = {id(p): canonical_name(n) for n, p in part.named_parameters()}
        with _PerParameterRNG(names, seed):
            part.init_weights(buffer_device=buffer_device)
