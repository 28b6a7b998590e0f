"""DeepSeek V3: the spec the trainer sees."""

import torch

from models.common.moe import MoE, MoEArgs, moe_aux_loss, update_moe_load_balance_bias
from models.deepseek_v3.args import DEEPSEEK_V3_FLAVORS, DeepSeekV3Args
from models.deepseek_v3.model import DeepSeekV3, count_params, interleaved_to_half_perm
from models.deepseek_v3.state_dict_adapter import DeepSeekV3StateDictAdapter
from models.spec import ModelSpec


def _sac_save_ops() -> frozenset:
    """Ops the op-level SAC policy must keep for MoE blocks: the routing decision (topk,
    and the stable sort that permutes tokens) so that a recompute cannot route
    differently, the grouped expert GEMMs, and EP's all-to-all once it exists."""
    ops = [torch.ops.aten.topk.default, torch.ops.aten.sort.stable]
    if hasattr(torch.ops.aten, "_grouped_mm"):
        ops.append(torch.ops.aten._grouped_mm.default)
    try:
        ops.append(torch.ops._c10d_functional.all_to_all_single.default)
    except (AttributeError, RuntimeError):
        pass
    return frozenset(ops)


def post_optimizer_step(model, parallel_dims=None) -> None:
    """ModelSpec.post_optimizer_step_fn: the trainer calls it as (model_part, ParallelDims).
    Loads are summed over the "dp_cp" ranks (those that route different tokens), so every
    replica of a layer applies the same bias update."""
    coeff = getattr(getattr(model, "args", None), "load_balance_coeff", 1e-3)
    group = parallel_dims.mesh("dp_cp") if parallel_dims is not None else None
    update_moe_load_balance_bias(model, coeff=coeff, dp_group=group)


def summarize(model, args: DeepSeekV3Args, seq_len: int) -> dict[str, float]:
    """ModelSpec.summary_fn: total and activated params (embedding, head and expert biases
    included) and training FLOPs per token from the activated non-embedding params."""
    total, activated = count_params(model)
    return {"params": total, "activated_params": activated, "flops_per_token": args.flops_per_token(seq_len)}


spec = ModelSpec(
    name="deepseek_v3",
    flavors=DEEPSEEK_V3_FLAVORS,
    model_cls=DeepSeekV3,
    sac_save_ops=_sac_save_ops(),
    sac_force_recompute_fqns=("*router.gate*",),
    post_optimizer_step_fn=post_optimizer_step,
    summary_fn=summarize,
    state_dict_adapter=DeepSeekV3StateDictAdapter,
)

__all__ = [
    "spec", "DeepSeekV3", "DeepSeekV3Args", "DEEPSEEK_V3_FLAVORS", "count_params", "interleaved_to_half_perm",
    "MoE", "MoEArgs", "moe_aux_loss", "update_moe_load_balance_bias",
]
