"""DeepSeek V3's activation-checkpointing policies: the MoE-specific choices.

Why here: what a MoE block must keep, and what it can drop, is knowledge about this
model, so it lives with the model spec, as subclasses of the default policies
(`parallelisms.activation_checkpoint.OpSAC`, `parallelisms.ac_budget.BudgetSAC`)
registered through `ModelSpec.ac_policies`.

Op-level SAC on a MoE block (measured in docs/moe.md; the default rule, every other
matmul, kept 18x the bytes of full AC and was slower than full under EP):

- kept: the routing (`topk`, the stable `sort` that orders tokens by expert) so that the
  recompute routes identically, and EP's all-to-alls (counts, dispatch, combine) so that
  it sends nothing;
- recomputed: the up projection's grouped GEMM and the SwiGLU product (per-expert
  intermediates, `[rows, hidden]`), and the routing-weighted sum (`bmm`); the gate
  projection's output is kept (`keep_expert_gate`, a third of the expert GEMMs);
- under EP, skipped: the experts' last grouped GEMM (the down projection) and the
  index_selects that carry its output to the combine all-to-all (on CUDA first the
  GEMM's own un-pad, `padded_group_layout`, then the un-regroup; on CPU only the latter),
  whose output is kept. No backward formula reads them, so the recompute does not run
  them (a `Placeholder` answers; the MoE recompute skip of TorchTitan's and Megatron's
  open PRs). Which index_selects are skipped follows the data, not the order: one is
  skipped when its input shares storage with a skipped output (views such as the
  experts' `view_as` included). Without EP that output is kept instead: the combine that
  would hide it is absent.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch.utils.checkpoint import CheckpointPolicy as P

from parallelisms.ac_budget import BudgetSAC
from parallelisms.ac_sac import plain_tensors
from parallelisms.activation_checkpoint import OpSAC


def _moe_save_ops() -> frozenset:
    """Ops the SAC policies must keep for MoE blocks: the routing decision (topk, and the
    stable sort that permutes tokens) so that a recompute cannot route differently, and
    EP's all-to-all (dispatch, combine and the counts exchange), so that the recompute
    sends nothing."""
    ops = [torch.ops.aten.topk.default, torch.ops.aten.sort.stable]
    try:
        ops.append(torch.ops._c10d_functional.all_to_all_single.default)
    except (AttributeError, RuntimeError):
        pass
    return frozenset(ops)


_GROUPED_MM = torch.ops.aten._grouped_mm.default
_INDEX_SELECT = torch.ops.aten.index_select.default
_BMM = torch.ops.aten.bmm.default
# `GroupedExperts` runs three grouped GEMMs per call: gate (w1), up (w3), down (w2).
_GEMMS_PER_EXPERTS_CALL = 3


def _storage_ref(t):
    """A weak reference to `t`'s storage (equal for every view of it), or None."""
    from torch.multiprocessing.reductions import StorageWeakRef
    try:
        return StorageWeakRef(next(plain_tensors(t)).untyped_storage())
    except Exception:  # noqa: BLE001 - fake / storage-less tensors: nothing is skipped
        return None


def _note_skipped(call, out) -> None:
    """Remembers the storage of a skipped op's output for this call. The weak reference
    keeps the storage's identity from being reused while the call lasts."""
    ref = _storage_ref(out) if isinstance(out, torch.Tensor) else None
    if ref is not None:
        call.skipped_storages = {**getattr(call, "skipped_storages", {}), ref: ref}


def _reads_skipped(call, args) -> bool:
    skipped = getattr(call, "skipped_storages", None)
    if not skipped or not args or not isinstance(args[0], torch.Tensor):
        return False
    ref = _storage_ref(args[0])
    return ref is not None and ref in skipped


class MoEOpSAC(OpSAC):
    """Op-level SAC for DeepSeek V3 blocks (see the module docstring). Dense blocks, and
    the attention and shared experts of MoE blocks, follow the default rules; the router
    gate's small matmul is always recomputed."""

    spec_save_ops = _moe_save_ops()
    spec_force_recompute_fqns = ("*router.gate*",)
    dynamic_ops = OpSAC.dynamic_ops | {_INDEX_SELECT.overloadpacket}
    # Keep the gate projection's output ([rows, hidden]): a third of the expert GEMMs
    # is then not recomputed, for one [rows, hidden] tensor per MoE block. False keeps
    # no per-expert intermediate (docs/moe.md has both, measured).
    keep_expert_gate: ClassVar[bool] = True

    def block_info(self, block, prefix: str) -> dict:
        from models.common.moe import MoE
        moes = [m for m in block.modules() if isinstance(m, MoE)] if block is not None else []
        return {**super().block_info(block, prefix), "moe": bool(moes),
                "ep": any(getattr(m, "token_dispatcher", None) is not None for m in moes)}

    def decide(self, call, func, is_recompute: bool, args=(), out=None):
        if not call.info.get("moe"):
            return super().decide(call, func, is_recompute, args, out)
        if func is _GROUPED_MM:
            gemm = call.index % _GEMMS_PER_EXPERTS_CALL
            if gemm == 0 and self.keep_expert_gate:
                return P.MUST_SAVE, "SAVE", "MoE: the experts' gate projection"
            if gemm != _GEMMS_PER_EXPERTS_CALL - 1:
                return P.PREFER_RECOMPUTE, "RECOMPUTE", "MoE: per-expert intermediate"
            if call.info["ep"]:
                _note_skipped(call, out)
                return P.PREFER_RECOMPUTE, "SKIP", "MoE under EP: only the kept combine reads it"
            return P.MUST_SAVE, "SAVE", "MoE: the experts' output"
        if func is _INDEX_SELECT and _reads_skipped(call, args):
            _note_skipped(call, out)
            return P.PREFER_RECOMPUTE, "SKIP", "MoE under EP: carries the experts' output to the combine"
        if func is _BMM:
            return P.PREFER_RECOMPUTE, "RECOMPUTE", "MoE: the routing-weighted sum"
        return super().decide(call, func, is_recompute, args, out)


class MoEBudgetSAC(BudgetSAC):
    """The eager memory budget for DeepSeek V3 blocks: the routing and all-to-all ops are
    kept whatever the budget, the router gate's matmul is always recomputed."""

    spec_save_ops = MoEOpSAC.spec_save_ops
    spec_force_recompute_fqns = MoEOpSAC.spec_force_recompute_fqns


AC_POLICIES = {"op": MoEOpSAC, "budget": MoEBudgetSAC}
