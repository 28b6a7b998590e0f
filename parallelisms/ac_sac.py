"""Glue between our op-level policies and torch's selective checkpointing (SAC) internals.

Why a module of its own: torch's SAC (`create_selective_checkpoint_contexts`) is a pair
of dispatch modes that cache op outputs by per-op invocation index, driven by a policy
function. `OpSACPolicy` is that function for one checkpointed call (its rules come from
an `activation_checkpoint.OpSAC`). What the policies need beyond torch's public API
lives here, behind guards:

- the dispatch modes themselves (runtime ops and parameter casts bypass the cache,
  placeholders are answered without running) live in `ac_modes`;
- when a forward ends, cache entries the recompute never reads are released, and
  whoever counts what the cache holds (`ac_measure.SavedActivationCounter`) is told
  through `SAC_CACHE_LISTENERS`, so the training path never imports the counters;
- a cache entry can be a `Placeholder` that the recompute answers without running the op;
- force-recompute patterns need to know which module is running, in eager mode (global
  module hooks) and under compile (the traced node's `nn_module_stack`): `ModuleScope`;
- the recompute plan (`ac_dce`) is recorded from one call and applied to the next ones.
"""

from __future__ import annotations

import fnmatch
import logging
import re
import weakref

import torch
import torch.nn as nn
from torch.utils.checkpoint import CheckpointPolicy

from parallelisms.ac_dce import INPLACE_SKIP, INPUT_LISTENERS, PACK_LISTENERS, CallRecorder, RecomputePlan, make_plan
from parallelisms.ac_modes import Placeholder, kept_tensors, make_sac_modes
from parallelisms.ac_direct import build_direct, scalar_state
from parallelisms.ac_replay import build_replay
from parallelisms.ac_ops import MATMUL_OPS, op_key
from parallelisms.ac_trace import trace, trace_line

logger = logging.getLogger("ac")

# Objects with `add(obj, source)` that want every tensor the SAC cache keeps
# (ac_measure.SavedActivationCounter registers itself while it is active).
SAC_CACHE_LISTENERS: list = []

_MUST_SAVE = CheckpointPolicy.MUST_SAVE
_SAVE_POLICIES = (CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_SAVE)

def plain_tensors(t: torch.Tensor):
    """The plain tensors behind a tensor subclass (DTensor, FSDP params, ...)."""
    if hasattr(t, "__tensor_flatten__") and type(t) is not torch.Tensor and not isinstance(t, nn.Parameter):
        try:
            names, _ = t.__tensor_flatten__()
            for n in names:  # (DTensor also lists its device mesh)
                inner = getattr(t, n)
                if isinstance(inner, torch.Tensor):
                    yield from plain_tensors(inner)
            return
        except Exception:  # noqa: BLE001
            pass
    yield t


def tracing_for_compile() -> bool:
    """Whether the policy is being called while torch.compile traces (outputs are symbolic)."""
    try:
        return torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.PROXY) is not None
    except Exception:  # noqa: BLE001
        return torch.compiler.is_compiling()


# ---------------------------------------------------------------------------
# Which module is running (for module-name patterns)
# ---------------------------------------------------------------------------

_WRAPPER_ATTRS = frozenset({"L", "G", "self", "_checkpoint_wrapped_module", "_orig_mod", "_fsdp_wrapped_module"})


def module_path(name: str) -> str:
    """A module path relative to the traced block from a dynamo source name such as
    `L['self'].__dict__['_modules']['_checkpoint_wrapped_module'].feed_forward.w3`."""
    name = re.sub(r"(?:\.__dict__)?(?:\._modules|\[['\"]_modules['\"]\])\[['\"]([^'\"]+)['\"]\]", r".\1", name)
    name = re.sub(r"\[['\"]([^'\"]+)['\"]\]", r".\1", name)
    return ".".join(p for p in name.split(".") if p and p not in _WRAPPER_ATTRS)


