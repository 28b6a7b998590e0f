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
    # A head tied to the embedding (one parameter: Qwen3-0.6B, 1.7B, 4B) must be in one FSDP unit
    # with it; both are left to the root unit, which stays gathered from the embedding to the head.
    embedding, head = getattr(model, "tok_embeddings", None), getattr(model, "output", None)
    tied = embedding is not None and head is not None and head.weight is embedding.weight
    if embedding is not None and not tied:
        fully_shard(model.tok_embeddings, reshard_after_forward=reshard, **kwargs)
    # Expert parallelism (parallelisms/expert_parallel.py) marks routed-expert modules with
    # `_expert_fsdp_mesh`: they are sharded first, over the ranks that share their EP shard
    # (dp_shard x cp x tp / ep), or, when there are none, left out of FSDP altogether.
    ignored: set = set()
    # Blocks do not cast their inputs to the param dtype: the residual stream already is bf16
    # (the embedding computes in it), and the other input, the fp32 RoPE table, must stay
    # fp32 (FSDP would cast every floating-point input; TorchTitan's complex table escapes that).
    block_kwargs = {**kwargs, "mp_policy": MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype,
                                                                cast_forward_inputs=False)}
    # A model's extra modules that hold a block each (DeepSeek's MTP layers) are sharded like blocks
    # (with FSDP's input cast: they also take the embedding of other tokens and the final hidden).
    mtp = getattr(model, "mtp", None)
    blocks = [(b, block_kwargs) for b in model.layers.values()] + [(b, kwargs) for b in (mtp.values() if mtp else ())]
    for block, unit_kwargs in blocks:
        for sub in block.modules():
            if not hasattr(sub, "_expert_fsdp_mesh"):
                continue
            if sub._expert_fsdp_mesh is not None:
                fully_shard(sub, reshard_after_forward=reshard, **{**kwargs, "mesh": sub._expert_fsdp_mesh})
            else:
                ignored |= set(sub.parameters())
        fully_shard(block, reshard_after_forward=reshard, **unit_kwargs,
                    **({"ignored_params": ignored} if ignored else {}))
    tail = [m for m in (getattr(model, "norm", None), head) if m is not None]
    if tail and not tied:
        # The head runs last in forward and first in backward: resharding it would be wasted work.
        fully_shard(tail, reshard_after_forward=reshard_after_forward == "always", **kwargs)
    fully_shard(model, reshard_after_forward=reshard, **kwargs, **({"ignored_params": ignored} if ignored else {}))
    if any(hasattr(sub, "_expert_fsdp_mesh") for sub in model.modules()):
        set_explicit_prefetch(model)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            if backend == "gloo":
                module.set_force_sum_reduction_for_comms(True)


def set_explicit_prefetch(model: nn.Module) -> None:
    """FSDP2 overlaps the next unit's all-gather with compute because the CPU runs ahead of
    the GPU and issues it early. Under EP every MoE layer copies its split sizes to the
    host (`.tolist()`), so the CPU waits there and the next all-gather starts late. Explicit
    prefetch issues it from the current unit's hook instead: forward, each unit gathers the
    next one (a MoE block together with its separately sharded experts); backward, the
    previous one (TorchTitan does the same under EP)."""
    units: list[list[nn.Module]] = []
    if isinstance(getattr(model, "tok_embeddings", None), FSDPModule):
        units.append([model.tok_embeddings])
    for block in model.layers.values():
        experts = [sub for sub in block.modules() if sub is not block and isinstance(sub, FSDPModule)]
        units.append([block, *experts])
    tail = [m for m in (getattr(model, "norm", None), getattr(model, "output", None)) if isinstance(m, FSDPModule)]
    if tail:
        units.append(tail[:1])  # norm and output are one FSDP unit: its first module stands for it
    for current, following in zip(units, units[1:]):
        current[0].set_modules_to_forward_prefetch(following)
        following[0].set_modules_to_backward_prefetch(current)
