"""The forward of a planned op-SAC block without a dispatch mode: its kept outputs are cut from what autograd packs.

Why: torch's SAC runs a Python dispatch mode around every op of every checkpointed
forward, to cache the outputs the policy keeps. Its per-op cost is CPU launch time, paid
on each of about a hundred ops per Llama block, whatever the policy decides. Once a block's
recompute plan has been applied (`ac_sac.OpSACPolicy.finish`), what the SAC cache holds at
the end of its forward is known entry by entry: recompute markers, `Placeholder`s, in-place
skips, and kept outputs. When every kept output shares its storage with a tensor autograd
packs (RMSNorm's reciprocal root, the rotated q and k, v, the attention output, the saved
matmul outputs under SiLU and the gate product), the forward needs no mode: the
checkpoint's pack probe (`ac_dce.PACK_LISTENERS`) sees each pack in order, and each kept
entry is cut from its pack (`as_strided` with the op output's recorded size, stride and
offset: the same memory, the same values). The recompute runs under the replaying mode as
before, on a storage built from the template.

Every pack is checked against the call the replay was built from (`ac_dce.pack_meta`): its
shape, dtype, the type of its `grad_fn` (the autograd op that made it), its strides, its
storage offset and which earlier pack shares its storage (the kept entries are cut by the
recorded view from the recorded pack). On any difference (MoE routing changes shapes, a
branch runs other ops, an input arrives transposed or at another offset) this call's
recompute runs every op (full AC: exact), and the block goes back to the dispatch-mode path,
whose plan checks op counts. A kept output whose value comes from data without a tensor
(`.item()`: the recompute would be handed the building call's number) makes no replay.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from parallelisms.ac_dce import INPLACE_SKIP, PACK_LISTENERS, pack_matches, pack_metas
from parallelisms.ac_ops import DATA_DEPENDENT_TAGS
from parallelisms.ac_modes import Placeholder, kept_tensors, make_replay_mode


@dataclass
class Replay:
    """What a pack-only forward of one planned block rebuilds (see the module docstring)."""

    template: dict  # op -> {index: entry} without the kept entries (shared by every call)
    kept: list  # (op, index, is a tuple, leaves: a non-tensor leaf's wrapper or None to fill)
    fills: list  # per pack: ((kept entry, leaf, size, stride, offset), ...) cut from it
    metas: list  # per pack: its `ac_dce.pack_meta` in the building call

    def contexts(self, listeners: list, on_mismatch) -> tuple:
        """(forward context, recompute mode) for `checkpoint(context_fn=...)`."""
        recompute = make_replay_mode()
        return _PackOnlyForward(self, recompute, listeners, on_mismatch), recompute


def build_replay(storage, packs: list) -> Replay | None:
    """The replay of the forward that left `storage` (torch's SAC storage after the plan
    was applied) and packed `packs` (in order), or None when a kept entry is not cut from a
    plain packed tensor, comes from an in-place op or a HOP, was mutated after it was cached
    (the mode path would raise), or is a number read from data (`.item()`)."""
    from torch.utils.checkpoint import _RECOMPUTE, _VersionWrapper
    first_pack: dict = {}
    for j, x in enumerate(packs):
        if type(x) is torch.Tensor:
            first_pack.setdefault(x.untyped_storage()._cdata, j)
    template, kept, fills = {}, [], [[] for _ in packs]
    for func, entries in storage.items():
        row = template[func] = {}
        for index, entry in entries.items():
            if entry is _RECOMPUTE or entry is INPLACE_SKIP or type(entry) is Placeholder:
                row[index] = entry
                continue
            is_tuple = type(entry) is tuple
            wrappers = entry if is_tuple else (entry,)
            schema = getattr(func, "_schema", None)
            if schema is None or schema.is_mutable or not all(type(w) is _VersionWrapper for w in wrappers):
                return None  # (an in-place op's output may have been packed before the op wrote it)
            if any(tag in func.tags for tag in DATA_DEPENDENT_TAGS):
                return None  # (a later call's `.item()` is another number; the template would keep this one)
            leaves: list = []
            for slot, w in enumerate(wrappers):
                v = w.val
                if not isinstance(v, torch.Tensor):
                    leaves.append(w)  # (an int, a None: the same in every call of this shape)
                    continue
                j = first_pack.get(v.untyped_storage()._cdata) if type(v) is torch.Tensor else None
                if j is None or v._version != w.version:
                    return None
                fills[j].append((len(kept), slot, v.size(), v.stride(), v.storage_offset()))
                leaves.append(None)
            kept.append((func, index, is_tuple, leaves))
    return Replay(template, kept, [tuple(f) for f in fills], pack_metas(packs))


class _PackOnlyForward:
    """The forward context of a replayed call: listens to the packs, fills the kept
    entries, and hands the storage to the recompute mode."""

    __slots__ = ("replay", "recompute", "listeners", "on_mismatch", "values", "count", "ok", "seen")

    def __init__(self, replay: Replay, recompute, listeners: list, on_mismatch):
        self.replay, self.recompute, self.listeners, self.on_mismatch = replay, recompute, listeners, on_mismatch

    def __enter__(self):
        self.values = [list(leaves) for *_, leaves in self.replay.kept]
        self.count, self.ok, self.seen = 0, True, {}
        PACK_LISTENERS.append(self.on_pack)
        return self

    def on_pack(self, x: torch.Tensor) -> None:
        from torch.utils.checkpoint import _detach_helper, _VersionWrapper
        j = pack_matches(self, self.replay.metas, x)
        if j is None:
            return
        for k, slot, size, stride, offset in self.replay.fills[j]:
            self.values[k][slot] = _VersionWrapper(_detach_helper(x.as_strided(size, stride, offset)))

    def __exit__(self, exc_type, *exc):
        PACK_LISTENERS.remove(self.on_pack)
        self.seen = None
        if exc_type is not None:
            return False
        replay = self.replay
        if not self.ok or self.count != len(replay.metas):
            self.recompute.run_all = True  # another op sequence: recompute everything, as full AC
            self.on_mismatch()
            return False
        storage = dict(replay.template)
        for (func, index, is_tuple, _), leaves in zip(replay.kept, self.values):
            row = storage[func]
            if row is replay.template[func]:
                row = storage[func] = dict(row)
            row[index] = tuple(leaves) if is_tuple else leaves[0]
        self.recompute.storage = storage
        if self.listeners:
            kept = kept_tensors(storage)
            for listener in self.listeners:
                listener.add(kept, "sac_cache")
        return False
