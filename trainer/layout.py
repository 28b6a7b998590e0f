"""A config's parallel layout and batch shape on a world size.

Shared by the pre-launch check (`trainer/preflight.py`), the Trainer and the planner, and so
kept apart from all three: each asks the same questions (which degrees, how many accumulation
steps) and gets the same one-line answer for a layout that cannot work.
"""

from __future__ import annotations

import math

from configuration.fields import ConfigError


def implied_world_size(p) -> int:
    """The smallest world a [parallelism] section fits: dp_shard -1 becomes the fewest data
    ranks that let expert parallelism borrow ep ranks from dp_shard x tp."""
    tp, ep = p.tensor_parallel_degree, p.expert_parallel_degree
    dp_shard = p.data_parallel_shard_degree if p.data_parallel_shard_degree != -1 else ep // math.gcd(ep, tp)
    return p.data_parallel_replicate_degree * dp_shard * p.context_parallel_degree * tp * p.pipeline_parallel_degree


def batch_layout(training, dp_degree: int) -> tuple[int, int]:
    """(gradient-accumulation steps, global batch) for a data-parallel degree; the one check of
    training.global_batch_size, run by the pre-launch check and by the Trainer."""
    per_step = training.local_batch_size * dp_degree
    global_bs = training.global_batch_size if training.global_batch_size > 0 else per_step
    if global_bs % per_step != 0:
        raise ConfigError(
            f"config error: training.global_batch_size: {global_bs} is not a multiple of local_batch_size "
            f"({training.local_batch_size}) x data-parallel degree ({dp_degree}) = {per_step}; use a multiple")
    return global_bs // per_step, global_bs


def layout_for(cfg, world_size: int):
    """The layout of a validated config on `world_size` ranks (degrees and batch); the ParallelDims."""
    from parallelisms.parallel_dims import ParallelDims

    dims = ParallelDims.from_config(cfg.parallelism, world_size)
    batch_layout(cfg.training, dims.dp_degree)
    return dims


def describe_layout(dims, source: str) -> str:
    parts = [f"{name} {getattr(dims, attr)}" for name, attr in
             (("pp", "pp"), ("dp_replicate", "dp_replicate"), ("dp_shard", "dp_shard"), ("cp", "cp"), ("tp", "tp"))]
    text = f"layout: world size {dims.world_size} ({source}) = " + " x ".join(parts)
    if dims.ep > 1:
        text += f"; ep {dims.ep} borrowed from dp_shard x tp, experts FSDP-sharded over {dims.expert_fsdp_degree}"
    return text
