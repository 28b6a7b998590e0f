"""The recompute of a replayed op-SAC block without a dispatch mode: only the ops backward needs, run directly.

Why: with its forward replayed (`ac_replay`), what is left of op-level SAC's machinery is
the recompute. torch re-runs the block's Python forward under the replaying dispatch mode,
which intercepts every op (about a hundred per Llama block, whether cached, skipped, a view
or recomputed) and builds an autograd graph nobody differentiates, to hand backward the
tensors autograd packed in the forward. On the debug shape that interception cost about as
much as the recomputed matmuls.

What backward needs is known: the packed tensors, in order. From the recorded call
(`ac_dce.CallRecorder`: every op's arguments and outputs by storage and view, every pack
by storage and view) this module works out, once per block:

- which packs the forward keeps as they are (`keep`): those on the storage of an output
  SAC keeps (the plan's kept set, found through the replay) and those on storages from
  outside the block (its input, the weights, the RoPE table): nothing more than SAC keeps;
- which ops must run to rebuild the others (`steps`): backwards from each other pack's
  storage to the op that made it, through its arguments, stopping at kept storages. Views
  are not steps: every argument is rebuilt with `as_strided` on its storage;

and the recompute context, entered by torch's recompute function, runs the steps under
no_grad, hands every pack to the checkpoint's recompute pack hook in order, and stops the
recompute (`_StopRecomputationError`, as torch's early stop does) before the block's own
forward runs. Not built (the replay's dispatch-mode recompute runs instead) when a step
would be a random (attention with dropout), in-place, non-aten or multi-output-with-subclass op, reads a storage
written in place, or a needed storage is neither made in the block nor packed; nor under
autocast. If the forward's packs differ from the replay's, the recompute runs the block's
forward with no mode at all (as `full`, exact).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils._pytree import tree_leaves, tree_unflatten

from parallelisms.ac_dce import PACK_LISTENERS, CallRecorder, Ref, pack_matches
from parallelisms.ac_ops import draws_random


@dataclass
class Direct:
    """What a replayed call keeps and recomputes (see the module docstring)."""

    keep: list  # per pack: True if the forward keeps it as it is
    cached: list  # per pack: kept because SAC keeps its storage (what the byte counters see)
    sources: dict  # storage -> the first kept pack on it (the base of its Refs)
    steps: list  # (op, argument leaves with Refs, spec, output storages) in forward order
    packs: list  # per pack: its Ref
    metas: list  # per pack: (shape, dtype, type of grad_fn), as the replay's

    def contexts(self, listeners: list, on_mismatch) -> tuple:
        """(forward context, recompute context) for `checkpoint(context_fn=...)`;
        `listeners` get the kept tensors of SAC's kept outputs (`ac_sac.SAC_CACHE_LISTENERS`)."""
        recompute = _DirectRecompute(self)
        return _KeepPacks(self, recompute, listeners, on_mismatch), recompute


