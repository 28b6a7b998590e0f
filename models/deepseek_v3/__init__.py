"""DeepSeek V3: the spec the trainer sees."""

from models.common.moe import (MoE, MoEArgs, discard_moe_loads, expert_load_metrics, moe_aux_loss, moe_layer_ids,
                               update_moe_load_balance_bias)
from models.deepseek_v3.ac import AC_POLICIES
from models.deepseek_v3.args import DEEPSEEK_V3_FLAVORS, DeepSeekV3Args
from models.deepseek_v3.model import DeepSeekV3, count_params, interleaved_to_half_perm
from models.deepseek_v3.parallelize import expert_parallel_fn, parallelize_deepseek
from models.deepseek_v3.state_dict_adapter import DeepSeekV3StateDictAdapter
from models.spec import ModelSpec


def post_optimizer_step(model, parallel_dims=None, *, with_metrics: bool = True) -> dict[str, float]:
    """ModelSpec.post_optimizer_step_fn: the trainer calls it as (model_part, ParallelDims,
    with_metrics=whether this step is logged).
    Loads are summed over every rank of the pipeline stage ("dp_cp_tp": data ranks route
    different tokens, and so do TP ranks under sequence parallel; without SP the TP ranks
    count the same tokens, a uniform factor the sign-based update ignores), so every
    replica of a layer applies the same bias update. Returns the expert-load metrics of
    this step (`expert_load_metrics`), computed before the counters are zeroed."""
    coeff = getattr(getattr(model, "args", None), "load_balance_coeff", 1e-3)
    group = parallel_dims.mesh("dp_cp_tp") if parallel_dims is not None else None
    counts = update_moe_load_balance_bias(model, coeff=coeff, dp_group=group)
    return expert_load_metrics(moe_layer_ids(model), counts) if with_metrics else {}


def summarize(model, args: DeepSeekV3Args, seq_len: int) -> dict[str, float]:
    """ModelSpec.summary_fn: total and activated params (embedding, head and expert biases
    included) and training FLOPs per token from the activated non-embedding params."""
    total, activated = count_params(model)
    return {"params": total, "activated_params": activated, "flops_per_token": args.flops_per_token(seq_len)}


spec = ModelSpec(
    name="deepseek_v3",
    flavors=DEEPSEEK_V3_FLAVORS,
    model_cls=DeepSeekV3,
    tensor_parallel_fn=parallelize_deepseek,
    expert_parallel_fn=expert_parallel_fn,
    ac_policies=AC_POLICIES,
    post_optimizer_step_fn=post_optimizer_step,
    skipped_step_fn=discard_moe_loads,
    summary_fn=summarize,
    state_dict_adapter=DeepSeekV3StateDictAdapter,
)

__all__ = [
    "spec", "DeepSeekV3", "DeepSeekV3Args", "DEEPSEEK_V3_FLAVORS", "count_params", "interleaved_to_half_perm",
    "MoE", "MoEArgs", "moe_aux_loss", "update_moe_load_balance_bias",
]
