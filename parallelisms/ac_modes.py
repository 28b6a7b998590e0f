"""The SAC dispatch modes of op-level checkpointing: torch's caching pair, with less Python per op.

Why a module of its own: torch's `create_selective_checkpoint_contexts` gives a pair of
dispatch modes (the forward caches op outputs by per-op invocation index; the recompute
replays them by the same index). Ours subclass them to

- call the policy (`ac_sac.OpSACPolicy.forward_op`) directly with torch's index, and look
  each op's kind up by `id` (an `OpOverload`'s hash is Python code);
- let runtime ops and parameter casts bypass the cache: either pass may run them when the
  other does not, and counted they would shift the invocation index of every later call
  of the same op;
- answer `Placeholder` and in-place-skip entries in the recompute without running the op;
- call `policy.open()` when the forward starts and `policy.finish(storage, counts)` when it ends.

Only private torch names are used here (guarded: on a torch without them the plain
modes run). Under torch.compile, torch's own code runs.
"""

from __future__ import annotations

import torch

from torch.utils.checkpoint import CheckpointPolicy

from parallelisms.ac_dce import INPLACE_SKIP
from parallelisms.ac_ops import is_runtime_op

_SAVE_POLICIES = (CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_SAVE)


def make_sac_modes(policy) -> tuple:
    """create_selective_checkpoint_contexts(policy), with these changes in eager mode:

    - runtime ops and parameter casts bypass the cache (on torch 2.13 the recompute
      replays the cache by per-op index without calling the policy, so an op that only
      one pass runs must not be counted);
    - when the forward starts, `policy.open()` registers its pack listeners (a no-grad
      forward, which torch's checkpoint runs without entering the modes, registers none);
    - when the forward ends, `policy.finish(storage, counts)` may release cache entries
      that the recompute never reads (see `OpSACPolicy.finish`) and reports what is kept;
    - a `Placeholder` entry is answered in the recompute with an empty tensor of the
      recorded shape instead of running the op (its value is never read);
    - a policy with `forward_op` (an `OpSACPolicy`) is called with torch's invocation
      index, or not at all for the ops in its `fast` table; each op's kind, storage
      entries and recompute index are found by `id` in a per-call `slots` table: the
      same cache, with less Python per op. While torch.compile traces, torch's code runs.
    """
    from torch.utils.checkpoint import create_selective_checkpoint_contexts
    fwd, rec = create_selective_checkpoint_contexts(policy)
    for mode in (fwd, rec):
        cls = _MODE_CLASSES.get(type(mode))
        if cls is not None:
            mode.__class__ = cls
    fwd.forward_op = getattr(policy, "forward_op", None)
    fwd.fast = getattr(policy, "fast", None)
    fwd.slots, rec.slots = {}, {}
    if getattr(policy, "recorder", None) is not None:  # the call that records a recompute plan
        rec.check = policy.check_recompute
    return fwd, rec


def make_replay_mode():
    """The recompute mode alone, for a forward that ran without one (`ac_replay`): its
    storage is set when that forward ends."""
    from torch.utils.checkpoint import _CachedTorchDispatchMode
    mode = _CachedTorchDispatchMode(None, {}, False)
    cls = _MODE_CLASSES.get(type(mode))
    if cls is None:  # pragma: no cover - no replay without our modes (ac_sac checks)
        raise RuntimeError("this torch has no SAC dispatch modes to replay with")
    mode.__class__ = cls
    mode.slots = {}
    return mode


class Placeholder:
    """A SAC cache entry standing for an op output that backward never reads: the
    recompute gets an uninitialised tensor with the same metadata (shape, stride, dtype,
    device), so the checkpoint's metadata check passes and no FLOP is spent."""

    __slots__ = ("size", "stride", "dtype", "device")

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
_PLAIN, _BYPASS, _GENERIC, _CAST = 0, 1, 2, 3
_OP_KINDS: dict[int, tuple] = {}
_TO_COPY = torch.ops.aten._to_copy.default


def is_param_cast(args) -> bool:
    """A cast autocast may cache: of an fp32 leaf that requires grad (a parameter; autocast's
    weight casts). Autocast caches these per region, so a recompute inside the forward's
    autocast region (backward under the step's autocast) dispatches none of them, and one that
    starts a new region dispatches them all: counted, they would shift every later cast's
    invocation index, and a cache entry kept by index (a recompute plan's, a budget's) would
    be handed to the wrong cast. Autocast caches fp32 sources only: a bf16 leaf's `.float()`
    (RMSNorm on a pipeline stage's received input under bf16 params) dispatches in both passes
    and is an op like any other (bypassed, the direct recompute held its fp32 output)."""
    x = args[0] if args else None
    return isinstance(x, torch.Tensor) and x.dtype == torch.float32 and x.requires_grad and x.is_leaf \
        and not x._is_view()


