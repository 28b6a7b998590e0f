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
  storage to the op that made it, through its arguments, stopping at kept storages and at
  the block's own arguments (`inputs`: a bf16 residual stream is read only by RMSNorm's
  `x.float()` and the residual add, neither of which packs it; the call takes them from a
  forward pre-hook, `ac_dce.watch_block_inputs`, checked against the recorded ones). Views
  are not steps: every argument is rebuilt with `as_strided` on its storage, or passed as
  it is where it is exactly the tensor held for that storage. Each step's arguments are
  laid out once (`_step`): at the CPU's op rate a tree walk per step cost a point of
  `full`'s step time;

and the forward context (`_DirectCall`) takes the packs itself: its saved-tensor hooks are
the innermost, so the checkpoint's frame sees none and never recomputes. The other packs
are dropped when the forward ends (a block's non-kept packs live until then, one block at
a time); the first unpack that needs one runs the steps under no_grad and refills them
all. torch's per-pack bookkeeping and recompute set-up (holders, metadata checks, the RNG
restore, the early-stop exception) cost more than a small recompute on the CPU (budget with
no limit, which recomputes nothing, cost +10.6% over `none` through them; see
docs/performance.md). Not built (the replay's dispatch-mode recompute runs instead) when a
step would draw random numbers, be non-aten or multi-output-with-subclass, or be in-place on
anything but a storage made in the block that only in-place ops wrote (RMSNorm's `add_` of
eps runs as a step after the `mean` it writes), or a needed storage is neither made in the
block, nor packed, nor an argument of its call (a buffer: DeepSeek's router);
nor when a recorded op's output shape or value comes from data
(`nonzero`, `.item()`: the steps replay the recorded arguments). If the forward's packs
differ from the replay's (`ac_dce.pack_meta`: shape, dtype, the op that made them, strides,
storage offset, which packs share a storage), or a Python number of the block changed since
it was recorded (`scalar_state`: the steps replay the recorded numbers, e.g. a scale that a
schedule moves), the call drops nothing: it keeps what `none` keeps (exact), and the block
goes back to the mode path. A number the forward reads from outside the block's modules
(a global, a non-tensor argument of the block's call) is not seen.

Under autocast the recorded steps are the ops autocast already cast for, so they run with
autocast off (exact wherever backward runs); the weights' bf16 casts are held as packs from
outside the block, which autocast's cache holds anyway while backward runs in the forward's
autocast region (the trainer). A recompute outside that region is exact, and sends its block
back to the path that casts again (docs/activation_checkpointing.md, "Precision").
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from dataclasses import dataclass

import torch
from torch.utils._pytree import tree_leaves, tree_unflatten

from parallelisms.ac_dce import INPUT_LISTENERS, CallRecorder, Ref, pack_matches, plain_data, tensor_args
from parallelisms.ac_ops import DATA_DEPENDENT_TAGS, draws_random

logger = logging.getLogger("ac")
_NUMBERS = (bool, int, float)
_MISSING = object()


def scalar_state(block) -> tuple:
    """((object, attribute, value), ...) for every Python number (or tuple of numbers) an
    attribute of the block's modules holds, and every number field of a dataclass one of them
    holds (model args): what the forward may pass to an op as a scalar, and so what a direct
    recompute, which replays the recorded arguments, must find unchanged (`scalars_hold`)."""
    if block is None:
        return ()
    out, seen = [], set()
    for module in block.modules():
        for name, v in vars(module).items():
            if type(v) in _NUMBERS or (type(v) is tuple and all(type(e) in _NUMBERS for e in v)):
                out.append((module, name, v))
            elif dataclasses.is_dataclass(v) and not isinstance(v, type) and id(v) not in seen:
                seen.add(id(v))
                out += [(v, f.name, getattr(v, f.name)) for f in dataclasses.fields(v)
                        if type(getattr(v, f.name, None)) in _NUMBERS]
    return tuple(out)


def scalars_hold(state: tuple) -> bool:
    """Whether every number of a `scalar_state` still has its recorded value."""
    for obj, name, value in state:
        now = getattr(obj, name, _MISSING)
        if now is not value and now != value:
            return False
    return True


def data_dependent_step(rec: CallRecorder) -> str:
    """The first recorded op (before the last pack) whose output shape or value is read from
    data, as its name; "" when there is none. The direct steps replay the recorded arguments,
    so a later call with other data would rebuild its packs from the wrong sizes or numbers."""
    for e in rec.events[:rec.stop]:
        if any(tag in getattr(e.func, "tags", ()) for tag in DATA_DEPENDENT_TAGS):
            return str(e.func)
    return ""


@dataclass
class Direct:
    """What a replayed call keeps and recomputes (see the module docstring)."""

    keep: list  # per pack: True if the forward keeps it as it is
    cached: list  # per pack: kept because SAC keeps its storage (what the byte counters see)
    sources: dict  # storage -> the first kept pack on it (the base of its Refs)
    steps: list  # `_step`s with what each frees (`_with_frees`), in forward order
    packs: list  # per pack: its Ref
    metas: list  # per pack: its `ac_dce.pack_meta`, as the replay's
    lost: list  # per pack not kept: (its index, storage, view or None: the rebuilt tensor itself)
    scalars: tuple = ()  # the block's numbers when recorded (`scalar_state`)
    # The block's tensor arguments that steps read and no kept pack holds (a bf16 residual
    # stream): ((position among the call's tensor arguments, storage), ...); what a later call
    # must match: its number of tensor arguments, and for each argument on a storage the steps
    # read, (position, (size, stride, offset, dtype), the first argument on that storage).
    inputs: tuple = ()
    n_args: int = 0
    arg_checks: tuple = ()

    def contexts(self, listeners: list, on_mismatch) -> tuple:
        """(forward context, recompute context) for `checkpoint(context_fn=...)`;
        `listeners` get the kept tensors of SAC's kept outputs (`ac_sac.SAC_CACHE_LISTENERS`).
        The checkpoint never recomputes: its frame is handed no pack (`_DirectCall`)."""
        return _DirectCall(self, listeners, on_mismatch), contextlib.nullcontext()


def _refuse(why: list | None, reason: str) -> None:
    if why is not None:
        why.append(reason)


def build_direct(rec: CallRecorder | None, kept: list, metas: list, why: list | None = None) -> Direct | None:
    """The direct recompute of a block recorded by `rec` whose plan keeps the outputs of
    `kept` ((op, invocation index) pairs), or None (see the module docstring; the reason is
    appended to `why`). `metas`: the replay's per-pack metadata, which the recorded packs
    must match."""
    if rec is None or len(rec.pack_refs) != len(metas) or any(r is None for r in rec.pack_refs):
        return _refuse(why, "a pack is a tensor subclass (TP's DTensors), or the packs differ from the replay's")
    event_of = {(id(e.func), e.index): i for i, e in enumerate(rec.events)}
    kept_keys = set()
    for func, index in kept:
        i = event_of.get((id(func), index))
        if i is None:
            return _refuse(why, "a kept output is not in the recorded call")
        kept_keys.update(k for k, _ in rec.calls[i][1])
    first: dict = {}
    for j, (ref, (shape, dtype, _, stride, offset, alias)) in enumerate(zip(rec.pack_refs, metas)):
        if (ref.size, ref.dtype, ref.stride, ref.offset, first.setdefault(ref.key, j)) != \
                (shape, dtype, stride, offset, alias):
            return _refuse(why, "the recorded packs differ from the replay's")
    step = data_dependent_step(rec)
    if step:
        return _refuse(why, f"{step}'s output depends on data")
    made = rec.origin
    keep = [r.key in kept_keys or (r.key not in made and r.key not in rec.written) for r in rec.pack_refs]
    sources: dict = {}
    dtypes: dict = {}
    for j, r in enumerate(rec.pack_refs):
        if keep[j]:
            sources.setdefault(r.key, j)
            dtypes.setdefault(r.key, r.dtype)
    writers = _inplace_writers(rec)
    arg_of: dict = {}  # storage -> the first tensor argument of the block's call on it
    for pos, r in enumerate(rec.inputs or ()):
        if r is not None:
            arg_of.setdefault(r.key, pos)
    inputs: dict = {}  # storage -> the argument the steps read it from
    needed: set = set()
    todo = [r for j, r in enumerate(rec.pack_refs) if not keep[j]]
    seen: set = set()
    while todo:
        ref = todo.pop()
        if ref.key in sources or ref.key in seen:
            if dtypes.get(ref.key, ref.dtype) != ref.dtype:
                return _refuse(why, "a storage is read with two dtypes")
            continue
        seen.add(ref.key)
        i = made.get(ref.key)
        if i is None:
            pos = arg_of.get(ref.key)
            if pos is None or ref.key in rec.written:
                return _refuse(why, "a needed tensor is neither made in the block, nor packed, nor an argument "
                               "of its call (or it is written in place)")
            inputs[ref.key] = pos
            if dtypes.setdefault(ref.key, rec.inputs[pos].dtype) != ref.dtype:
                return _refuse(why, "a storage is read with two dtypes")
            continue
        steps = [i]
        if ref.key in rec.written:  # only by in-place ops on it (RMSNorm's `add_` of eps): they are steps too
            steps += writers.get(ref.key) or [None]
        for i in steps:
            if i is None:
                return _refuse(why, "a needed storage is written in place by an op that is no in-place step")
            func = rec.events[i].func
            (leaves, spec), outs = rec.calls[i]
            if not (isinstance(func, torch._ops.OpOverload) and func.namespace == "aten") \
                    or (func._schema.is_mutable and not rec.events[i].inplace_skip) \
                    or draws_random(func, *tree_unflatten(leaves, spec)):
                return _refuse(why, f"a step is not aten (a collective), is mutable, or draws random numbers: {func}")
            if any((k is None) for k, _ in outs) or any(leaf is None for leaf in leaves):
                return _refuse(why, f"a step reads or makes a tensor subclass: {func}")
            for k, dt in outs:
                dtypes.setdefault(k, dt)
            needed.add(i)
            todo.extend(leaf for leaf in leaves if type(leaf) is Ref)
        if dtypes[ref.key] != ref.dtype:
            return _refuse(why, "a storage is read with two dtypes")
    # What `_rebuild` will hold per storage (the first tensor on it), to pass that tensor as it
    # is where an argument or a pack is exactly it, instead of an `as_strided` view of it.
    base_view = {key: _view(rec.pack_refs[j]) for key, j in sources.items()}
    base_view.update({key: _view(rec.inputs[pos]) for key, pos in inputs.items()})
    steps = []
    for i in sorted(needed):
        (leaves, spec), outs = rec.calls[i]
        steps.append(_step(rec.events[i].func, leaves, spec, tuple(k for k, _ in outs), base_view))
        for (key, _), view in zip(outs, rec.out_views[i]):
            base_view.setdefault(key, view)
    lost = [(j, r.key, None if _view(r) == base_view[r.key] else _view(r))
            for j, r in enumerate(rec.pack_refs) if not keep[j]]
    steps = _with_frees(steps, set(sources) | set(inputs) | {key for _, key, _ in lost})
    cached = [r.key in kept_keys for r in rec.pack_refs]
    # The steps read the arguments by the recorded views, and every argument that was on a read
    # storage must still be (another argument's storage, a mask's shape, may change freely).
    checks = tuple((pos, (r.size, r.stride, r.offset, r.dtype), arg_of[r.key])
                   for pos, r in enumerate(rec.inputs or ()) if r is not None and r.key in inputs)
    return Direct(keep, cached, sources, steps, list(rec.pack_refs), metas, lost, rec.scalars,
                  tuple((pos, key) for key, pos in inputs.items()), len(rec.inputs or ()), checks)


def _with_frees(steps: list, kept: set) -> list:
    """Each step with the storages `_rebuild` lets go of after it: those no later step reads
    and no pack is on (intermediates such as RMSNorm's square or RoPE's products), as the
    re-run forward of torch's checkpoint frees them; held all through, they raised the
    backward peak of the debug model under FSDP 2 by 5 MiB (tests/test_memory_estimate.py)."""
    last: dict = {}
    for n, (_, _, refs, _, _, outs) in enumerate(steps):
        for key in outs:
            last.setdefault(key, n)
        for _, key, _ in refs:
            last[key] = n
    frees: list = [[] for _ in steps]
    for key, n in last.items():
        if key not in kept:
            frees[n].append(key)
    return [(*step, tuple(f)) for step, f in zip(steps, frees)]


def _view(ref: Ref) -> tuple:
    return ref.size, ref.stride, ref.offset


def _step(func, leaves: list, spec, outs: tuple, base_view: dict) -> tuple:
    """(op, arguments, [(position, storage, view or None: the held tensor itself)], kwargs,
    spec or None, output storages). Tensors only among the positional arguments (most aten
    ops): `args` are those arguments; else `args` are the flat leaves and `spec` rebuilds them."""
    args, kwargs = tree_unflatten(leaves, spec)
    flat = not any(type(x) is Ref for x in tree_leaves(kwargs)) and \
        sum(type(a) is Ref for a in args) == sum(type(x) is Ref for x in leaves)
    items = list(args) if flat else list(leaves)
    refs = tuple((pos, x.key, None if _view(x) == base_view.get(x.key) else _view(x))
                 for pos, x in enumerate(items) if type(x) is Ref)
    return func, items, refs, (kwargs if flat else {}), (None if flat else spec), outs


def _inplace_writers(rec: CallRecorder) -> dict:
    """storage -> the in-place ops that wrote it (event indices), for the storages made in the
    block that only such ops wrote: an aten op returning its first argument, on a plain
    tensor (`_Event.inplace_skip`). Run as steps, in forward order, on the fresh tensor the
    steps made, they write what the forward wrote. A storage any other mutable op read or
    wrote is left out."""
    writers: dict = {}
    other: set = set()
    for i, e in enumerate(rec.events):
        schema = getattr(e.func, "_schema", None)
        if schema is not None and not schema.is_mutable:
            continue
        (leaves, _), outs = rec.calls[i]
        keys = {leaf.key for leaf in leaves if type(leaf) is Ref}
        if e.inplace_skip and len(outs) == 1 and outs[0][0] is not None and None not in leaves:
            writers.setdefault(outs[0][0], []).append(i)
            keys.discard(outs[0][0])
        elif None in leaves or schema is None:
            return {}  # (a subclass or an op without a schema: which storage it wrote is not known)
        other |= keys
    return {k: v for k, v in writers.items() if k not in other}


class _Slot:
    """What autograd holds for one pack of a direct call: the tensor, or None once dropped
    (rebuilt at the first unpack that needs it), and its version when packed."""

    __slots__ = ("x", "version")


class _DirectCall:
    """The forward context of a direct call. Its saved-tensor hooks are the innermost, so
    autograd hands every pack of the block to them instead of to the checkpoint's (whose
    per-pack bookkeeping, metadata check and recompute set-up, RNG restore included, cost
    about as much as a small recompute): each pack is checked against the replay's and
    held detached (no reference cycle through its `grad_fn`). When the forward ends with
    every pack matched, the packs not marked `keep` are dropped; the first unpack of one
    of them runs the steps (under no_grad: no random op is a step) and refills them all.
    Otherwise nothing is dropped: the call keeps what `none` keeps, and the block goes back
    to the dispatch-mode path."""

    __slots__ = ("direct", "listeners", "on_mismatch", "count", "ok", "slots", "sources", "lost", "seen", "args",
                 "autocast")

    def __init__(self, direct: Direct, listeners: list, on_mismatch):
        self.direct, self.listeners, self.on_mismatch = direct, listeners, on_mismatch

    def __enter__(self):
        self.count, self.slots, self.sources, self.lost, self.seen, self.args = 0, [], None, None, {}, None
        self.ok = scalars_hold(self.direct.scalars)  # (else: a number changed; keep every pack)
        if self.direct.inputs:
            INPUT_LISTENERS.append(self.take_args)
        torch._C._autograd._push_saved_tensors_default_hooks(self.pack, self.unpack)
        return self

    def take_args(self, args, kwargs) -> None:
        """The block's arguments (`ac_dce.watch_block_inputs`): holds those the steps read
        (detached: the checkpoint holds them anyway), if they match the recorded ones
        (`Direct.arg_checks`); else the call keeps every pack."""
        xs, direct = tensor_args(args, kwargs), self.direct
        ok = len(xs) == direct.n_args
        for pos, view, first in direct.arg_checks if ok else ():
            x = xs[pos]
            ok = plain_data(x) and (x.size(), x.stride(), x.storage_offset(), x.dtype) == view and \
                (first == pos or xs[first].untyped_storage()._cdata == x.untyped_storage()._cdata)
            if not ok:
                self.ok = False
                return
        if ok:
            self.args = {key: (xs[pos].detach(), xs[pos]._version) for pos, key in direct.inputs}
        else:
            self.ok = False

    def _stop_taking_args(self) -> None:
        if self.direct.inputs and self.take_args in INPUT_LISTENERS:
            INPUT_LISTENERS.remove(self.take_args)

    def pack(self, x: torch.Tensor) -> _Slot:
        pack_matches(self, self.direct.metas, x)
        slot = _Slot()
        slot.x, slot.version = x.detach(), x._version
        self.slots.append(slot)
        return slot

    def unpack(self, slot: _Slot) -> torch.Tensor:
        x = slot.x
        if x is None:
            self._rebuild()
            return slot.x
        if x._version != slot.version:  # (what autograd raises without hooks; a rebuilt pack is new)
            raise RuntimeError("one of the variables needed for gradient computation has been modified by an "
                               f"inplace operation: a tensor of shape {list(x.shape)} saved in an activation-"
                               f"checkpointed block is at version {x._version}; expected version {slot.version}")
        return x

    def __exit__(self, exc_type, *exc):
        torch._C._autograd._pop_saved_tensors_default_hooks()
        self._stop_taking_args()
        slots, self.slots, self.seen = self.slots, None, None
        if exc_type is not None:
            return False
        direct = self.direct
        if not self.ok or self.count != len(direct.metas) or (direct.inputs and self.args is None):
            self.on_mismatch()  # another op sequence: this call keeps every pack, exact
            self.args = None
            return False
        self.sources = {key: slots[j] for key, j in direct.sources.items()}
        self.autocast = _autocast_on()
        self.lost = [(slots[j], key, view) for j, key, view in direct.lost]
        for slot, _, _ in self.lost:
            slot.x = None
        if not self.lost:
            self.sources = self.lost = self.args = None  # nothing to rebuild
        if self.listeners:
            cached = [slot.x for slot, is_cached in zip(slots, direct.cached) if is_cached]
            for listener in self.listeners:
                listener.add(cached, "sac_cache")
        return False

    def _rebuild(self) -> None:
        if self.autocast and not _autocast_on():
            # Under autocast the held packs include the weights' casts, which autocast caches for
            # its region anyway: free while backward runs in the forward's region (the trainer),
            # but held past it here (a loop whose backward runs outside the region). This call
            # is exact; the block's next calls go back to the path that casts again.
            logger.info("activation checkpointing: a direct recompute ran outside its forward's autocast "
                        "region; that block leaves the direct path")
            self.on_mismatch()
        bases = {key: slot.x for key, slot in self.sources.items()}
        for key, (x, version) in (self.args or {}).items():
            if x._version != version:  # (what the checkpoint's own saved inputs would raise)
                raise RuntimeError("one of the variables needed for gradient computation has been modified by an "
                                   f"inplace operation: an input of shape {list(x.shape)} of an activation-"
                                   f"checkpointed block is at version {x._version}; expected version {version}")
            bases[key] = x
        # The steps are the ops autocast already cast for (the recorder dispatches below it):
        # run as recorded, whether or not backward runs in the forward's autocast region.
        with torch.no_grad(), _autocast_off():
            for func, items, refs, kwargs, spec, outs, frees in self.direct.steps:
                items = list(items)
                for pos, key, view in refs:
                    items[pos] = bases[key] if view is None else bases[key].as_strided(*view)
                if spec is None:
                    out = func(*items, **kwargs) if kwargs else func(*items)
                else:
                    args, kwargs = tree_unflatten(items, spec)
                    out = func(*args, **kwargs)
                del items
                if type(out) is torch.Tensor:
                    if outs[0] not in bases:
                        bases[outs[0]] = out
                else:
                    for key, t in zip(outs, [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]):
                        bases.setdefault(key, t)
                del out
                for key in frees:
                    del bases[key]
            for slot, key, view in self.lost:
                x = slot.x = bases[key] if view is None else bases[key].as_strided(*view)
                slot.version = x._version
        self.sources = self.lost = self.args = None  # (the slots autograd holds keep what they need)


def _autocast_devices() -> list:
    return [d for d in ("cpu", "cuda") if (d == "cpu" or torch.cuda.is_available()) and torch.is_autocast_enabled(d)]


def _autocast_on() -> bool:
    return bool(_autocast_devices())


def _autocast_off():
    """Autocast off on every device it is on (for the steps: see `_DirectCall._rebuild`)."""
    stack = contextlib.ExitStack()
    for device in _autocast_devices():
        stack.enter_context(torch.autocast(device, enabled=False))
    return stack