# Modules whose matmuls are force-recomputed -> their full name; and the names of those
# currently executing. Maintained by one pair of *global* module hooks: per-module hooks
# would have distinct ids per block, which dynamo guards on, recompiling every block.
_FORCED_MODULES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_FORCED_STACK: list[str] = []
_GLOBAL_HOOKS: list = []


def _forced_pre_hook(module, args):
    if torch.compiler.is_compiling():  # traced away under compile; see ModuleScope.current
        return
    name = _FORCED_MODULES.get(module)
    if name is not None:
        _FORCED_STACK.append(name)


def _forced_post_hook(module, args, output):
    if torch.compiler.is_compiling():
        return
    if _FORCED_STACK and _FORCED_MODULES.get(module) is not None:
        _FORCED_STACK.pop()


def _ensure_global_hooks() -> None:
    if not _GLOBAL_HOOKS:
        from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
        _GLOBAL_HOOKS.append(register_module_forward_pre_hook(_forced_pre_hook))
        _GLOBAL_HOOKS.append(register_module_forward_hook(_forced_post_hook, always_call=True))


class ModuleScope:
    """Knows whether execution is inside a module whose name matches one of `patterns`.

    In eager mode, global forward pre/post hooks keep a stack of the matching modules
    being run; this is right in the forward and also in the recompute (which re-runs
    the same module calls) on torch releases that call the policy there. Under
    torch.compile the hooks are traced away and the policy runs while AOTAutograd
    traces the graph: there the current FX node's `nn_module_stack` is read instead.
    Patterns match the module name relative to the block (`feed_forward.w3`) or with
    the block's prefix (`layers.3.feed_forward.w3`).
    """

    def __init__(self, patterns: tuple[str, ...]):
        self.patterns = tuple(p for p in patterns if p)
        self.prefix = ""
        self.modules: list[nn.Module] = []

    def matches(self, *names: str) -> bool:
        return any(fnmatch.fnmatchcase(n, p) for n in names if n for p in self.patterns)

    def install(self, block: nn.Module, prefix: str) -> int:
        self.prefix = prefix
        for rel, mod in block.named_modules():
            full = f"{prefix}.{rel}" if prefix and rel else (prefix or rel)
            if self.matches(rel, full):
                _FORCED_MODULES[mod] = full
                self.modules.append(mod)
        if self.modules:
            _ensure_global_hooks()
        return len(self.modules)

    def remove(self) -> None:
        for mod in self.modules:
            _FORCED_MODULES.pop(mod, None)
        self.modules.clear()

    def current(self) -> str | None:
        if not self.patterns:
            return None
        if _FORCED_STACK:
            return _FORCED_STACK[-1]
        try:  # under compile: the node being traced knows its module path
            import torch.fx.traceback as fx_traceback
            meta = fx_traceback.get_current_meta() if hasattr(fx_traceback, "get_current_meta") else None
            for key, val in ((meta or {}).get("nn_module_stack") or {}).items():
                rel = module_path(val[0] if isinstance(val, tuple) else str(key))
                if self.matches(rel, f"{self.prefix}.{rel}" if self.prefix and rel else rel):
                    return rel
        except Exception:  # noqa: BLE001
            pass
        return None


# ---------------------------------------------------------------------------
# The per-call policy function of op-level SAC
# ---------------------------------------------------------------------------

