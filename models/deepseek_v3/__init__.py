"""DeepSeek V3: the spec the trainer sees."""

from models.common.moe_balance import discard_moe_loads, moe_post_optimizer_step
from models.deepseek_v3.ac import AC_POLICIES
from models.deepseek_v3.args import DEEPSEEK_V3_FLAVORS, DeepSeekV3Args
from models.deepseek_v3.model import DeepSeekV3, count_params, interleaved_to_half_perm
from models.deepseek_v3.parallelize import expert_parallel_fn, parallelize_deepseek
from models.deepseek_v3.state_dict_adapter import DeepSeekV3StateDictAdapter
from models.spec import ModelSpec


def post_optimizer_step(model, parallel_dims=None, *, with_metrics: bool = True) -> dict[str, float]:
    """ModelSpec.post_optimizer_step_fn: the aux-loss-free bias update at `load_balance_coeff`
    and this step's expert-load metrics (models.common.moe_balance.moe_post_optimizer_step)."""
    return moe_post_optimizer_step(model, parallel_dims, with_metrics=with_metrics, default_coeff=1e-3)


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
]
