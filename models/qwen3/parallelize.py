"""Qwen3 tensor-parallel plan (`ModelSpec.tensor_parallel_fn`) and expert parallelism hook.

Applied by the trainer to one model part (the whole model or one pipeline stage), before
AC, compile and FSDP.

- Attention, dense FFN, embedding, final norm and head: Llama 3's plan (each rank holds
  whole q and kv heads: wq/wk/wv column-wise, wo row-wise).
- QK-norm is an RMSNorm over head_dim applied per head, so on a rank's local heads it is
  exact. Its gain is a replicated DTensor and its input is viewed as sharded on the head
  dim, so DTensor sums the gain's gradient over the TP ranks' heads (`HeadShardedNorm`).
- Block frame, dense FFN and MoE blocks: the layouts shared with DeepSeek V3
  (parallelisms/block_tp.py; no shared experts here).
- Tied embeddings: embedding row-wise and head column-wise both shard the [vocab, dim]
  weight on dim 0 over the same mesh, so after the plan the head takes the embedding's
  DTensor again and the tie survives TP.
"""

from __future__ import annotations

import torch.nn as nn

from parallelisms import expert_parallel
from parallelisms import tensor_parallel as tp
from parallelisms.block_tp import HeadShardedNorm, block_frame_plan, ffn_plan, finish_moe_block, residual_out_layout


def _block_plan(prefix: str, block: nn.Module, sp: bool, ep: int, plan: dict, *, first_without_embedding: bool,
                gather_output: bool) -> None:
    block_frame_plan(prefix, sp, plan, first_without_embedding=first_without_embedding, gather_output=gather_output)
    for name in ("wq", "wk", "wv"):
        plan[f"{prefix}.attention.{name}"] = tp.ColwiseParallel()
    plan[f"{prefix}.attention.wo"] = tp.RowwiseParallel(**residual_out_layout(sp))
    ffn_plan(prefix, block, sp, ep, plan)


def parallelize_qwen3(model: nn.Module, tp_mesh, parallelism_cfg) -> None:
    sp = bool(parallelism_cfg.enable_sequence_parallel)
    ep = int(getattr(parallelism_cfg, "expert_parallel_degree", 1))
    plan = tp.model_level_plan(model, sp, not parallelism_cfg.disable_loss_parallel)
    keys = list(model.layers.keys())
    for i, key in enumerate(keys):
        _block_plan(f"layers.{key}", model.layers[key], sp, ep, plan,
                    first_without_embedding=(i == 0 and model.tok_embeddings is None),
                    gather_output=(i == len(keys) - 1 and model.output is None))
    tp.apply_plan(model, tp_mesh, plan)
    for block in model.layers.values():
        HeadShardedNorm()._apply(block.attention.q_norm, tp_mesh)
        HeadShardedNorm()._apply(block.attention.k_norm, tp_mesh)
        finish_moe_block(block, tp_mesh, sp, ep)
    model.tie()


def qwen3_expert_parallel_fn(model: nn.Module, dims, parallelism_cfg) -> None:
    """`ModelSpec.expert_parallel_fn`: the shared EP plan (a dense flavor with EP is refused by
    parallelisms/expert_parallel.py::check_expert_parallel_layout, before any worker starts)."""
    expert_parallel.expert_parallel_fn(model, dims, parallelism_cfg)
