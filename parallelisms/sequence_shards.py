"""Sequence-shard reduction of the MoE balance loss's pick counts.

DeepSeek V3's sequence-wise balance loss needs, per sequence, how many of its tokens
picked each expert (f_i) and the mean score of each expert over the sequence (P_i).
Context parallelism (each CP rank holds S / cp tokens of every sequence) and sequence
parallel TP (each TP rank a further 1 / tp of those) leave a rank with only a slice of
each sequence. The plans of those parallelisms install a `SequenceShardCounts` on every
MoE layer (`MoE.aux_loss_count_reduce`): it sums the [B, E] pick counts over their
meshes, so f_i is the whole sequence's, and tells the layer how many slices there are,
so that P_i becomes this rank's partial sum over the whole length. Summed over the
slices (as FSDP sums the router's gradient over dp_shard x cp, and DTensor over TP) the
loss and its gradient are those of whole sequences on one rank. The model keeps only
the seam; it knows nothing of meshes.
"""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol
import torch.nn as nn


class SequenceShardCounts:
    """counts [B, E] -> (counts summed over every mesh holding other slices of the same
    sequences, number of slices). Called by `MoE.forward` (no gradient flows through counts).

    `batch_meshes` (the data-parallel mesh, only for a batch-scope loss, whose one "sequence"
    is every token of the batch): their ranks hold other sequences of the same global batch,
    so they are slices too, and `batch_slices` tells the layer how many times more sequences
    the union holds than this rank's forward. A batch mesh may also be any object with `size()`
    and `all_reduce_sum(counts) -> counts`: torchft replica groups, which are no mesh
    (trainer/fault_tolerance/replicas.py)."""

    def __init__(self) -> None:
        self.meshes: list = []
        self.batch_meshes: list = []

    @property
    def slices(self) -> int:
        n = 1
        for mesh in self.meshes + self.batch_meshes:
            n *= mesh.size()
        return n

    @property
    def batch_slices(self) -> int:
        n = 1
        for mesh in self.batch_meshes:
            n *= mesh.size()
        return n

    def __call__(self, counts: torch.Tensor) -> tuple[torch.Tensor, int]:
        for mesh in self.meshes + self.batch_meshes:  # one [B, E] all-reduce per mesh: cp, tp, then dp
            counts = mesh.all_reduce_sum(counts) if hasattr(mesh, "all_reduce_sum") else \
                funcol.all_reduce(counts, "sum", mesh)
        return counts, self.slices


def add_sequence_shard_mesh(model: nn.Module, mesh) -> int:
    """Every MoE layer of `model` (one model part) sums its balance-loss counts over `mesh`
    too (a CP mesh, or the TP mesh under sequence parallel). Returns the layers touched."""
    from models.common.moe import MoE

    touched = 0
    for module in model.modules():
        if isinstance(module, MoE):
            if module.aux_loss_count_reduce is None:
                module.aux_loss_count_reduce = SequenceShardCounts()
            module.aux_loss_count_reduce.meshes.append(mesh)
            touched += 1
    return touched


def add_batch_shard_mesh(model: nn.Module, dp_mesh) -> int:
    """Every MoE layer of `model` whose balance loss is batch- or model-scope (Qwen3's) sums its pick
    counts over the data-parallel mesh too, so f_i is that of the whole batch the data ranks
    route together in one forward, as on one rank. Sequence-scope layers are left
    alone (their sequences are whole on each data rank). Returns the layers touched."""
    from models.common.moe import MoE

    touched = 0
    for module in model.modules():
        if isinstance(module, MoE) and module.args.aux_loss_scope in ("batch", "model") \
                and module.args.aux_loss_coeff > 0:
            if module.aux_loss_count_reduce is None:
                module.aux_loss_count_reduce = SequenceShardCounts()
            module.aux_loss_count_reduce.batch_meshes.append(dp_mesh)
            touched += 1
    return touched
