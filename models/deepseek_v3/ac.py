"""DeepSeek V3's activation-checkpointing policies: the MoE-specific choices.

Why here: what a MoE block must keep (the routing decision, EP's all-to-alls) is
knowledge about this model, so it lives with the model spec, as a parameterisation of
the default op-level policy (`parallelisms.activation_checkpoint.OpSAC`), registered
through `ModelSpec.ac_policies`.
"""

from __future__ import annotations

import torch

from parallelisms.ac_budget import BudgetSAC
from parallelisms.activation_checkpoint import OpSAC


def _moe_save_ops() -> frozenset:
    """Ops the op-level SAC policy must keep for MoE blocks: the routing decision (topk,
    and the stable sort that permutes tokens) so that a recompute cannot route
    differently, and EP's all-to-all (dispatch, combine and the counts exchange), so that
    the recompute sends nothing. The grouped expert GEMMs are not listed: like every
    matmul they alternate between saved and recomputed (listing them would save them all)."""
    ops = [torch.ops.aten.topk.default, torch.ops.aten.sort.stable]
    try:
        ops.append(torch.ops._c10d_functional.all_to_all_single.default)
    except (AttributeError, RuntimeError):
        pass
    return frozenset(ops)


class MoEOpSAC(OpSAC):
    """Op-level SAC for DeepSeek V3 blocks: the routing and all-to-all ops are always
    saved, the router gate's small matmul is always recomputed."""

    spec_save_ops = _moe_save_ops()
    spec_force_recompute_fqns = ("*router.gate*",)


class MoEBudgetSAC(BudgetSAC):
    """The eager memory budget for DeepSeek V3 blocks: the routing and all-to-all ops are
    kept whatever the budget, the router gate's matmul is always recomputed."""

    spec_save_ops = MoEOpSAC.spec_save_ops
    spec_force_recompute_fqns = MoEOpSAC.spec_force_recompute_fqns


AC_POLICIES = {"op": MoEOpSAC, "budget": MoEBudgetSAC}
