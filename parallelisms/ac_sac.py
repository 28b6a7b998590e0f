"""Glue between our op-level policies and torch's selective checkpointing (SAC) internals.

Why a module of its own: torch's SAC (`create_selective_checkpoint_contexts`) is a pair
of dispatch modes that cache op outputs by per-op invocation index, driven by a policy
function. `OpSACPolicy` is that function for one checkpointed call (its rules come from
an `activation_checkpoint.OpSAC`). What the policies need beyond torch's public API
lives here, behind guards:

- runtime ops (FSDP2's copy-in / split copies, legacy c10d collectives, the profiler's
  record_function ops) bypass the cache, because either pass may run them when the
  other does not;
- when a forward ends, cache entries the recompute never reads are released, and
  whoever counts what the cache holds (`ac_measure.SavedActivationCounter`) is told
  through `SAC_CACHE_LISTENERS`, so the training path never imports the counters;
- a cache entry can be a `Placeholder` that the recompute answers without running the op;
- force-recompute patterns need to know which module is running, in eager mode (global
  module hooks) and under compile (the traced node's `nn_module_stack`): `ModuleScope`.
"""

from __future__ import annotations

import fnmatch
import re
import weakref

import torch
import torch.nn as nn
from torch.utils.checkpoint import CheckpointPolicy

from parallelisms.ac_ops import MATMUL_OPS, is_runtime_op, op_key
from parallelisms.ac_trace import trace

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
                 explicit_save_ops: frozenset = frozenset(), info: dict | None = None, table: dict | None = None):
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
        rules.start_call(self)

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
        if self.trace:
            trace(func, verdict, note)
        if not is_recompute:
            if self.compiled is None:
                self.compiled = tracing_for_compile()
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

    def finish(self, storage) -> None:
        """Called when the checkpointed forward ends, with torch's SAC storage.

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
            return
        from torch.utils.checkpoint import _RECOMPUTE
        if self.last_mm is not None and self.last_mm[2]:
            func, index, _ = self.last_mm
            if index in storage.get(func, {}):
                storage[func][index] = _RECOMPUTE
        for func, index, placeholder in self.skipped:
            if storage.get(func, {}).get(index) is _RECOMPUTE:
                storage[func][index] = placeholder
        if self.rules is not None:
            self.rules.end_call(self, storage)
        if SAC_CACHE_LISTENERS:
            kept = kept_tensors(storage)
            for listener in SAC_CACHE_LISTENERS:
                listener.add(kept, "sac_cache")


# ---------------------------------------------------------------------------
# The SAC dispatch modes
# ---------------------------------------------------------------------------

def make_sac_modes(policy) -> tuple:
    """create_selective_checkpoint_contexts(policy), with four additions in eager mode:

    - runtime ops bypass the cache (on torch 2.13 the recompute replays the cache by
      per-op index without calling the policy, so an op that only one pass runs must
      not be counted);
    - when the forward ends, `policy.finish(storage)` may release cache entries that
      the recompute never reads (see `OpSACPolicy.finish`) and reports what is kept;
    - a cache entry that is a `Placeholder` is answered in the recompute with an empty
      tensor of the recorded shape instead of running the op (its value is never read);
    - a policy with `forward_op` (an `OpSACPolicy`) is called with torch's invocation
      index, and each op's kind is looked up by `id` (see `_op_kind`): the same cache,
      with less Python per op. While torch.compile traces, torch's own code runs.
    """
    from torch.utils.checkpoint import create_selective_checkpoint_contexts
    fwd, rec = create_selective_checkpoint_contexts(policy)
    for mode in (fwd, rec):
        cls = _MODE_CLASSES.get(type(mode))
        if cls is not None:
            mode.__class__ = cls
    fwd.forward_op = getattr(policy, "forward_op", None)
    return fwd, rec


class Placeholder:
    """A SAC cache entry standing for an op output that backward never reads: the
    recompute gets an uninitialised tensor with the same metadata (shape, stride, dtype,
    device), so the checkpoint's metadata check passes and no FLOP is spent."""

    def __init__(self, out: torch.Tensor):
        self.size, self.stride, self.dtype, self.device = out.size(), out.stride(), out.dtype, out.device

    def make(self) -> torch.Tensor:
        return torch.empty_strided(self.size, self.stride, dtype=self.dtype, device=self.device)


