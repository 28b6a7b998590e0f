"""`full` (and `selective`'s checkpointed blocks) without re-running the block's forward in backward.

Why: torch's non-reentrant checkpoint recomputes a block by re-running its Python forward
under grad mode: module calls, an autograd graph nobody differentiates, a holder and a
metadata check per pack, the RNG restore and the early-stop exception. On the debug shape
that machinery cost about 8.5 points of step time beyond the recomputed FLOPs, against the
5 that issue 20's target allows. `op` and `budget` shed it through `ac_replay` and
`ac_direct`; `full` is the same machinery with nothing kept:

- calls 1 and 2 of a block run through the op-SAC dispatch modes with every op marked
  recompute (`FullAC.decide`): call 1 records the block (`ac_dce.CallRecorder`), call 2
  applies its plan and builds the direct recompute (`ac_direct.build_direct` with an empty
  kept set: only packs on storages from outside the block are held, i.e. the block input,
  the weights and the RoPE table, which is what torch's checkpoint holds);
- from call 3, `FullCall` takes every pack with its own saved-tensor hooks, drops all but
  those when the forward ends, and the first unpack runs the recorded aten ops that rebuild
  them, under no_grad, with no module code;
- if a call's packs differ from the recorded ones, they are handed to the checkpoint's own
  pack hook when its forward ends (holders, no tensors), and its backward goes to torch's
  checkpoint, which re-runs the block as before: exact, and, once the forward has ended, no
  more memory than torch's `full` (the direct path of `op` keeps every pack then). The block
  stays on torch's checkpoint after.
- while a block's forward runs, its packs are held until the forward ends (as by `none`, one
  block at a time); torch's checkpoint drops them as they come. The backward's rebuild holds
  the same set, so the step's peak does not grow (tests/test_memory_estimate.py).

torch's checkpoint runs (from the first call) under compile, and from call 3 where the direct
recompute is not built: a step that draws random numbers, is not aten (collectives: EP, CP),
reads a tensor subclass (TP's DTensors) or a tensor from outside the block that autograd does
not pack and that is no argument of the block's call (DeepSeek's MoE router reads a buffer), or
has an output whose shape or value depends on data (`nonzero`, `item`: the recorded arguments
would not hold). bf16 params and autocast take the direct path (`ac_direct`).
Each block logs which path it took, and why (`ac` logger; `AC_TRACE FULL ...`).
"""

from __future__ import annotations

import contextlib
import logging

import torch
from torch.utils.checkpoint import CheckpointPolicy as P
from torch.utils.checkpoint import noop_context_fn

from parallelisms.ac_direct import Direct, _DirectCall, build_direct
from parallelisms.ac_modes import make_sac_modes
from parallelisms.ac_sac import SAC_CACHE_LISTENERS, OpSACPolicy
from parallelisms.ac_trace import trace_enabled, trace_line
from parallelisms.activation_checkpoint import ACPolicy, OpSAC

logger = logging.getLogger("ac")

class FullCall(_DirectCall):
    """The forward context of a `full` block's direct call (see the module docstring): a
    `_DirectCall` with nothing cached. If the call's packs differ from the recorded ones,
    its packs are handed, in order, to the checkpoint's own pack hook when the forward ends
    (a holder each, no tensor), and its unpacks go to torch's checkpoint, which re-runs the
    block; after the forward, nothing is held but what torch's checkpoint holds."""

    __slots__ = ("outer_pack", "outer_unpack", "fell_back")

    def __enter__(self):
        hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
        if hooks is None:  # (checkpoint always pushes its hooks first)
            raise RuntimeError("FullCall runs inside torch.utils.checkpoint's forward")
        self.outer_pack, self.outer_unpack = hooks
        self.fell_back = False
        return super().__enter__()

    def unpack(self, slot) -> torch.Tensor:
        if self.fell_back:
            return self.outer_unpack(slot.x)  # (the checkpoint's holder)
        return super().unpack(slot)

    def __exit__(self, exc_type, *exc):
        if exc_type is None and (not self.ok or self.count != len(self.direct.metas)
                                 or (self.direct.inputs and self.args is None)):
            torch._C._autograd._pop_saved_tensors_default_hooks()
            self._stop_taking_args()
            self.args = None
            slots, self.slots, self.seen = self.slots, None, None
            for slot in slots:  # what the checkpoint's hook would have made of each pack, in order
                slot.x = self.outer_pack(slot.x)
            self.fell_back = True
            self.on_mismatch()
            return False
        return super().__exit__(exc_type, *exc)


