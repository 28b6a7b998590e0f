"""Tensor parallel (TP) building blocks: sequence parallel (SP), stage boundaries, loss parallel.

A model's TP plan lives next to the model (e.g. `models/llama3/parallelize.py`) and is
a dict `{module name: ParallelStyle}` applied with `parallelize_module`. The pieces
shared by every decoder-only transformer are here:

- `embedding_style`, `head_style`, `norm_style`, `block_input_style`, `module_input_style`,
  `ReplicateParallel` (TP-replicated params, e.g. norms without SP): the layouts at
  the edges of the residual stream. With SP the residual stream between blocks is a
  DTensor sharded on the sequence (Shard(1)); it stays a DTensor so that the model's
  own `h.shape[1]` (used to slice the RoPE table) is the full sequence length.
- Pipeline stage boundaries: a stage without the embedding receives a plain, full
  (replicated) hidden state from the previous stage, and a stage without the output
  head sends one. So its first block takes `Replicate` input and its last block
  gathers its output (`stage_output_style`). This costs one all-gather over TP per
  stage boundary, and keeps the pipeline's P2P free of DTensors.
- Loss parallel: with vocab-sharded logits (`head_style(..., loss_parallel_on=True)`), the
  trainer's `train_context()` enters `torch.distributed.tensor.parallel.loss_parallel` around
  the whole forward and backward, so cross entropy and its backward run on the shards.
"""

from __future__ import annotations


import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    ParallelStyle,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

__all__ = [
    "ColwiseParallel", "RowwiseParallel", "SequenceParallel", "PrepareModuleInput", "PrepareModuleOutput",
    "parallelize_module", "embedding_style", "head_style", "norm_style", "block_input_style",
    "stage_output_style", "module_input_style", "apply_plan", "ReplicateParallel",
    "norm_style_no_sp", "PrepareModuleInputOutput",
]


# ---- styles at the edges of the residual stream ----
def embedding_style(sequence_parallel: bool):
    """Vocab-sharded embedding (each rank looks up its rows); output sequence-sharded under SP."""
    if sequence_parallel:
        return RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1), use_local_output=False)
    return RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())


def head_style(sequence_parallel: bool, loss_parallel_on: bool):
    """Vocab-sharded output projection. With loss parallel the logits stay a DTensor
    sharded on the vocab (Shard(-1)); without it they are gathered (Replicate)."""
    return ColwiseParallel(input_layouts=Shard(1) if sequence_parallel else Replicate(),
                           output_layouts=Shard(-1) if loss_parallel_on else Replicate(),
                           use_local_output=not loss_parallel_on)


def norm_style():
    """A norm on the sequence-sharded residual stream (SP); its weight is replicated."""
    return SequenceParallel()


class ReplicateParallel(ParallelStyle):
    """Params replicated as DTensors over TP, computed on replicated input; plain tensors out.

    For modules TP does not shard when sequence parallel is off (the norms): every
    parameter of a model part must be a DTensor on the TP mesh, or the foreach optimizer
    and clipping kernels would mix DTensors and plain tensors."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        def partition(name, mod, mesh):
            for pname, param in list(mod.named_parameters(recurse=False)):
                mod.register_parameter(pname, nn.Parameter(distribute_tensor(param, mesh, [Replicate()]),
                                                           requires_grad=param.requires_grad))

        def inputs(mod, args, mesh):
            return tuple(DTensor.from_local(a, mesh, [Replicate()], run_check=False)
                         if isinstance(a, torch.Tensor) and not isinstance(a, DTensor) else a for a in args)

        def outputs(mod, out, mesh):
            return out.to_local() if isinstance(out, DTensor) else out

        return distribute_module(module, device_mesh, partition, inputs, outputs)


def norm_style_no_sp():
    """A norm on the replicated residual stream (TP without SP)."""
    return ReplicateParallel()


def module_input_style(n_extra_args: int = 0):
    """Gathers the sequence-sharded input of an attention / MLP module (SP); extra
    positional args (e.g. the RoPE table) pass through untouched.

    The gathered input stays a Replicate DTensor (as in TorchTitan): the projections that read
    it (wq, wk, wv; w1, w3) then return Partial input gradients that autograd sums as DTensors,
    and the gather's backward reduce-scatters that sum once. Handed over as a plain tensor,
    each projection's `from_local` all-reduced its own gradient in backward: five all-reduces
    of the full activation per block instead of two reduce-scatters."""
    extra = (None,) * n_extra_args
    return PrepareModuleInput(input_layouts=(Shard(1), *extra), desired_input_layouts=(Replicate(), *extra),
                              use_local_output=False)


def block_input_style(n_extra_args: int, *, first_on_stage_without_embedding: bool, gather_output: bool):
    """The input (and, at a stage end, output) of one transformer block under SP.

    The residual input becomes a Shard(1) DTensor; a plain tensor is taken as already
    sequence-sharded, except on the first block of a pipeline stage without the
    embedding, whose input is the full hidden state received from the previous stage.
    `gather_output` (last block of a stage without the head) turns the output back into
    a plain, full tensor for the pipeline to send.
    """
    extra = (None,) * n_extra_args
    inputs = (Replicate() if first_on_stage_without_embedding else Shard(1), *extra)
    desired = (Shard(1), *extra)
    if gather_output:
        return PrepareModuleInputOutput(input_layouts=inputs, desired_input_layouts=desired, use_local_input=False,
                                        output_layouts=Shard(1), desired_output_layouts=Replicate(),
                                        use_local_output=True)
    return PrepareModuleInput(input_layouts=inputs, desired_input_layouts=desired, use_local_output=False)


def stage_output_style():
    """Gathers a sequence-sharded stage output into a plain full tensor."""
    return PrepareModuleOutput(output_layouts=Shard(1), desired_output_layouts=Replicate(), use_local_output=True)


def model_level_plan(model: nn.Module, sequence_parallel: bool, loss_parallel_on: bool) -> dict:
    """The plan for what sits outside the blocks (embedding, final norm, output head) of a
    DecoderLM part; models add their block plans to it."""
    norm = norm_style if sequence_parallel else norm_style_no_sp
    plan: dict = {}
    if model.tok_embeddings is not None:
        plan["tok_embeddings"] = embedding_style(sequence_parallel)
    if model.norm is not None:
        plan["norm"] = norm()
    if model.output is not None:
        plan["output"] = head_style(sequence_parallel, loss_parallel_on)
    if sequence_parallel and not len(model.layers) and (model.tok_embeddings is None or model.output is None):
        from configuration.fields import ConfigError

        raise ConfigError("config error: parallelism.module_fqns_per_model_part: with sequence parallel every "
                          "pipeline stage needs at least one transformer block; move a block into the stage or "
                          "set --parallelism.enable_sequence_parallel false")
    return plan


def apply_plan(module: nn.Module, tp_mesh, plan: dict) -> None:
    parallelize_module(module, tp_mesh, plan)
