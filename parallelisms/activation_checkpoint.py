"""Activation checkpointing: what each transformer block keeps for backward, and what it recomputes.

User guide: docs/activation_checkpointing.md. Design: the project's AC design note.

Why it is shaped this way: every mode is a policy class (`NoAC`, `OpSAC`, `MemoryBudgetAC`;
`FullAC` and `SelectiveAC` in `ac_full`, `BudgetSAC` in `ac_budget`) that owns its reading
of the `[activation_checkpoint]` config and its `apply`, so that a model spec can
parameterise or subclass a policy where the model needs it (MoE-specific choices live in
`models/deepseek_v3/`), through `ModelSpec.ac_policies = {mode: class}`. The op-level policy's extension points are
`OpSAC.save_ops()` (what is always kept) and `OpSAC.decide()` (the per-op rule).

Public surface
--------------
- `ActivationCheckpointConfig`: the config section; `check()` is its one validator.
- `policy_for(cfg, spec=..., ...)`: the policy object for a config (and model spec).
- `apply_activation_checkpointing(model, cfg, *, spec, compile_enabled, extra_save_ops,
  force_recompute_fqns)`: wraps the blocks of `model.layers` in place (after TP, before
  compile and FSDP), once per model part. State-dict keys do not change.
- `block_mode(cfg, layer_id)`: what a given block gets (selective resolves per layer).
- `OpSACPolicy` (from `ac_sac`): the policy function of one checkpointed call.
- `op_sac_context_fn(...)`, `default_save_ops(...)`, `MATMUL_OPS`, `RUNTIME_OP_NAMESPACES`.

Op sets live in `ac_ops`, the AC_TRACE diagnostics in `ac_trace`, the glue with torch's
SAC internals in `ac_sac`. The exact byte and FLOP counters (`SavedActivationCounter`,
`saved_activation_bytes`, `flop_counter`, ...) live in `ac_measure`, which the training
path does not import. Imports go one way: ac_ops, ac_trace, ac_dce <- ac_modes <- ac_replay, ac_direct <-
ac_sac <- this module <-
ac_budget, ac_full, ac_measure (tests/test_layering.py checks that none of them imports back).
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn as nn
from torch.utils.checkpoint import CheckpointPolicy as P

from parallelisms.ac_ops import (
    ALL_GATHER_OPS,
    ATTENTION_OPS,
    D2H_OPS,
    MATMUL_OPS,
    RUNTIME_OP_NAMESPACES,
    default_save_ops,
    is_device_to_host,
    is_runtime_op,
    op_key,
)
from parallelisms.ac_dce import block_kind, register_pack_probe, watch_block_inputs
from parallelisms.ac_sac import SAC_CACHE_LISTENERS, ModuleScope, OpSACPolicy, make_sac_modes
from parallelisms.ac_trace import reset_ac_trace, trace_enabled
from configuration.fields import ConfigError, check_value, opt

logger = logging.getLogger("ac")

AC_MODES = ("none", "full", "selective", "op", "memory_budget", "budget")


def _parse_mode(value):
    # `mode = true` / `false` are accepted as the common shorthands.
    if isinstance(value, bool):
        return "full" if value else "none"
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return "full" if value.lower() == "true" else "none"
    return value


@dataclass
class ActivationCheckpointConfig:
    """[activation_checkpoint]: what each transformer block keeps for backward."""

    mode: str = opt("none", "none, full, selective (every Nth block), op (per-op SAC), memory_budget "
                    "(compile picks; needs compile.enable) or budget (eager memory-budget SAC). "
                    "true = full, false = none.", choices=AC_MODES, parse=_parse_mode)
    selective_layer_interval: int = opt(2, "For mode=selective: checkpoint every Nth block (blocks whose "
                                        "layer id is a multiple of N, starting at 0).", min=1)
    memory_budget: float = opt(0.5, "For mode=memory_budget: 0 = recompute all, 1 = save all.", min=0.0, max=1.0)
    force_recompute_mm_fqns: list[str] = opt([], "Module-name patterns (fnmatch) whose matmuls are always recomputed.")
    preserve_rng_state: bool = opt(True, "Restore RNG state in the recompute so dropout masks match.")
    save_all_gathers: bool = opt(False, "For mode=op: also keep the outputs of the model's all-gathers "
                                 "(TP/SP). Under sequence parallel each is a full-sequence [batch, seq, dim] "
                                 "tensor, two per block; off by default (see docs/activation_checkpointing.md).")

    budget_mib: float | None = opt(None, "For mode=budget: the bytes one block may keep for backward, in MiB "
                                   "(its input included). Unset: budget_fraction of what `none` keeps.", min=0.0)
    budget_fraction: float = opt(0.5, "For mode=budget without budget_mib: the share of the block's `none` "
                                 "bytes it may keep (0 = full AC, 1 = all that none keeps).", min=0.0, max=1.0)

    def validate(self, root) -> None:
        self.check(compile_enabled=root.compile.enable)

    def check(self, compile_enabled: bool | None = None) -> str:
        """The one validator of this section, for configs loaded from TOML/CLI (through
        `validate`) and configs built in code (through `policy_for`). Applies each field's
        declared choices and range, then the rules between fields. Returns the mode.
        `compile_enabled=None`: not known here, the compile rule is not checked."""
        mode = _parse_mode(self.mode)
        for f in dataclasses.fields(self):
            check_value(f"activation_checkpoint.{f.name}", f, mode if f.name == "mode" else getattr(self, f.name))
        if mode == "memory_budget" and compile_enabled is False:
            raise ConfigError("config error: activation_checkpoint.mode: memory_budget needs compile; "
                              "set --compile.enable true or pick another mode")
        if mode == "budget" and compile_enabled:
            raise ConfigError("config error: activation_checkpoint.mode: budget is the eager memory budget; "
                              "under compile.enable use mode memory_budget")
        return mode


# ---------------------------------------------------------------------------
# Policies: one class per mode
# ---------------------------------------------------------------------------

class ACPolicy:
    """What one AC mode does to the blocks of a model part. Subclasses set `mode` and
    override `checkpoint_kwargs` (how a checkpointed block is run) and, where a mode
    treats blocks differently, `block_mode`."""

    mode: ClassVar[str] = ""
    compile_enabled = False  # the blocks will be compiled (set by `policy_for`)

    def __init__(self, cfg: ActivationCheckpointConfig, *, extra_save_ops: Iterable = (),
                 force_recompute_fqns: Iterable[str] = ()):
        self.cfg = cfg
        self.extra_save_ops = frozenset(op_key(op) for op in extra_save_ops)
        self.extra_force_recompute_fqns = tuple(force_recompute_fqns)

    def block_mode(self, layer_id: int) -> str:
        """How block `layer_id` is treated: "none", or the kind of checkpoint it gets."""
        return self.mode

    def checkpoint_kwargs(self, block: nn.Module, *, prefix: str) -> dict[str, Any]:
        """Keyword arguments of `torch.utils.checkpoint.checkpoint` for a wrapped block."""
        return {"preserve_rng_state": self.cfg.preserve_rng_state}

    def calibrated(self, block: nn.Module, prefix: str = "") -> bool:
        """Whether this policy knows what to keep for `block` (wrapped as `prefix`) before
        running it once."""
        return True

    @staticmethod
    def release(kwargs: dict[str, Any]) -> None:
        """Undoes what `checkpoint_kwargs` registered (module-scope hooks), for one-off runs."""
        scope = getattr(kwargs.get("context_fn"), "scope", None)
        if scope is not None:
            scope.remove()
        hook = getattr(kwargs.get("context_fn"), "inputs_hook", None)
        if hook is not None:
            hook.remove()

    def apply(self, model: nn.Module) -> None:
        """Wraps the blocks of `model.layers` in place with a non-reentrant
        `checkpoint_wrapper`, whose state-dict hooks keep the keys unchanged (a checkpoint
        saved under one mode loads under any other). The same mode is applied whatever
        the world size."""
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
        layers, blocks = _blocks(model)
        wrapped = 0
        for name, layer_id, block in blocks:
            if getattr(block, "_ac_mode", None) is not None:
                raise RuntimeError(f"layers.{name} is already activation-checkpointed")
            kind = self.block_mode(layer_id)
            if kind == "none":
                continue
            new = checkpoint_wrapper(block, **self.checkpoint_kwargs(block, prefix=f"layers.{name}"))
            new._ac_mode = kind  # read by apply_compile and by tests
            layers[name if isinstance(layers, nn.ModuleDict) else int(name)] = new
            wrapped += 1
        logger.info("activation checkpointing: mode=%s, %d of %d blocks wrapped", self.mode, wrapped, len(blocks))


class NoAC(ACPolicy):
    """mode = "none": nothing is recomputed."""

    mode = "none"

    def block_mode(self, layer_id: int) -> str:
        return "none"

    def apply(self, model: nn.Module) -> None:
        return None


class MemoryBudgetAC(ACPolicy):
    """mode = "memory_budget": the compile partitioner picks what to save to fit
    `memory_budget` in [0, 1]; `apply_compile` sets the budget. Nothing is wrapped here."""

    mode = "memory_budget"

    def apply(self, model: nn.Module) -> None:
        logger.info("activation checkpointing: memory_budget=%s, chosen by the compile partitioner",
                    self.cfg.memory_budget)


class OpSAC(ACPolicy):
    """mode = "op": op-level selective checkpointing of every block.

    Decisions (`decide`), in order:

    1. runtime ops (`ac_ops.is_runtime_op`) -> PREFER_RECOMPUTE;
    2. matmuls (`MATMUL_OPS`) inside a force-recompute module -> PREFER_RECOMPUTE, not counted;
    3. matmuls listed explicitly in the save set (`explicit_save_ops`) -> MUST_SAVE, not
       counted; other matmuls -> ALTERNATE: MUST_SAVE on odd counts, PREFER_RECOMPUTE on even;
    4. `save_ops()` and device-to-host copies -> MUST_SAVE;
    5. everything else -> PREFER_RECOMPUTE.

    A model spec parameterises it with the class attributes `spec_save_ops` (always
    saved) and `spec_force_recompute_fqns` (fnmatch patterns of modules whose matmuls are
    recomputed), or subclasses `save_ops()` / `decide()`. A parallel plan adds its own
    ops through `apply_activation_checkpointing(extra_save_ops=...)`.
    """

    mode = "op"
    spec_save_ops: ClassVar[frozenset] = frozenset()
    spec_force_recompute_fqns: ClassVar[tuple[str, ...]] = ()
    # Ops whose decision depends on more than the op (counts, arguments, call state);
    # a call remembers the decisions of all others (`cache_decisions`).
    dynamic_ops: ClassVar[frozenset] = MATMUL_OPS | frozenset(op_key(op) for op in D2H_OPS)
    cache_decisions: ClassVar[bool] = True
    # Record one call of each block and skip the ops its recompute does not need (ac_dce).
    recompute_plan: ClassVar[bool] = True
    # Once a block's plan has been applied, run its forward without a dispatch mode (ac_replay).
    replay_forward: ClassVar[bool] = True
    # ... and its recompute run only the ops backward needs, directly (ac_direct).
    direct_recompute: ClassVar[bool] = True

    def __init__(self, cfg: ActivationCheckpointConfig, **kwargs):
        super().__init__(cfg, **kwargs)
        self.probe = register_pack_probe() if self.recompute_plan else None
        # (block kind, prefix) -> ac_dce.RecomputePlan, made from the block's first call.
        self.plans: dict | None = {} if self.probe else None

    def decisions_final(self, call: OpSACPolicy) -> bool:
        """Whether this call decides as later calls will (then it may record the plan)."""
        return True

    def plan_attention_ops(self) -> frozenset:
        """Ops whose inputs the recompute plan keeps (when they are kept themselves)."""
        return ATTENTION_OPS

    def plan_options(self) -> dict:
        """Keyword arguments of `ac_dce.make_plan`: keep tiny outputs and attention
        inputs, release cached outputs nobody reads."""
        return {"promote": True, "release_saved": True}

    def calibrated(self, block: nn.Module, prefix: str = "") -> bool:
        return self.plans is None or (block_kind(block), prefix) in self.plans

    def explicit_save_ops(self) -> frozenset:
        """The ops listed by the spec or the plan (a matmul listed here is saved, not alternated)."""
        return frozenset(op_key(op) for op in self.spec_save_ops) | self.extra_save_ops

    def save_ops(self) -> frozenset:
        """The ops whose outputs are always saved: `default_save_ops`, without the
        all-gathers unless `cfg.save_all_gathers` (an op listed explicitly stays)."""
        ops = default_save_ops(self.explicit_save_ops())
        if not self.cfg.save_all_gathers:
            ops = (ops - {op_key(op) for op in ALL_GATHER_OPS}) | self.explicit_save_ops()
        return ops

    def force_recompute_fqns(self) -> tuple[str, ...]:
        return tuple(self.spec_force_recompute_fqns) + self.extra_force_recompute_fqns + \
            tuple(self.cfg.force_recompute_mm_fqns)

    def decide(self, call: OpSACPolicy, func, is_recompute: bool, args=(), out=None):
        """(CheckpointPolicy, verdict, note) for one op of the call `call` (`call.index` is
        its invocation index). Called once per block for the ops not in `dynamic_ops`
        (the call's table remembers the verdict), once per call for the others."""
        key = op_key(func)
        if is_runtime_op(func):
            return P.PREFER_RECOMPUTE, "RECOMPUTE", "runtime op"
        if key in MATMUL_OPS:
            forced = call.scope.current() if call.scope is not None else None
            if forced is not None:
                return P.PREFER_RECOMPUTE, "RECOMPUTE", f"force_recompute_mm_fqns: {forced}"
            if key in call.explicit_save_ops:
                return P.MUST_SAVE, "SAVE", "model spec"
            call.mm_count[is_recompute] += 1
            odd = call.mm_count[is_recompute] % 2 == 1
            return (P.MUST_SAVE if odd else P.PREFER_RECOMPUTE), "ALTERNATE", ""
        if key in call.save_ops or func in call.save_ops:
            return P.MUST_SAVE, "SAVE", ""
        if key in D2H_OPS and is_device_to_host(args, out):
            return P.MUST_SAVE, "SAVE", "device-to-host copy"
        return P.PREFER_RECOMPUTE, "RECOMPUTE", ""

    # Hooks of one checkpointed call (the memory-budget policy measures through them).
    def start_call(self, call: OpSACPolicy) -> None:
        """When the call's policy function is built, before its forward."""

    def observe(self, call: OpSACPolicy, func, args, kwargs, out, policy) -> None:
        """After each op of the call's forward has been decided (not called unless a
        subclass overrides it: it would run for every op)."""

    observe._no_op = True  # type: ignore[attr-defined]

    def end_call(self, call: OpSACPolicy, storage) -> None:
        """When the call's forward ends (eager mode only), with torch's SAC storage."""

    def block_info(self, block: nn.Module | None, prefix: str) -> dict:
        """What the rules want to know about a block, once, when it is wrapped (each
        call's `OpSACPolicy.info`)."""
        return {"prefix": prefix, "plan_key": (block_kind(block), prefix) if self.plans is not None else None,
                "block": block}

    def context_fn(self, block: nn.Module | None = None, prefix: str = "") -> Callable[[], tuple]:
        """A `context_fn` for `torch.utils.checkpoint.checkpoint` applying this policy.

        Each call builds a fresh `OpSACPolicy`, so the matmul counts reset per block call;
        the verdicts that depend on the op alone are shared by every call of the block (one
        table per context_fn). If `block` is given and a force-recompute pattern matches one of its submodules
        (relative name, or `prefix.relative`), hooks are installed on those submodules;
        `context_fn.scope.remove()` takes them off again.
        """
        save_ops, explicit, rules, info = self.save_ops(), self.explicit_save_ops(), self, self.block_info(block, prefix)
        scope = ModuleScope(self.force_recompute_fqns())
        if block is not None and scope.patterns:
            scope.install(block, prefix)
        table: dict = {}
        fast: dict = {}
        plans, plan_key = self.plans, info.get("plan_key")

        def context_fn():
            # A plain closure (not a partial of objects) so that dynamo accepts it.
            if plans is not None and not torch.compiler.is_compiling():
                plan = plans.get(plan_key)
                if plan is not None and plan.replay is not None and not trace_enabled():
                    # No dispatch mode in this forward (ac_replay), nor in its recompute (ac_direct).
                    chosen = plan.direct if plan.direct is not None else plan.replay
                    return chosen.contexts(SAC_CACHE_LISTENERS, plan.drop_replay)
            return make_sac_modes(OpSACPolicy(save_ops, scope=scope, trace=trace_enabled(), explicit_save_ops=explicit,
                                              rules=rules, info=info, table=table, fast=fast))

        context_fn.scope = scope  # type: ignore[attr-defined]
        context_fn.inputs_hook = self.watch_inputs(block)  # type: ignore[attr-defined]
        return context_fn

    def watch_inputs(self, block: nn.Module | None):
        """The hook that hands the block's arguments to the recording call and to direct calls
        (`ac_dce.watch_block_inputs`), in eager mode with a recompute plan; else None."""
        if block is None or self.plans is None or self.compile_enabled or not self.direct_recompute:
            return None
        return watch_block_inputs(block)

    def checkpoint_kwargs(self, block: nn.Module, *, prefix: str) -> dict[str, Any]:
        kwargs = {**super().checkpoint_kwargs(block, prefix=prefix), "context_fn": self.context_fn(block, prefix)}
        return {**kwargs, "determinism_check": self.probe} if self.probe else kwargs


# Mode -> policy class ("module:name" for one imported only when that mode is used).
POLICIES: dict[str, Any] = {
    "none": NoAC, "full": "parallelisms.ac_full:FullAC", "selective": "parallelisms.ac_full:SelectiveAC", "op": OpSAC,
    "memory_budget": MemoryBudgetAC, "budget": "parallelisms.ac_budget:BudgetSAC",
}


# ---------------------------------------------------------------------------
# Entry points
# ---------------------------------------------------------------------------

def _layer_id(name: str, position: int) -> int:
    try:
        return int(name)
    except ValueError:
        return position


def _blocks(model: nn.Module):
    """(the `layers` container, [(key, layer id, block)])."""
    layers = getattr(model, "layers", None)
    if not isinstance(layers, (nn.ModuleDict, nn.ModuleList)):
        raise TypeError(f"activation checkpointing needs the blocks in `model.layers` (a ModuleDict); "
                        f"{type(model).__name__} has {type(layers).__name__}")
    items = list(layers.items()) if isinstance(layers, nn.ModuleDict) else [(str(i), b) for i, b in enumerate(layers)]
    return layers, [(name, _layer_id(name, pos), block) for pos, (name, block) in enumerate(items)]


def policy_for(cfg: ActivationCheckpointConfig, *, spec=None, compile_enabled: bool | None = None,
               extra_save_ops: Iterable = (), force_recompute_fqns: Iterable[str] = ()) -> ACPolicy:
    """The policy for `cfg` (validated by `cfg.check`): the model spec's class for the mode
    if it has one (`spec.ac_policies`), else the default one."""
    mode = cfg.check(compile_enabled)
    cls = {**POLICIES, **(getattr(spec, "ac_policies", None) or {})}[mode]
    if isinstance(cls, str):
        module, name = cls.split(":")
        cls = getattr(importlib.import_module(module), name)
    policy = cls(cfg, extra_save_ops=extra_save_ops, force_recompute_fqns=force_recompute_fqns)
    policy.compile_enabled = bool(compile_enabled)
    return policy


def apply_activation_checkpointing(model: nn.Module, cfg: ActivationCheckpointConfig, *, spec=None,
                                   compile_enabled: bool = False, extra_save_ops: Iterable = (),
                                   force_recompute_fqns: Iterable[str] = ()) -> ACPolicy:
    """Applies `cfg` to the blocks of `model.layers` (one model part) in place and returns
    the policy. Call after TP and before compile and FSDP, on every model part.

    `spec`: the model spec, whose `ac_policies` may replace a mode's class (DeepSeek's
    MoE rules). `extra_save_ops`: ops a parallel plan needs kept (e.g. its own
    collectives); `force_recompute_fqns`: more module-name patterns whose matmuls are
    recomputed (added to the spec's and to `cfg.force_recompute_mm_fqns`).
    """
    policy = policy_for(cfg, spec=spec, compile_enabled=compile_enabled, extra_save_ops=extra_save_ops,
                        force_recompute_fqns=force_recompute_fqns)
    policy.apply(model)
    return policy


def block_mode(cfg: ActivationCheckpointConfig, layer_id: int) -> str:
    """How block `layer_id` is treated under `cfg`: "none", "full", "op" or
    "memory_budget" (selective resolves to "full" or "none" by layer id)."""
    return policy_for(cfg).block_mode(layer_id)


def unwrap_block(module: nn.Module) -> nn.Module:
    """The block inside a checkpoint wrapper (or the module itself)."""
    return getattr(module, "_checkpoint_wrapped_module", module)


def op_sac_context_fn(*, extra_save_ops: Iterable = (), force_recompute_fqns: Iterable[str] = (),
                      block: nn.Module | None = None, prefix: str = "") -> Callable[[], tuple]:
    """The default op-level policy's `context_fn` (see `OpSAC.context_fn`), for callers
    that hold ops and patterns rather than a spec."""
    policy = OpSAC(ActivationCheckpointConfig(mode="op"), extra_save_ops=extra_save_ops,
                   force_recompute_fqns=force_recompute_fqns)
    return policy.context_fn(block, prefix)


__all__ = [
    "AC_MODES", "ACPolicy", "ActivationCheckpointConfig", "MATMUL_OPS", "MemoryBudgetAC", "NoAC",
    "OpSAC", "OpSACPolicy", "POLICIES", "RUNTIME_OP_NAMESPACES", "apply_activation_checkpointing",
    "block_mode", "default_save_ops", "op_sac_context_fn", "policy_for", "reset_ac_trace", "unwrap_block",
]
