"""The Llama 3 tensor-parallel plan: `ModelSpec.tensor_parallel_fn`.

Applied by the trainer to one model part (the whole model, or one pipeline stage
with some of `tok_embeddings`, `layers`, `norm`, `output` missing), before AC,
compile and FSDP:

- attention: wq, wk, wv column-wise (each rank holds whole heads, so the model's
  `view(..., -1, head_dim)` sees its local heads), wo row-wise;
- feed-forward: w1, w3 column-wise, w2 row-wise;
- tok_embeddings row-wise (vocab-sharded rows), output column-wise (vocab-sharded
  logits, kept as a Shard(-1) DTensor for loss parallel, or gathered);
- with sequence parallel: attention_norm, ffn_norm and the final norm run on the
  sequence-sharded residual stream; attention and feed_forward gather it first. The
  RoPE table (the second block/attention argument, [seq, 2, head_dim]) is a plain
  tensor that no style touches;
- without sequence parallel the norms hold replicated DTensor weights (so every
  parameter of the part is a DTensor on the TP mesh, as the foreach optimizer needs)
  and the residual stream is a plain replicated tensor.
"""

from __future__ import annotations

import torch.nn as nn

from torch.distributed.tensor import Shard

from parallelisms import tensor_parallel as tp


def parallelize_llama(model: nn.Module, tp_mesh, parallelism_cfg) -> None:
    sp = bool(parallelism_cfg.enable_sequence_parallel)
    loss_parallel_on = not parallelism_cfg.disable_loss_parallel
    plan = tp.model_level_plan(model, sp, loss_parallel_on)
    norm = tp.norm_style if sp else tp.norm_style_no_sp
    keys = list(model.layers.keys())
    for i, key in enumerate(keys):
        prefix = f"layers.{key}"
        if sp:
            plan[prefix] = tp.block_input_style(
                1, first_on_stage_without_embedding=(i == 0 and model.tok_embeddings is None),
                gather_output=(i == len(keys) - 1 and model.output is None))
            plan[f"{prefix}.attention"] = tp.module_input_style(n_extra_args=1)
            plan[f"{prefix}.feed_forward"] = tp.module_input_style()
        plan[f"{prefix}.attention_norm"] = norm()
        plan[f"{prefix}.ffn_norm"] = norm()
        out_layout = dict(output_layouts=Shard(1), use_local_output=False) if sp else {}
        plan[f"{prefix}.attention.wq"] = tp.ColwiseParallel()
        plan[f"{prefix}.attention.wk"] = tp.ColwiseParallel()
        plan[f"{prefix}.attention.wv"] = tp.ColwiseParallel()
        plan[f"{prefix}.attention.wo"] = tp.RowwiseParallel(**out_layout)
        plan[f"{prefix}.feed_forward.w1"] = tp.ColwiseParallel()
        plan[f"{prefix}.feed_forward.w3"] = tp.ColwiseParallel()
        plan[f"{prefix}.feed_forward.w2"] = tp.RowwiseParallel(**out_layout)
    tp.apply_plan(model, tp_mesh, plan)
