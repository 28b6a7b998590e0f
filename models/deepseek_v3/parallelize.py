"""DeepSeek V3 tensor-parallel plan (`ModelSpec.tensor_parallel_fn`) and its expert
parallelism hook (`ModelSpec.expert_parallel_fn`, see parallelisms/expert_parallel.py).

Applied by the trainer to one model part (the whole model or one pipeline stage),
before AC, compile and FSDP. Every parameter ends up a DTensor on the TP mesh (or,
for EP-sharded experts, on the EP mesh), so foreach optimizers and clipping never mix
DTensors with plain tensors.

- Edges (embedding, final norm, head) and dense blocks' feed_forward: as Llama 3.
- MLA: the projections that produce per-head outputs are column-wise (each rank holds
  whole heads: `wq`, or `wq_b` with q LoRA, and `wkv_b`), `wo` is row-wise. The
  low-rank down projections and their norms (`wq_a`, `q_norm`, `wkv_a`, `kv_norm`) are
  replicated: their outputs (the q / kv latents and the shared rope key) feed all heads.
  The latents' gradients are summed over TP by the column-wise layers' input handling;
  the rope key (the last `qk_rope_head_dim` outputs of `wkv_a`) is broadcast to this
  rank's heads inside MLA.forward, so its gradient is only this rank's heads' share: a
  hook on `wkv_a` all-reduces the gradient of those columns over TP.
- MoE blocks. With sequence parallel the MoE runs on each TP rank's own sequence shard:
  no communication at its boundary, the router gate is replicated (gradient summed over
  TP by DTensor), routed experts are replicated with a partial gradient (ep = 1) or
  EP-sharded (ep > 1, by `expert_parallel_fn`), and the shared experts are a TP MLP
  over the gathered rows (all-gather in, reduce-scatter out). Without sequence parallel
  the MoE input is the replicated full sequence: router and routed experts are
  replicated and each TP rank computes them whole; shared experts are column/row-wise.
  EP with TP but without SP is refused (see parallelisms/expert_parallel.py).
- The sequence balance loss under SP: each rank routes its own sequence shard; the pick
  counts are summed over TP (`parallelisms.sequence_shards`, installed here; the CP plan
  adds its own mesh), so the loss is that of whole sequences and its router gradient,
  summed over TP, that of one rank.
"""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol
import torch.nn as nn
from torch.distributed.tensor import Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

from parallelisms import tensor_parallel as tp
from parallelisms.expert_parallel import expert_parallel_fn
from parallelisms.sequence_shards import add_sequence_shard_mesh
from parallelisms.tensor_parallel import ReplicateParallel


class _ReplicateParams(ParallelStyle):
    """Parameters replicated as DTensors over TP; no input/output hooks (the module keeps
    computing on local tensors, e.g. `GroupedExperts`, which calls `.to_local()`)."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        def partition(name, mod, mesh):
            for pname, param in list(mod.named_parameters(recurse=False)):
                mod.register_parameter(pname, nn.Parameter(distribute_tensor(param, mesh, [Replicate()]),
                                                           requires_grad=param.requires_grad))

        return distribute_module(module, device_mesh, partition)


class _SumGradOverTP(torch.autograd.Function):
    """Identity; in backward, all-reduces (sum) the gradient's last-dim columns [start:) over `group`."""

    @staticmethod
    def forward(ctx, x, start: int, group):
        ctx.start, ctx.group = start, group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        head = grad[..., : ctx.start]
        tail = funcol.all_reduce(grad[..., ctx.start:].contiguous(), "sum", ctx.group)
        return torch.cat([head, tail], dim=-1), None, None


def _sum_rope_key_grad_hook(start: int, group):
    def hook(module, args, output):
        return _SumGradOverTP.apply(output, start, group)

    return hook


def _moe_plan(prefix: str, sp: bool, ep: int, plan: dict) -> None:
    if sp:
        # The MoE works on this rank's tokens: local tensors in, Shard(1) DTensor out.
        plan[f"{prefix}.moe"] = tp.PrepareModuleInputOutput(
            input_layouts=(Shard(1),), desired_input_layouts=(Shard(1),), use_local_input=True,
            output_layouts=(Shard(1),), desired_output_layouts=(Shard(1),), use_local_output=False)
        plan[f"{prefix}.moe.router.gate"] = tp.SequenceParallel(sequence_dim=0, use_local_output=True)
        plan[f"{prefix}.moe.shared_experts"] = tp.PrepareModuleInput(
            input_layouts=(Shard(0),), desired_input_layouts=(Replicate(),), use_local_output=True)
        plan[f"{prefix}.moe.shared_experts.w2"] = tp.RowwiseParallel(output_layouts=Shard(0), use_local_output=True)
    else:
        plan[f"{prefix}.moe.router.gate"] = ReplicateParallel()
        plan[f"{prefix}.moe.shared_experts.w2"] = tp.RowwiseParallel()
    plan[f"{prefix}.moe.shared_experts.w1"] = tp.ColwiseParallel()
    plan[f"{prefix}.moe.shared_experts.w3"] = tp.ColwiseParallel()
    if ep <= 1:
        plan[f"{prefix}.moe.experts"] = _ReplicateParams()