class OpSACPolicy:
    """Policy function for `torch.utils.checkpoint.create_selective_checkpoint_contexts`.

    One instance serves one checkpointed call of one block (the context_fn builds a
    fresh one on every call, so its counts reset per call). It holds the per-call state
    (the matmul count per pass, the module scope) and asks its `rules` (an
    `activation_checkpoint.OpSAC`) to `decide` each op. The matmul count is keyed on
    `ctx.is_recompute`: torch releases that call the policy again in the recompute then
    start that pass from zero too, so both passes agree even with an odd matmul count.
    (torch 2.13 only calls it in the forward.)

    Why the hot path is shaped this way: the policy runs in Python once per aten op of
    every block's forward, so its per-op work is CPU launch time on a GPU. Decisions that
    depend on the op alone are made once per block, not once per call: `table` (shared
    by every call of one wrapped block) maps `id(op)` to the verdict, or to None for the
    rules' `dynamic_ops`, which are decided per call. Ops are looked up by `id` because an
    `OpOverload`'s `__hash__` is Python code. Our caching mode (`make_sac_modes`) calls
    `forward_op` with torch's own invocation index, so no context object is built.
    """

    def __init__(self, save_ops: frozenset, *, rules, scope: ModuleScope | None = None, trace: bool = False,
                 explicit_save_ops: frozenset = frozenset(), info: dict | None = None, table: dict | None = None,
                 fast: dict | None = None):
        if rules is None:
            raise TypeError("OpSACPolicy needs its rules (an activation_checkpoint.OpSAC)")
        self.info = info or {}  # what the rules noted about the block (OpSAC.block_info)
        self.save_ops = save_ops
        self.explicit_save_ops = frozenset(op_key(op) for op in explicit_save_ops)
        self.scope = scope
        self.trace = trace
        self.rules = rules
        self.table = {} if table is None else table
        self.mm_count = {False: 0, True: 0}
        # Per pass, id(op) -> invocation index (for the public policy-function path).
        self._counts: tuple[dict, dict] = ({}, {})
        self.index = 0  # of the op being decided
        self.last_mm: tuple | None = None  # (op, index, saved?) of the latest matmul in the forward
        self.skipped: list = []  # (op, index, Placeholder) for the "SKIP" verdicts
        self.compiled: bool | None = None  # known at the first op
        hook = type(rules).observe
        self._observe = None if getattr(hook, "_no_op", False) else rules.observe
        # What this call hands to `ac_dce.PACK_LISTENERS` while its forward runs: registered
        # when the forward mode is entered (`open`), not here. torch's checkpoint builds the
        # contexts of a no-grad forward (validation) too, and then never enters them: listeners
        # registered here stayed for good, and each kept every pack of every later block that
        # ran through torch's checkpoint (a leak that grew every step).
        self.listening: list = []
        rules.start_call(self)
        # The recompute plan (ac_dce): applied if the block has one, else this call records one.
        self.plan_key = self.info.get("plan_key")
        plans = getattr(rules, "plans", None)
        self.plan = plans.get(self.plan_key) if plans is not None else None
        self.keep = self.plan.keep if self.plan is not None and not self.plan.disabled else None
        self.recorder = None
        self.made: RecomputePlan | None = None  # the plan this call recorded
        self.expected: list | None = None  # the ops its recompute must dispatch, in order
        self.checked = 0
        if plans is not None and self.plan is None and self.plan_key is not None and rules.decisions_final(self):
            self.recorder = CallRecorder(scalars=scalar_state(self.info.get("block")))
            self.listening.append(self.recorder.on_pack)
        # id(op) -> policy for the ops decided once per block that need no per-call work (not
        # matmuls, no plan entry, no SKIP): the caching mode then does not call `forward_op`.
        # One per plan (its entries depend on the plan) or per block; none while recording,
        # tracing or observing, which see every op.
        self.fast = None
        if self.recorder is None and not trace and self._observe is None:
            self.fast = self.plan.fast if self.plan is not None else fast
        # The first call that applies the plan notes what autograd packs, to build the plan's
        # replay (ac_replay): the calls after it run their forward without a dispatch mode.
        self.packs: list | None = None
        if self.keep is not None and not self.plan.replay_tried and not trace and getattr(rules, "replay_forward", False):
            self.packs = []
            self.listening.append(self.packs.append)

    def open(self) -> None:
        """Called when the call's forward mode is entered: its pack listeners start listening
        (until `finish`, when the forward ends)."""
        PACK_LISTENERS.extend(self.listening)
        if self.recorder is not None:
            INPUT_LISTENERS.append(self.recorder.on_inputs)

    def _entry(self, func, args, out) -> tuple:
        """(func, static decision or None, is a matmul) for `func`, made once per block."""
        entry = self.table.get(id(func))
        if entry is None or entry[0] is not func:
            rules, key = self.rules, op_key(func)
            static = None
            if rules.cache_decisions and key not in rules.dynamic_ops:
                static = rules.decide(self, func, False, args, out)
            entry = self.table[id(func)] = (func, static, key in MATMUL_OPS)
        return entry

    def decide(self, func, is_recompute: bool, args=(), out=None):
        """(CheckpointPolicy, verdict, note) for one op (`self.index` is its invocation
        index); advances the matmul count."""
        static = self._entry(func, args, out)[1]
        return static if static is not None else self.rules.decide(self, func, is_recompute, args, out)

    def forward_op(self, func, index: int, args, kwargs, out, is_recompute: bool = False):
        """The policy for one op (its `index`-th call in this pass); notes what `finish`
        and the rules need."""
        self.index = index
        _, static, is_mm = self._entry(func, args, out)
        policy, verdict, note = static if static is not None else \
            self.rules.decide(self, func, is_recompute, args, out)
        keep = self.keep
        if keep is not None:
            indices = keep.get(id(func))
            if indices is not None and index in indices:
                policy = _MUST_SAVE  # kept by the plan (or cached until the forward ends, then a Placeholder)
        if self.trace:
            trace(func, verdict, note)
        elif self.fast is not None and static is not None and not is_mm and verdict != "SKIP" and \
                (keep is None or id(func) not in keep):
            self.fast[id(func)] = policy
        if not is_recompute:
            if self.compiled is None:
                self.compiled = tracing_for_compile()
                if self.compiled:
                    self._stop_recording()
            if self.recorder is not None:
                self.recorder.on_op(func, index, args, kwargs, out, policy in _SAVE_POLICIES, verdict)
            if is_mm:
                self.last_mm = (func, index, policy is _MUST_SAVE)
            if verdict == "SKIP" and isinstance(out, torch.Tensor):
                self.skipped.append((func, index, Placeholder(out)))
            if self._observe is not None:
                self._observe(self, func, args, kwargs, out, policy)
        return policy

    def __call__(self, ctx, func, *args, **kwargs):
        # The public policy-function API (torch's own modes, e.g. under compile).
        is_recompute = bool(getattr(ctx, "is_recompute", False))
        counts = self._counts[is_recompute]
        index = counts.get(id(func), 0)
        counts[id(func)] = index + 1
        return self.forward_op(func, index, args, kwargs, getattr(ctx, "op_output", None), is_recompute)

    def check_recompute(self, func) -> bool:
        """Called by the recording call's recompute with each op it dispatches (see
        `make_sac_modes`); returns whether to go on. A plan names cache entries by per-op
        invocation index, so it holds only if the recompute dispatches the recorded ops in
        the recorded order; if not, the block gets no plan (and a warning)."""
        expected, i = self.expected, self.checked
        if expected is None:
            return False
        if i < len(expected) and expected[i] is func:
            self.checked = i + 1
            return self.checked < len(expected)
        plans = self.rules.plans
        if self.made is not None and plans.get(self.plan_key) is self.made:
            why = (f"its recompute dispatched {func} where its forward dispatched "
                   f"{expected[i] if i < len(expected) else 'nothing more'} (op {i})")
            plans[self.plan_key] = RecomputePlan({}, [], [], dict(self.made.counts), [], 0, disabled=why)
            logger.warning("activation checkpointing: %s: no recompute plan, %s", self.info.get("prefix", ""), why)
        return False

    def _stop_recording(self) -> CallRecorder | None:
        rec, self.recorder = self.recorder, None
        if rec is not None and rec.on_pack in PACK_LISTENERS:
            PACK_LISTENERS.remove(rec.on_pack)
        if rec is not None and rec.on_inputs in INPUT_LISTENERS:
            INPUT_LISTENERS.remove(rec.on_inputs)
        return rec

    def _stop_noting_packs(self) -> list | None:
        packs, self.packs = self.packs, None
        if packs is not None and packs.append in PACK_LISTENERS:
            PACK_LISTENERS.remove(packs.append)
        return packs

    def _apply_plan(self, storage, counts) -> bool:
        """Records this call's plan, or applies the block's (see `ac_dce`); returns whether
        it applied one."""
        from torch.utils.checkpoint import _RECOMPUTE, _VersionWrapper
        rec = self._stop_recording()
        if rec is not None:
            rec.alive.clear()
            if rec.stop and counts is not None:
                rec.counts = dict(counts)
                plan = self.rules.plans[self.plan_key] = make_plan(rec, self.rules.plan_attention_ops(),
                                                                   **self.rules.plan_options())
                self.made, self.expected = plan, [e.func for e in rec.events[:rec.stop]]
                if self.trace:
                    prefix = self.info.get("prefix", "")
                    trace_line(f"plan {self.plan_key}", f"PLAN {prefix}: {plan.describe()}")
            return False
        plan = self.plan
        if plan is None or plan.disabled:
            return False
        if counts is None or dict(counts) != plan.counts:  # another op sequence: recompute as without a plan
            for func, index in plan.forced:
                if index in storage.get(func, {}):
                    storage[func][index] = _RECOMPUTE
            self.rules.plans.pop(self.plan_key, None)  # and record it again
            return False
        for func, index in plan.placeholders:
            entry = storage.get(func, {}).get(index)
            if type(entry) is _VersionWrapper and isinstance(entry.val, torch.Tensor):
                storage[func][index] = Placeholder(entry.val)
        for func, index in plan.inplace:
            if index in storage.get(func, {}):
                storage[func][index] = INPLACE_SKIP
        return True

    def finish(self, storage, counts=None) -> None:
        """Called when the checkpointed forward ends, with torch's SAC storage (and the
        per-op counts of the forward).

        The output of the block's last matmul (`w2`, `shared_experts.w2`) is released:
        the non-reentrant checkpoint stops its recompute once backward has every tensor
        it needs, which is before that matmul, so nothing ever reads the cached copy. (An
        entry marked recompute is always safe: were the recompute to reach it, the op
        would simply run.) Then what the cache keeps is reported to `SAC_CACHE_LISTENERS`.
        Ops the rules marked "SKIP" (their output is read by nothing the recompute or
        backward runs) get a `Placeholder` entry: the recompute does not run them. Under
        torch.compile the partitioner owns the saved set, and nothing is done.
        """
        if self.compiled:
            self._stop_recording()
            self._stop_noting_packs()
            return
        from torch.utils.checkpoint import _RECOMPUTE
        if self.last_mm is not None and self.last_mm[2]:
            func, index, _ = self.last_mm
            if index in storage.get(func, {}):
                storage[func][index] = _RECOMPUTE
        applied = self._apply_plan(storage, counts)
        for func, index, placeholder in self.skipped:
            if storage.get(func, {}).get(index) is _RECOMPUTE:
                storage[func][index] = placeholder
        if self.rules is not None:
            self.rules.end_call(self, storage)
        packs = self._stop_noting_packs()
        if packs is not None and applied and self.rules.plans.get(self.plan_key) is self.plan:
            self.plan.replay_tried = True
            if getattr(self, "calibration", None) is None:  # (budget: a measuring call is no template)
                plan = self.plan
                plan.replay = build_replay(storage, packs)
                if plan.replay is not None and getattr(self.rules, "direct_recompute", False):
                    plan.direct = build_direct(plan.source, [(f, i) for f, i, *_ in plan.replay.kept],
                                               plan.replay.metas)
        if SAC_CACHE_LISTENERS:
            kept = kept_tensors(storage)
            for listener in SAC_CACHE_LISTENERS:
                listener.add(kept, "sac_cache")
