"""Tensor-parallel plans for the pieces of a decoder block that several families share.

Why here: DeepSeek V3 and Qwen3 use one block class (models/common/block.py), so the TP
layout of its frame (norms and the residual stream's layouts), its dense SwiGLU and its
MoE is one layout too. A family's `parallelize.py` adds only its attention projections
(MLA's latents, or GQA heads with QK-norm) and calls these. Each helper adds entries to
a plan dict that `tensor_parallel.apply_plan` applies; entry order is kept as each family
had it, because styles on one module register hooks in plan order.

- Frame: with sequence parallel the block takes the Shard(1) residual stream and
  attention gathers it; the two norms run on the shards (else replicated weights).
- Dense FFN: w1 / w3 column-wise, w2 row-wise (Shard(1) output under SP).
- MoE: with SP the MoE works on this rank's sequence shard (local tensors in, Shard(1)
  DTensor out), the router gate is replicated (gradient summed over TP by DTensor),
  routed experts are replicated with a partial gradient (ep = 1) or EP-sharded (ep > 1,
  by the EP plan), shared experts are a TP MLP over the gathered rows. Without SP the
  replicated full sequence is routed whole on every rank; shared experts are
  column/row-wise.
- After `apply_plan`, `finish_moe_block` installs the TP sum of the balance loss's pick
  counts (parallelisms/sequence_shards.py) and marks replicated experts' gradients partial.
"""

from __future__ import annotations

import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

from parallelisms import tensor_parallel as tp
from parallelisms.sequence_shards import add_sequence_shard_mesh
from parallelisms.tensor_parallel import ReplicateParallel


class ReplicateParams(ParallelStyle):
    """Parameters replicated as DTensors over TP; no input/output hooks (the module keeps
    computing on local tensors, e.g. `GroupedExperts`, which calls `.to_local()`)."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        def partition(name, mod, mesh):
            for pname, param in list(mod.named_parameters(recurse=False)):
                mod.register_parameter(pname, nn.Parameter(distribute_tensor(param, mesh, [Replicate()]),
                                                           requires_grad=param.requires_grad))

        return distribute_module(module, device_mesh, partition)


class HeadShardedNorm(ParallelStyle):
    """TP for a norm over head_dim applied to this rank's heads ([B, S, H_local, Dh]), e.g.
    QK-norm: the gain is a replicated DTensor and the input is seen as sharded on the heads
    (dim 2), so DTensor sums the gain's gradient over the TP ranks' heads."""

    def _apply(self, module: nn.Module, mesh) -> nn.Module:
        def partition(name, mod, mesh):
            for pname, p in list(mod.named_parameters(recurse=False)):
                mod.register_parameter(pname, nn.Parameter(distribute_tensor(p, mesh, [Replicate()])))

        def inputs(mod, args, mesh):
            return (DTensor.from_local(args[0], mesh, [Shard(2)], run_check=False), *args[1:])

        def outputs(mod, out, mesh):
            return out.to_local()

        return distribute_module(module, mesh, partition, inputs, outputs)


def residual_out_layout(sp: bool) -> dict:
    """Keyword arguments of a row-wise layer that writes into the residual stream."""
    return dict(output_layouts=Shard(1), use_local_output=False) if sp else {}


def block_frame_plan(prefix: str, sp: bool, plan: dict, *, first_without_embedding: bool,
                     gather_output: bool) -> None:
    """The block's input layouts and its two norms."""
    norm = tp.norm_style if sp else tp.norm_style_no_sp
    if sp:
        plan[prefix] = tp.block_input_style(1, first_on_stage_without_embedding=first_without_embedding,
                                            gather_output=gather_output)
        plan[f"{prefix}.attention"] = tp.module_input_style(n_extra_args=1)
    plan[f"{prefix}.attention_norm"] = norm()
    plan[f"{prefix}.ffn_norm"] = norm()


def dense_ffn_plan(prefix: str, sp: bool, plan: dict) -> None:
    if sp:
        plan[f"{prefix}.feed_forward"] = tp.module_input_style()
    plan[f"{prefix}.feed_forward.w1"] = tp.ColwiseParallel()
    plan[f"{prefix}.feed_forward.w3"] = tp.ColwiseParallel()
    plan[f"{prefix}.feed_forward.w2"] = tp.RowwiseParallel(**residual_out_layout(sp))


def moe_plan(prefix: str, sp: bool, ep: int, plan: dict, *, shared_experts: bool) -> None:
    if sp:
        # The MoE works on this rank's tokens: local tensors in, Shard(1) DTensor out.
        plan[f"{prefix}.moe"] = tp.PrepareModuleInputOutput(
            input_layouts=(Shard(1),), desired_input_layouts=(Shard(1),), use_local_input=True,
            output_layouts=(Shard(1),), desired_output_layouts=(Shard(1),), use_local_output=False)
        plan[f"{prefix}.moe.router.gate"] = tp.SequenceParallel(sequence_dim=0, use_local_output=True)
        if shared_experts:
            plan[f"{prefix}.moe.shared_experts"] = tp.PrepareModuleInput(  # a DTensor: see module_input_style
                input_layouts=(Shard(0),), desired_input_layouts=(Replicate(),), use_local_output=False)
            plan[f"{prefix}.moe.shared_experts.w2"] = tp.RowwiseParallel(output_layouts=Shard(0),
                                                                         use_local_output=True)
    else:
        plan[f"{prefix}.moe.router.gate"] = ReplicateParallel()
        if shared_experts:
            plan[f"{prefix}.moe.shared_experts.w2"] = tp.RowwiseParallel()
    if shared_experts:
        plan[f"{prefix}.moe.shared_experts.w1"] = tp.ColwiseParallel()
        plan[f"{prefix}.moe.shared_experts.w3"] = tp.ColwiseParallel()
    if ep <= 1:
        plan[f"{prefix}.moe.experts"] = ReplicateParams()


def ffn_plan(prefix: str, block: nn.Module, sp: bool, ep: int, plan: dict) -> None:
    """The block's `moe` or `feed_forward` (models.common.block.MoETransformerBlock)."""
    if block.moe_enabled:
        moe_plan(prefix, sp, ep, plan, shared_experts=block.moe.shared_experts is not None)
    else:
        dense_ffn_plan(prefix, sp, plan)


def finish_moe_block(block: nn.Module, tp_mesh, sp: bool, ep: int) -> None:
    """After `apply_plan`: the routed experts compute on their local tensors; under SP each
    rank routes its own sequence shard."""
    from parallelisms.expert_parallel import LocalExpertWeights

    if not block.moe_enabled:
        return
    # Under SP, replicated routed experts are fed this rank's own tokens: their gradient is
    # partial over TP. (Under EP, which runs after TP, EP installs its own.)
    block.moe.experts.local_weights = LocalExpertWeights(partial_over_replicate=sp and ep <= 1)
    if sp:
        # The balance loss counts picks over whole sequences (its router gradient is summed over TP).
        add_sequence_shard_mesh(block.moe, tp_mesh)
