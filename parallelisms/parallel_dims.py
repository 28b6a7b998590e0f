"""Parallel degrees -> one world device mesh with named sub-meshes."""

from __future__ import annotations

from dataclasses import dataclass

from trainer.configurable import opt

PP_SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")


@dataclass
class ParallelismConfig:
    """[parallelism]: how the world is split. Degrees multiply to the world size."""

    data_parallel_replicate_degree: int = opt(1, "HSDP replicas (DDP-style replication of FSDP groups).", min=1)
    data_parallel_shard_degree: int = opt(-1, "FSDP shard degree; -1 means whatever the other degrees leave.", min=-1)
    tensor_parallel_degree: int = opt(1, "Tensor parallel degree (must divide heads and KV heads).", min=1)
    pipeline_parallel_degree: int = opt(1, "Pipeline parallel degree (stages over ranks).", min=1)
    context_parallel_degree: int = opt(1, "Context parallel degree (validated; only 1 is implemented).", min=1)
    expert_parallel_degree: int = opt(1, "Expert parallel degree for MoE models; ranks are borrowed from dp_shard x tp.", min=1)
    enable_sequence_parallel: bool = opt(True, "With TP, shard norms and residuals over the sequence.")
    disable_loss_parallel: bool = opt(False, "With TP, gather logits instead of computing the loss on vocab shards.")
    fsdp_reshard_after_forward: str = opt(
        "default", "Free gathered params after forward: default (yes, except the last module / PP), always, never.",
        choices=("default", "always", "never"))
    fsdp_cpu_offload: bool = opt(False, "Keep sharded params, grads and optimizer state on CPU (FSDP2 CPUOffloadPolicy).")
    pipeline_parallel_schedule: str = opt("1F1B", "Pipeline schedule by name.", choices=PP_SCHEDULES)
    pipeline_parallel_microbatch_size: int = opt(1, "Samples per pipeline microbatch; local_batch_size must be a multiple.", min=1)
    pipeline_parallel_stages_per_rank: int = opt(1, "Model stages per PP rank (>1 for interleaved and V schedules).", min=1)
    module_fqns_per_model_part: list[list[str]] | None = opt(
        None, "Override of the PP split: module names per stage, e.g. [[\"tok_embeddings\", \"layers.0\"], ...].")
