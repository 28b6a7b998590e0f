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
from collections import defaultdict

import torch
import torch.nn as nn

from parallelisms.ac_ops import MATMUL_OPS, is_runtime_op, op_key
from parallelisms.ac_trace import trace

# Objects with `add(obj, source)` that want every tensor the SAC cache keeps
# (ac_measure.SavedActivationCounter registers itself while it is active).
SAC_CACHE_LISTENERS: list = []


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
    (the matmul count per pass, the module scope) and asks its `rules` (an `OpSAC`, or
    the default one) to `decide` each op. The matmul count is keyed on
    `ctx.is_recompute`: torch releases that call the policy again in the recompute then
    start that pass from zero too, so both passes agree even with an odd matmul count.
    (torch 2.13 only calls it in the forward.)
    """

    def __init__(self, save_ops: frozenset, *, scope: ModuleScope | None = None, trace: bool = False,
                 explicit_save_ops: frozenset = frozenset(), rules=None, info: dict | None = None):
        self.info = info or {}  # what the rules noted about the block (OpSAC.block_info)
        self.save_ops = save_ops
        self.explicit_save_ops = frozenset(op_key(op) for op in explicit_save_ops)
        self.scope = scope
        self.trace = trace
        self.rules = rules
        self.mm_count = {False: 0, True: 0}
        # Per pass and op: its invocation index, as torch's SAC storage keys its entries.
        self.op_index: dict = {False: defaultdict(int), True: defaultdict(int)}
        self.index = 0  # of the op being decided
        self.last_mm: tuple | None = None  # (op, index, saved?) of the latest matmul in the forward
        self.skipped: list = []  # (op, index, Placeholder) for the "SKIP" verdicts
        self._static: dict = {}
        self.compiled: bool | None = None  # known at the first op
        if rules is not None:
            rules.start_call(self)

    def decide(self, func, is_recompute: bool, args=(), out=None):
        """(CheckpointPolicy, verdict, note) for one op; advances the matmul count.
        Decisions that depend on the op alone are remembered for the rest of the call
        (a block runs each element-wise op many times; the policy runs in Python)."""
        known = self._static.get(func)
        if known is not None:
            return known
        if self.rules is None:  # a policy function built on its own: the default op-level rules
            from parallelisms.activation_checkpoint import ActivationCheckpointConfig, OpSAC
            self.rules = OpSAC(ActivationCheckpointConfig(mode="op"))
        decision = self.rules.decide(self, func, is_recompute, args, out)
        if self.rules.cache_decisions and op_key(func) not in self.rules.dynamic_ops:
            self._static[func] = decision
        return decision

    def __call__(self, ctx, func, *args, **kwargs):
        from torch.utils.checkpoint import CheckpointPolicy as P
        is_recompute = bool(getattr(ctx, "is_recompute", False))
        self.index = self.op_index[is_recompute][func]
        self.op_index[is_recompute][func] += 1
        out = getattr(ctx, "op_output", None)
        policy, verdict, note = self.decide(func, is_recompute, args, out)
        if self.trace:
            trace(func, verdict, note)
        if not is_recompute:
            if self.compiled is None:
                self.compiled = tracing_for_compile()
            if op_key(func) in MATMUL_OPS:
                self.last_mm = (func, self.index, policy is P.MUST_SAVE)
            if verdict == "SKIP" and isinstance(out, torch.Tensor):
                self.skipped.append((func, self.index, Placeholder(out)))
            if self.rules is not None:
                self.rules.observe(self, func, args, kwargs, out, policy)
        return policy

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
    """create_selective_checkpoint_contexts(policy), with three additions in eager mode:

    - runtime ops bypass the cache (on torch 2.13 the recompute replays the cache by
      per-op index without calling the policy, so an op that only one pass runs must
      not be counted);
    - when the forward ends, `policy.finish(storage)` may release cache entries that
      the recompute never reads (see `OpSACPolicy.finish`) and reports what is kept;
    - a cache entry that is a `Placeholder` is answered in the recompute with an empty
      tensor of the recorded shape instead of running the op (its value is never read).
    """
    from torch.utils.checkpoint import create_selective_checkpoint_contexts
    fwd, rec = create_selective_checkpoint_contexts(policy)
    for mode in (fwd, rec):
        cls = _MODE_CLASSES.get(type(mode))
        if cls is not None:
            mode.__class__ = cls
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


def _mode_classes() -> dict:
    try:
        from torch.utils.checkpoint import _CachedTorchDispatchMode, _CachingTorchDispatchMode, _is_compiling
    except ImportError:  # pragma: no cover - older torch: the policy's PREFER_RECOMPUTE still applies
        return {}
    try:
        from torch.utils.checkpoint import _sac_storage_key
    except ImportError:  # pragma: no cover
        def _sac_storage_key(func, args):
            return func

    class _Caching(_CachingTorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if is_runtime_op(func) and not _is_compiling(func, args, kwargs):
                return func(*args, **(kwargs or {}))
            return super().__torch_dispatch__(func, types, args, kwargs)

        def __exit__(self, *exc):
            finish = getattr(self.policy_fn, "finish", None)
            if finish is not None:
                finish(self.storage)
            return super().__exit__(*exc)

    class _Cached(_CachedTorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if is_runtime_op(func) and not _is_compiling(func, args, kwargs):
                return func(*args, **(kwargs or {}))
            key = _sac_storage_key(func, args)
            entry = self.storage.get(key, {}).get(self.func_counter[key])
            if isinstance(entry, Placeholder):
                self.func_counter[key] += 1
                return entry.make()
            return super().__torch_dispatch__(func, types, args, kwargs)

    return {_CachingTorchDispatchMode: _Caching, _CachedTorchDispatchMode: _Cached}


_MODE_CLASSES = _mode_classes()
