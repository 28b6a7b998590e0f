"""FSDP2 (and HSDP) wrapping: each block, the embedding, and norm + output together.

The loss is already divided by the global number of valid tokens, so gradients
must be *summed* over data-parallel ranks, not averaged: we set the gradient
divide factor to 1. On gloo that would reduce-scatter with PREMUL_SUM, which gloo
lacks, so we force plain SUM there (`set_force_sum_reduction_for_comms`).
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard


def apply_fsdp(model: nn.Module, mesh, *, param_dtype: torch.dtype, reduce_dtype: torch.dtype,
               reshard_after_forward: str = "default", pp_enabled: bool = False, cpu_offload: bool = False,
               backend: str = "nccl") -> None:
    """Shards `model` (one model part) over `mesh` (1-D FSDP, or 2-D replicate x shard for HSDP)."""
    kwargs = {"mesh": mesh, "mp_policy": MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)}
    if cpu_offload:
        # Pinned host memory needs an accelerator; on a CPU-only run the policy just keeps
        # everything where it already is.
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
    # With PP the same params run forward once per microbatch; keeping them gathered
    # avoids an all-gather per microbatch, so "default" means no reshard under PP.
    reshard = {"always": True, "never": False, "default": not pp_enabled}[reshard_after_forward]
    if getattr(model, "tok_embeddings", None) is not None:
        fully_shard(model.tok_embeddings, reshard_after_forward=reshard, **kwargs)
    # Expert parallelism (parallelisms/expert_parallel.py) marks routed-expert modules with
    # `_expert_fsdp_mesh`: they are sharded first, over the ranks that share their EP shard
    # (dp_shard x cp x tp / ep), or, when there are none, left out of FSDP altogether.
    ignored: set = set()
    # A model's extra modules that hold a block each (DeepSeek's MTP layers) are sharded like blocks.
    mtp = getattr(model, "mtp", None)
    for block in [*model.layers.values(), *(mtp.values() if mtp is not None else ())]:
        for sub in block.modules():
            if not hasattr(sub, "_expert_fsdp_mesh"):
                continue
            if sub._expert_fsdp_mesh is not None:
                fully_shard(sub, reshard_after_forward=reshard, **{**kwargs, "mesh": sub._expert_fsdp_mesh})
            else:
                ignored |= set(sub.parameters())
        fully_shard(block, reshard_after_forward=reshard, **kwargs, **({"ignored_params": ignored} if ignored else {}))
    tail = [m for m in (getattr(model, "norm", None), getattr(model, "output", None)) if m is not None]
    if tail:
        # The head runs last in forward and first in backward: resharding it would be wasted work.
        fully_shard(tail, reshard_after_forward=reshard_after_forward == "always", **kwargs)
    fully_shard(model, reshard_after_forward=reshard, **kwargs, **({"ignored_params": ignored} if ignored else {}))
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            if backend == "gloo":
                module.set_force_sum_reduction_for_comms(True)