def build_direct(rec: CallRecorder | None, kept: list, metas: list) -> Direct | None:
    """The direct recompute of a block recorded by `rec` whose plan keeps the outputs of
    `kept` ((op, invocation index) pairs), or None (see the module docstring). `metas`: the
    replay's per-pack metadata, which the recorded packs must match."""
    if rec is None or len(rec.pack_refs) != len(metas) or any(r is None for r in rec.pack_refs):
        return None
    event_of = {(id(e.func), e.index): i for i, e in enumerate(rec.events)}
    kept_keys = set()
    for func, index in kept:
        i = event_of.get((id(func), index))
        if i is None:
            return None
        kept_keys.update(k for k, _ in rec.calls[i][1])
    if torch.is_autocast_enabled("cpu") or (torch.cuda.is_available() and torch.is_autocast_enabled("cuda")):
        return None
    for ref, (shape, dtype, _) in zip(rec.pack_refs, metas):
        if ref.size != shape or ref.dtype != dtype:
            return None
    made = rec.origin
    keep = [r.key in kept_keys or (r.key not in made and r.key not in rec.written) for r in rec.pack_refs]
    sources: dict = {}
    dtypes: dict = {}
    for j, r in enumerate(rec.pack_refs):
        if keep[j]:
            sources.setdefault(r.key, j)
            dtypes.setdefault(r.key, r.dtype)
    needed: set = set()
    todo = [r for j, r in enumerate(rec.pack_refs) if not keep[j]]
    seen: set = set()
    while todo:
        ref = todo.pop()
        if ref.key in sources or ref.key in seen:
            if dtypes.get(ref.key, ref.dtype) != ref.dtype:
                return None
            continue
        seen.add(ref.key)
        i = made.get(ref.key)
        if i is None or ref.key in rec.written:
            return None  # from outside the block and never packed, or written in place
        event = rec.events[i]
        func = event.func
        (leaves, spec), outs = rec.calls[i]
        if not (isinstance(func, torch._ops.OpOverload) and func.namespace == "aten") or func._schema.is_mutable \
                or draws_random(func, *tree_unflatten(leaves, spec)):
            return None
        if any((k is None) for k, _ in outs) or any(leaf is None for leaf in leaves):
            return None
        for k, dt in outs:
            dtypes.setdefault(k, dt)
        if dtypes[ref.key] != ref.dtype:
            return None
        needed.add(i)
        todo.extend(leaf for leaf in leaves if type(leaf) is Ref)
    steps = []
    for i in sorted(needed):
        (leaves, spec), outs = rec.calls[i]
        steps.append((rec.events[i].func, leaves, spec, tuple(k for k, _ in outs)))
    cached = [r.key in kept_keys for r in rec.pack_refs]
    return Direct(keep, cached, sources, steps, list(rec.pack_refs), metas)


class _KeepPacks:
    """The forward context of a direct call: checks each pack against the replay's, keeps
    the packs marked `keep` (detached aliases: the same memory) for the recompute."""

    __slots__ = ("direct", "recompute", "listeners", "on_mismatch", "count", "ok")

    def __init__(self, direct: Direct, recompute, listeners: list, on_mismatch):
        self.direct, self.recompute, self.listeners, self.on_mismatch = direct, recompute, listeners, on_mismatch

    def __enter__(self):
        self.count, self.ok = 0, True
        self.recompute.kept = {}
        PACK_LISTENERS.append(self.on_pack)
        return self

    def on_pack(self, x: torch.Tensor) -> None:
        j = pack_matches(self, self.direct.metas, x)
        if j is None:
            return
        if self.direct.keep[j]:
            self.recompute.kept[j] = x.detach()

    def __exit__(self, exc_type, *exc):
        PACK_LISTENERS.remove(self.on_pack)
        if exc_type is None and (not self.ok or self.count != len(self.direct.metas)):
            self.recompute.kept = None  # another op sequence: the block's forward runs again, as full AC
            self.on_mismatch()
        elif exc_type is None and self.listeners:
            cached = [x for j, x in self.recompute.kept.items() if self.direct.cached[j]]
            for listener in self.listeners:
                listener.add(cached, "sac_cache")
        return False


class _DirectRecompute:
    """The recompute context: runs the steps, feeds every pack to the checkpoint's recompute
    pack hook, and stops the recompute before the block's forward runs."""

    __slots__ = ("direct", "kept")

    def __init__(self, direct: Direct):
        self.direct, self.kept = direct, None

    def __enter__(self):
        from torch.utils.checkpoint import _StopRecomputationError
        kept = self.kept
        hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
        if kept is None or hooks is None:
            return self  # the block's forward runs as it is (no mode: every op)
        direct = self.direct
        bases = {key: kept[j] for key, j in direct.sources.items()}
        with torch.no_grad():
            for func, leaves, spec, outs in direct.steps:
                args, kwargs = tree_unflatten(
                    [bases[x.key].as_strided(x.size, x.stride, x.offset) if type(x) is Ref else x for x in leaves], spec)
                out = func(*args, **kwargs)
                for key, t in zip(outs, [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]):
                    bases.setdefault(key, t)
            packs = [kept[j] if keep else bases[r.key].as_strided(r.size, r.stride, r.offset)
                     for j, (keep, r) in enumerate(zip(direct.keep, direct.packs))]
        self.kept = None
        pack = hooks[0]
        for x in packs:
            pack(x)  # (the last raises _StopRecomputationError when torch's early stop is on)
        raise _StopRecomputationError

    def __exit__(self, *exc):
        return False