def _block_plan(prefix: str, block: nn.Module, sp: bool, ep: int, plan: dict, *, first_without_embedding: bool,
                gather_output: bool) -> None:
    """The plan of one transformer block (a decoder layer, or an MTP module's block)."""
    norm = tp.norm_style if sp else tp.norm_style_no_sp
    out_layout = dict(output_layouts=Shard(1), use_local_output=False) if sp else {}
    if sp:
        plan[prefix] = tp.block_input_style(1, first_on_stage_without_embedding=first_without_embedding,
                                            gather_output=gather_output)
        plan[f"{prefix}.attention"] = tp.module_input_style(n_extra_args=1)
    plan[f"{prefix}.attention_norm"] = norm()
    plan[f"{prefix}.ffn_norm"] = norm()
    att = f"{prefix}.attention"
    if block.attention.q_lora_rank == 0:
        plan[f"{att}.wq"] = tp.ColwiseParallel()
    else:
        plan[f"{att}.wq_a"] = ReplicateParallel()
        plan[f"{att}.q_norm"] = ReplicateParallel()
        plan[f"{att}.wq_b"] = tp.ColwiseParallel()
    plan[f"{att}.wkv_a"] = ReplicateParallel()
    plan[f"{att}.kv_norm"] = ReplicateParallel()
    plan[f"{att}.wkv_b"] = tp.ColwiseParallel()
    plan[f"{att}.wo"] = tp.RowwiseParallel(**out_layout)
    if block.moe_enabled:
        _moe_plan(prefix, sp, ep, plan)
    else:
        if sp:
            plan[f"{prefix}.feed_forward"] = tp.module_input_style()
        plan[f"{prefix}.feed_forward.w1"] = tp.ColwiseParallel()
        plan[f"{prefix}.feed_forward.w3"] = tp.ColwiseParallel()
        plan[f"{prefix}.feed_forward.w2"] = tp.RowwiseParallel(**out_layout)


def _mtp_plan(model: nn.Module, sp: bool, ep: int, plan: dict) -> None:
    """MTP modules (models/deepseek_v3/mtp.py): norms and eh_proj replicated, on the
    sequence-sharded stream under SP; the block as any block. Their inputs are the main
    head's normed hidden state (sequence-sharded under SP) and the MTP embeddings: those
    too when the embedding is on this stage, else plain full tensors received from the
    previous pipeline stage."""
    norm = tp.norm_style if sp else tp.norm_style_no_sp
    emb_layout = Shard(1) if model.tok_embeddings is not None else Replicate()
    for key, layer in model.mtp.items():
        prefix = f"mtp.{key}"
        if sp:
            plan[prefix] = tp.PrepareModuleInput(input_layouts=(Shard(1), emb_layout, None),
                                                 desired_input_layouts=(Shard(1), Shard(1), None),
                                                 use_local_output=False)
        for name in ("enorm", "hnorm", "norm"):
            plan[f"{prefix}.{name}"] = norm()
        plan[f"{prefix}.eh_proj"] = tp.SequenceParallel() if sp else ReplicateParallel()
        _block_plan(f"{prefix}.block", layer.block, sp, ep, plan, first_without_embedding=False, gather_output=False)


def _all_blocks(model: nn.Module) -> list[nn.Module]:
    mtp = getattr(model, "mtp", None)
    return list(model.layers.values()) + ([layer.block for layer in mtp.values()] if mtp is not None else [])


def parallelize_deepseek(model: nn.Module, tp_mesh, parallelism_cfg) -> None:
    sp = bool(parallelism_cfg.enable_sequence_parallel)
    loss_parallel_on = not parallelism_cfg.disable_loss_parallel
    ep = int(getattr(parallelism_cfg, "expert_parallel_degree", 1))
    plan = tp.model_level_plan(model, sp, loss_parallel_on)
    keys = list(model.layers.keys())
    for i, key in enumerate(keys):
        _block_plan(f"layers.{key}", model.layers[key], sp, ep, plan,
                    first_without_embedding=(i == 0 and model.tok_embeddings is None),
                    gather_output=(i == len(keys) - 1 and model.output is None))
    if getattr(model, "mtp", None) is not None:
        _mtp_plan(model, sp, ep, plan)
    tp.apply_plan(model, tp_mesh, plan)
    for block in _all_blocks(model):
        att = block.attention
        att.wkv_a.register_forward_hook(_sum_rope_key_grad_hook(att.kv_lora_rank, tp_mesh.get_group()))
        if block.moe_enabled and sp:
            # The balance loss counts picks over whole sequences (its router gradient is summed over TP).
            add_sequence_shard_mesh(block.moe, tp_mesh)
            if ep <= 1:
                # Replicated routed experts fed this rank's own tokens: their gradient is partial over TP.
                block.moe.experts.partial_grad_over_replicate = True


__all__ = ["parallelize_deepseek", "expert_parallel_fn"]
