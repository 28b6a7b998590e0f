"""What a GPU spends beyond PyTorch's tensors: the terms the estimate adds on CUDA only.

The tensor estimate (trainer/memory/estimate.py) counts what the caching allocator hands
out; the CPU validation checks exactly that. A GPU's memory also holds the CUDA context,
NCCL's communicator buffers and the allocator's unusable slack, and under EP the busiest
rank receives more routed rows than the balanced mean (measured by probing the MoE blocks
again with `ep_imbalance` x the rows: `BalancedDispatch.receive_factor`). These terms are
reported separately (`MemoryEstimate.device_terms`, `device_total`), from one table
(`GpuOverheads`) that a planner can import and override. docs/memory.md gives the sources.
"""

from __future__ import annotations

from dataclasses import dataclass

MiB = 1024**2


@dataclass(frozen=True)
class GpuOverheads:
    """Per-rank device memory outside the tensors (defaults: H100/H200, CUDA 12, NCCL 2.2x)."""

    # The CUDA context, cuBLAS/cuBLASLt workspaces and the loaded kernels of one process
    # (lazy module loading): ~0.5-0.7 GiB in nvidia-smi before the first tensor.
    cuda_context_mib: float = 640.0
    # NCCL's buffers per communicator this rank is in (size > 1): NCCL_BUFFSIZE (4 MiB) per
    # channel and peer direction over the ring/tree channels, plus proxy and work FIFOs.
    # NVLS (NVLink SHARP, NCCL_NVLS_ENABLE) adds ~1 GiB per intra-node communicator.
    nccl_mib_per_communicator: float = 288.0
    # The caching allocator's slack: reserved minus allocated at the peak (block rounding,
    # segments split by differently-sized requests). ~5-10% without expandable segments.
    fragmentation: float = 0.08
    # Under EP the busiest rank receives this times the mean routed rows per MoE layer
    # (early in training routing is skewed: 1.5-3x is common before load balancing acts).
    ep_imbalance: float = 2.0


def nccl_communicators() -> int:
    """The NCCL communicators this rank would create: every process group of the current
    (fake) world it belongs to with more than one rank (mesh dims and their flattened views)."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _rank_not_in_group, _world

    return sum(1 for pg in list(_world.pg_map) if not _rank_not_in_group(pg) and dist.get_world_size(pg) > 1)


def gpu_overhead_terms(tensor_peak: int, *, communicators: int, ep_extra: int,
                       overheads: GpuOverheads = GpuOverheads()) -> dict[str, int]:
    """The device terms on top of `tensor_peak` (the estimate's allocated peak), in bytes."""
    terms = {
        "CUDA context": int(overheads.cuda_context_mib * MiB),
        f"NCCL buffers ({communicators} communicators)": int(communicators * overheads.nccl_mib_per_communicator * MiB),
    }
    if ep_extra:
        terms[f"EP load imbalance ({overheads.ep_imbalance:g}x mean rows)"] = ep_extra
    terms[f"allocator fragmentation ({overheads.fragmentation:.0%})"] = int(
        overheads.fragmentation * (tensor_peak + ep_extra))
    return terms
