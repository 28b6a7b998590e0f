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
- Block frame, dense FFN and MoE: the layouts shared with Qwen3 (parallelisms/block_tp.py).
  MoE blocks: with sequence parallel the MoE runs on each TP rank's own sequence shard:
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
from torch.distributed.tensor import Replicate, Shard

from parallelisms import tensor_parallel as tp
from parallelisms.block_tp import block_frame_plan, ffn_plan, finish_moe_block, residual_out_layout
from parallelisms.expert_parallel import expert_parallel_fn
from parallelisms.tensor_parallel import ReplicateParallel


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


def _block_plan(prefix: str, block: nn.Module, sp: bool, ep: int, plan: dict, *, first_without_embedding: bool,
                gather_output: bool) -> None:
    """The plan of one transformer block (a decoder layer, or an MTP module's block)."""
    block_frame_plan(prefix, sp, plan, first_without_embedding=first_without_embedding, gather_output=gather_output)
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
    plan[f"{att}.wo"] = tp.RowwiseParallel(**residual_out_layout(sp))
    ffn_plan(prefix, block, sp, ep, plan)


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
        finish_moe_block(block, tp_mesh, sp, ep)


__all__ = ["parallelize_deepseek", "expert_parallel_fn"]