def _op_kind(func, ignored) -> int:
    """_BYPASS for the ops that never reach the cache (torch's `SAC_IGNORED_OPS`, runtime
    ops), _CAST for `_to_copy` (bypassed when `is_param_cast`), _PLAIN for the other
    `OpOverload`s (their storage key is the op itself), and _GENERIC for anything else
    (HOPs, whose key torch computes from the arguments)."""
    known = _OP_KINDS.get(id(func))
    if known is not None and known[0] is func:
        return known[1]
    if func in ignored or is_runtime_op(func):
        kind = _BYPASS
    elif func is _TO_COPY:
        kind = _CAST
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

    _get_mode, _PROXY = torch._C._get_dispatch_mode, torch._C._TorchDispatchModeKey.PROXY

    def tracing(func, args, kwargs) -> bool:  # torch's `_is_compiling`, its C check first (eager: one call)
        return _get_mode(_PROXY) is not None and _is_compiling(func, args, kwargs)

    def slot_of(mode, func) -> list:
        """[func, kind, its storage entries (plain ops), next invocation index, callable]:
        made once per op and call, found by `id` (an OpOverload's hash is Python code)."""
        kind = _op_kind(func, SAC_IGNORED_OPS)
        entries = mode.storage[func] if mode.creates and kind in (_PLAIN, _CAST) else mode.storage.get(func)
        # The op's C++ callable (one Python frame less), unless a subclass has its own __call__.
        call = func._op if type(func) is torch._ops.OpOverload else func
        slot = mode.slots[id(func)] = [func, kind, entries, 0, call]
        return slot

    class _Caching(_CachingTorchDispatchMode):
        forward_op = None
        # id(op) -> policy, for ops whose decision is the same in every call and needs no
        # per-call work (`OpSACPolicy.fast`); None: ask `forward_op` for every op.
        fast = None
        creates = True

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if tracing(func, args, kwargs):
                return super().__torch_dispatch__(func, types, args, kwargs)
            slot = self.slots.get(id(func))
            if slot is None or slot[0] is not func:
                slot = slot_of(self, func)
            kind = slot[1]
            if kind == _CAST:
                kind = _BYPASS if is_param_cast(args) else _PLAIN
            if kind == _BYPASS:
                return func(*args, **kwargs) if kwargs else func(*args)
            if kind == _GENERIC or self.forward_op is None:
                return super().__torch_dispatch__(func, types, args, kwargs)
            # torch's caching step for an OpOverload: the entry's index is its invocation index.
            out = slot[4](*args, **kwargs) if kwargs else slot[4](*args)
            entries = slot[2]
            index = len(entries)
            fast = self.fast
            policy = None if fast is None else fast.get(id(func))
            if policy is None:
                policy = self.forward_op(func, index, args, kwargs or {}, out)
            if policy in _SAVE_POLICIES:
                entries[index] = _wrap(out) if isinstance(out, torch.Tensor) else tree_map(_wrap, out)
            else:
                entries[index] = _RECOMPUTE
            return out

        def __enter__(self):
            opened = getattr(self.policy_fn, "open", None)
            if opened is not None:  # (its pack listeners: only while this forward runs)
                opened()
            return super().__enter__()

        def __exit__(self, *exc):
            finish = getattr(self.policy_fn, "finish", None)
            if finish is not None:  # per-op counts: one storage entry per call of each op (casts
                # of parameters only, all bypassed, leave an empty one: not counted)
                finish(self.storage, {key: len(entries) for key, entries in self.storage.items() if entries})
            return super().__exit__(*exc)

    class _Cached(_CachedTorchDispatchMode):
        check = None  # (func) -> bool: go on checking (the recording call of a recompute plan)
        creates = False
        run_all = False  # run every op (a replayed forward that ran other ops: `ac_replay`)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if self.run_all:
                return func(*args, **(kwargs or {}))
            if tracing(func, args, kwargs):
                return super().__torch_dispatch__(func, types, args, kwargs)
            slot = self.slots.get(id(func))
            if slot is None or slot[0] is not func:
                slot = slot_of(self, func)
            kind = slot[1]
            if kind == _CAST:
                kind = _BYPASS if is_param_cast(args) else _PLAIN
            if kind == _BYPASS:
                return func(*args, **kwargs) if kwargs else func(*args)
            if self.check is not None and not self.check(func):
                self.check = None
            if kind == _GENERIC:
                return self._generic(func, types, args, kwargs)
            index, entries = slot[3], slot[2]
            entry = None if entries is None else entries.get(index)
            if entry is None or entry is _CONSUMED:  # torch raises its own error
                self.func_counter[func] = index
                return super().__torch_dispatch__(func, types, args, kwargs)
            slot[3] = index + 1
            if entry is _RECOMPUTE:
                return slot[4](*args, **kwargs) if kwargs else slot[4](*args)
            if type(entry) is Placeholder:
                return entry.make()
            if entry is INPLACE_SKIP:
                return args[0]
            entries[index] = _CONSUMED
            if type(entry) is _VersionWrapper:
                return entry.get_val(self.allow_cache_entry_mutation)
            return tree_map(lambda x: x.get_val(self.allow_cache_entry_mutation), entry)

        def _generic(self, func, types, args, kwargs):
            """A HOP: its storage key comes from its arguments (torch's path, with our
            cache entries)."""
            key = _sac_storage_key(func, args)
            index = self.func_counter[key]
            entries = self.storage.get(key)
            entry = None if entries is None else entries.get(index)
            if entry is None or entry is _CONSUMED or entry is _RECOMPUTE or type(entry) is _VersionWrapper:
                return super().__torch_dispatch__(func, types, args, kwargs)
            self.func_counter[key] = index + 1
            if type(entry) is Placeholder:
                return entry.make()
            return args[0]  # INPLACE_SKIP

    return {_CachingTorchDispatchMode: _Caching, _CachedTorchDispatchMode: _Cached}


_MODE_CLASSES = _mode_classes()