class FullAC(OpSAC):
    """mode = "full": every block keeps only its input (and what comes from outside it:
    weights, the RoPE table) and recomputes the rest in backward; see the module docstring
    for how. Under compile the wrapper is torch's plain checkpoint."""

    mode = "full"
    dynamic_ops = frozenset()

    def save_ops(self) -> frozenset:
        return frozenset()

    def explicit_save_ops(self) -> frozenset:
        return frozenset()

    def force_recompute_fqns(self) -> tuple[str, ...]:
        return ()

    def decide(self, call, func, is_recompute: bool, args=(), out=None):
        return P.PREFER_RECOMPUTE, "RECOMPUTE", ""

    def plan_options(self) -> dict:
        return {"promote": False, "release_saved": True}

    def calibrated(self, block, prefix: str = "") -> bool:
        return self.compile_enabled or super().calibrated(block, prefix)

    def checkpoint_kwargs(self, block, *, prefix: str) -> dict:
        if self.compile_enabled or self.probe is None:
            return ACPolicy.checkpoint_kwargs(self, block, prefix=prefix)
        return super().checkpoint_kwargs(block, prefix=prefix)

    def direct_for(self, plan, prefix: str) -> Direct | None:
        """The block's direct recompute, decided once per plan (None: torch's checkpoint)."""
        decided = getattr(plan, "full_direct", False)
        if decided is not False:
            return decided
        direct, why = plan.direct, ""
        if plan.disabled:
            direct, why = None, plan.disabled
        elif direct is None:
            reasons: list = []
            if plan.replay is not None:
                build_direct(plan.source, [], plan.replay.metas, reasons)
            why = reasons[0] if reasons else "no replay of its forward"
        text = (f"recomputes {len(direct.steps)} ops directly, holds {sum(direct.keep)} of "
                f"{len(direct.keep)} packs" if direct is not None else f"torch's checkpoint: {why}")
        logger.info("activation checkpointing full: %s %s", prefix, text)
        if trace_enabled():
            trace_line(f"full {prefix}", f"FULL {prefix}: {text}")
        plan.full_direct = direct
        return direct

    def context_fn(self, block=None, prefix: str = ""):
        info = self.block_info(block, prefix)
        plans, key, rules = self.plans, info["plan_key"], self
        table: dict = {}
        fast: dict = {}

        def back_to_checkpoint(plan) -> None:
            plan.drop_replay()
            plan.full_direct = None
            logger.info("activation checkpointing full: %s: its packs changed; torch's checkpoint from now on", prefix)

        def context_fn():
            if not torch.compiler.is_compiling():
                plan = plans.get(key)
                if plan is not None and (plan.replay_tried or plan.disabled):
                    direct = rules.direct_for(plan, prefix)
                    if direct is None:
                        return noop_context_fn()
                    call = FullCall(direct, SAC_CACHE_LISTENERS, lambda: back_to_checkpoint(plan))
                    return call, contextlib.nullcontext()
            return make_sac_modes(OpSACPolicy(frozenset(), rules=rules, info=info, table=table, fast=fast))

        context_fn.scope = None  # type: ignore[attr-defined]
        context_fn.inputs_hook = self.watch_inputs(block)  # type: ignore[attr-defined]
        return context_fn


class SelectiveAC(FullAC):
    """mode = "selective": `full` on the blocks whose layer id is a multiple of
    `selective_layer_interval`. Keyed on the global layer id, so a pipeline stage picks
    the same blocks as one process."""

    mode = "selective"

    def block_mode(self, layer_id: int) -> str:
        return "full" if layer_id % self.cfg.selective_layer_interval == 0 else "none"
