"""Qwen3, dense and MoE: the spec the trainer sees (one family; a MoE flavor has routed experts)."""

from models.common.moe_balance import discard_moe_loads, moe_post_optimizer_step
from models.deepseek_v3.ac import AC_POLICIES
from models.qwen3.args import QWEN3_FLAVORS, Qwen3Args
from models.qwen3.model import Qwen3, count_params
from models.qwen3.parallelize import parallelize_qwen3, qwen3_expert_parallel_fn
from models.qwen3.state_dict_adapter import Qwen3StateDictAdapter
from models.spec import ModelSpec


def post_optimizer_step(model, parallel_dims=None, *, with_metrics: bool = True) -> dict[str, float]:
    """ModelSpec.post_optimizer_step_fn: the expert-load metrics of this step (loads summed over
    the stage's ranks) and, only when `moe.bias_update_rate` > 0, the aux-loss-free bias update
    (off for Qwen3: rate 0 leaves the bias at zero)."""
    return moe_post_optimizer_step(model, parallel_dims, with_metrics=with_metrics, default_coeff=0.0)


def summarize(model, args: Qwen3Args, seq_len: int) -> dict[str, float]:
    """ModelSpec.summary_fn: total and activated params as transformers counts them (a tied head
    once, no buffers) and training FLOPs per token."""
    total, activated = count_params(model)
    out = {"params": total, "flops_per_token": args.flops_per_token(seq_len)}
    if args.moe_enabled:
        out["activated_params"] = activated
    return out


spec = ModelSpec(
    name="qwen3",
    flavors=QWEN3_FLAVORS,
    model_cls=Qwen3,
    tensor_parallel_fn=parallelize_qwen3,
    expert_parallel_fn=qwen3_expert_parallel_fn,
    # DeepSeek V3's MoE rules for op-level SAC and the budget (they key on MoE modules, not names);
    # dense blocks fall through to the defaults.
    ac_policies=AC_POLICIES,
    post_optimizer_step_fn=post_optimizer_step,
    skipped_step_fn=discard_moe_loads,
    summary_fn=summarize,
    state_dict_adapter=Qwen3StateDictAdapter,
)

__all__ = ["spec", "Qwen3", "Qwen3Args", "QWEN3_FLAVORS", "count_params"]
