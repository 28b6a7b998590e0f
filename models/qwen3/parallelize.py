"""Qwen3 tensor-parallel plan (`ModelSpec.tensor_parallel_fn`) and expert parallelism hook.

Applied by the trainer to one model part (the whole model or one pipeline stage), before
AC, compile and FSDP.

- Attention, dense FFN, embedding, final norm and head: Llama 3's plan (each rank holds
  whole q and kv heads: wq/wk/wv column-wise, wo row-wise).
- QK-norm is an RMSNorm over head_dim applied per head, so on a rank's local heads it is
  exact. Its gain is a replicated DTensor and its input is viewed as sharded on the head
  dim, so DTensor sums the gain's gradient over the TP ranks' heads (`HeadShardedNorm`).
- MoE blocks: as DeepSeek V3's (models/deepseek_v3/parallelize.py) without shared experts.
  With sequence parallel each TP rank routes its own sequence shard (router gate
  replicated, routed experts replicated with a partial gradient or EP-sharded); without
  it the replicated full sequence is routed whole on every rank.
- Tied embeddings: embedding row-wise and head column-wise both shard the [vocab, dim]
  weight on dim 0 over the same mesh, so after the plan the head takes the embedding's
  DTensor again and the tie survives TP.
"""

from __future__ import annotations

import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

from parallelisms import expert_parallel
from parallelisms import tensor_parallel as tp
from parallelisms.tensor_parallel import ReplicateParallel
from parallelisms.sequence_shards import add_sequence_shard_mesh


class HeadShardedNorm(ParallelStyle):
    """TP for a norm over head_dim applied to this rank's heads ([B, S, H_local, Dh])."""

    def _apply(self, module: nn.Module, mesh) -> nn.Module:
        def partition(name, mod, mesh):
            for pname, p in list(mod.named_parameters(recurse=False)):
                mod.register_parameter(pname, nn.Parameter(distribute_tensor(p, mesh, [Replicate()])))

        def inputs(mod, args, mesh):
            return (DTensor.from_local(args[0], mesh, [Shard(2)], run_check=False), *args[1:])

        def outputs(mod, out, mesh):
            return out.to_local()

        return distribute_module(module, mesh, partition, inputs, outputs)


class _ReplicateParams(ParallelStyle):
    """Routed experts replicated as DTensors over TP; no hooks (GroupedExperts computes on local tensors)."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        def partition(name, mod, mesh):
            for pname, param in list(mod.named_parameters(recurse=False)):
                mod.register_parameter(pname, nn.Parameter(distribute_tensor(param, mesh, [Replicate()]),
                                                           requires_grad=param.requires_grad))

        return distribute_module(module, device_mesh, partition)


def _block_plan(prefix: str, block: nn.Module, sp: bool, ep: int, plan: dict, *, first_without_embedding: bool,
                gather_output: bool) -> None:
    norm = tp.norm_style if sp else tp.norm_style_no_sp
    out_layout = dict(output_layouts=Shard(1), use_local_output=False) if sp else {}
    if sp:
        plan[prefix] = tp.block_input_style(1, first_on_stage_without_embedding=first_without_embedding,
                                            gather_output=gather_output)
        plan[f"{prefix}.attention"] = tp.module_input_style(n_extra_args=1)
    plan[f"{prefix}.attention_norm"] = norm()
    plan[f"{prefix}.ffn_norm"] = norm()
    for name in ("wq", "wk", "wv"):
        plan[f"{prefix}.attention.{name}"] = tp.ColwiseParallel()
    plan[f"{prefix}.attention.wo"] = tp.RowwiseParallel(**out_layout)
    if block.moe_enabled:
        if sp:
            # The MoE works on this rank's tokens: local tensors in, Shard(1) DTensor out.
            plan[f"{prefix}.moe"] = tp.PrepareModuleInputOutput(
                input_layouts=(Shard(1),), desired_input_layouts=(Shard(1),), use_local_input=True,
                output_layouts=(Shard(1),), desired_output_layouts=(Shard(1),), use_local_output=False)
            plan[f"{prefix}.moe.router.gate"] = tp.SequenceParallel(sequence_dim=0, use_local_output=True)
        else:
            plan[f"{prefix}.moe.router.gate"] = ReplicateParallel()
        if ep <= 1:
            plan[f"{prefix}.moe.experts"] = _ReplicateParams()
    else:
        if sp:
            plan[f"{prefix}.feed_forward"] = tp.module_input_style()
        plan[f"{prefix}.feed_forward.w1"] = tp.ColwiseParallel()
        plan[f"{prefix}.feed_forward.w3"] = tp.ColwiseParallel()
        plan[f"{prefix}.feed_forward.w2"] = tp.RowwiseParallel(**out_layout)


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
        if block.moe_enabled and sp:
            # The balance loss counts picks over whole sequences (its router gradient is summed over TP).
            add_sequence_shard_mesh(block.moe, tp_mesh)
            if ep <= 1:
                # Replicated routed experts fed this rank's own tokens: their gradient is partial over TP.
                block.moe.experts.partial_grad_over_replicate = True
    model.tie()


def qwen3_expert_parallel_fn(model: nn.Module, dims, parallelism_cfg) -> None:
    """`ModelSpec.expert_parallel_fn`: the shared EP plan; a dense Qwen3 has nothing to shard."""
    if not getattr(model.args, "n_routed_experts", 0):
        from trainer.configurable import ConfigError

        raise ConfigError(f"config error: parallelism.expert_parallel_degree: {dims.ep}, but this Qwen3 flavor is "
                          "dense (no routed experts); set it to 1 or use a MoE flavor")
    expert_parallel.expert_parallel_fn(model, dims, parallelism_cfg)