def kept_tensors(storage) -> list[torch.Tensor]:
    """The tensors a SAC storage (torch 2.13 layout: {key: {index: entry}}) keeps alive."""
    from torch.utils._pytree import tree_leaves
    out = []
    for entries in storage.values():
        for entry in entries.values():
            out += [leaf.val for leaf in tree_leaves(entry) if isinstance(getattr(leaf, "val", None), torch.Tensor)]
    return out


# What the modes do with an op, by id(op) (see `_op_kind`).
_PLAIN, _BYPASS, _GENERIC = 0, 1, 2
_OP_KINDS: dict[int, tuple] = {}


def _op_kind(func, ignored) -> int:
    """_BYPASS for the ops that never reach the cache (torch's `SAC_IGNORED_OPS`, runtime
    ops), _PLAIN for the other `OpOverload`s (their storage key is the op itself), and
    _GENERIC for anything else (HOPs, whose key torch computes from the arguments)."""
    known = _OP_KINDS.get(id(func))
    if known is not None and known[0] is func:
        return known[1]
    if func in ignored or is_runtime_op(func):
        kind = _BYPASS
    else:
        kind = _PLAIN if isinstance(func, torch._ops.OpOverload) else _GENERIC
    _OP_KINDS[id(func)] = (func, kind)
    return kind


def _mode_classes() -> dict:
    try:
        from torch.utils.checkpoint import (
            _CONSUMED,
            _RECOMPUTE,
            SAC_IGNORED_OPS,
            _CachedTorchDispatchMode,
            _CachingTorchDispatchMode,
            _detach_helper,
            _is_compiling,
            _VersionWrapper,
        )
    except ImportError:  # pragma: no cover - older torch: the policy's PREFER_RECOMPUTE still applies
        return {}
    try:
        from torch.utils.checkpoint import _sac_storage_key
    except ImportError:  # pragma: no cover
        def _sac_storage_key(func, args):
            return func
    from torch.utils._pytree import tree_map

    def _wrap(x):
        return _VersionWrapper(_detach_helper(x))

    class _Caching(_CachingTorchDispatchMode):
        forward_op = None

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if _is_compiling(func, args, kwargs):
                return super().__torch_dispatch__(func, types, args, kwargs)
            kind = _op_kind(func, SAC_IGNORED_OPS)
            if kind == _BYPASS:
                return func(*args, **(kwargs or {}))
            if kind == _GENERIC or self.forward_op is None:
                return super().__torch_dispatch__(func, types, args, kwargs)
            # torch's caching step for an OpOverload, with our policy called directly.
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            counter = self.func_counter
            index = counter[func]
            counter[func] = index + 1
            policy = self.forward_op(func, index, args, kwargs, out)
            if policy in _SAVE_POLICIES:
                self.storage[func][index] = _wrap(out) if isinstance(out, torch.Tensor) else tree_map(_wrap, out)
            else:
                self.storage[func][index] = _RECOMPUTE
            return out

        def __exit__(self, *exc):
            finish = getattr(self.policy_fn, "finish", None)
            if finish is not None:
                finish(self.storage)
            return super().__exit__(*exc)

    class _Cached(_CachedTorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if _is_compiling(func, args, kwargs):
                return super().__torch_dispatch__(func, types, args, kwargs)
            kind = _op_kind(func, SAC_IGNORED_OPS)
            if kind == _BYPASS:
                return func(*args, **(kwargs or {}))
            key = func if kind == _PLAIN else _sac_storage_key(func, args)
            index = self.func_counter[key]
            entries = self.storage.get(key)
            entry = None if entries is None else entries.get(index)
            if entry is None or entry is _CONSUMED:  # torch raises its own error
                return super().__torch_dispatch__(func, types, args, kwargs)
            self.func_counter[key] = index + 1
            if entry is _RECOMPUTE:
                return func(*args, **(kwargs or {}))
            if type(entry) is Placeholder:
                return entry.make()
            entries[index] = _CONSUMED
            if type(entry) is _VersionWrapper:
                return entry.get_val(self.allow_cache_entry_mutation)
            return tree_map(lambda x: x.get_val(self.allow_cache_entry_mutation), entry)

    return {_CachingTorchDispatchMode: _Caching, _CachedTorchDispatchMode: _Cached}


_MODE_CLASSES = _mode_classes()
