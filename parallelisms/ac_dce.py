"""The recompute plan of op-level SAC: which ops the recompute does not need to run.

Why: torch's SAC re-runs every op it did not cache, whether or not backward reads the
result. On a Llama block that is the RMSNorm's six ops, both RoPE rotations (five ops
each) and the matmul under each, about twenty memory-bound ops that cost more time than
the recomputed matmuls while counting no FLOPs. Much of that work only feeds tensors that
are themselves cached. One call of each block is recorded (`CallRecorder`: every op's
inputs and outputs by storage, and every tensor autograd packs, through the checkpoint's
determinism-check hook), and `make_plan` works out, backwards from what autograd packs,
which ops the recompute must run (and the recording call's recompute checks that it
dispatches the recorded ops in the same order: if not, the block gets no plan). Later
calls of the block then

- keep a few more outputs (`promote`): outputs of at most 1/32 of the block's largest
  activation (RMSNorm's reciprocal root, [tokens, 1]), and the inputs of each kept
  attention op (the rotated q and k, instead of the matmul outputs they come from), so
  that the chains behind them are dead. An attention input copied (only) from a kept
  output at least as large (CP's reorder of the gathered K/V) is not kept: that would
  hold the same data twice, to spare a copy. Matmul outputs are never promoted: which of
  them are kept stays the policy's choice (alternation, force-recompute patterns);
- answer the dead ops with a `Placeholder` (an empty tensor of the recorded shape, never
  read), or, for an in-place op on a dead tensor, with its input: nothing runs;
- release cached outputs nobody reads (the q projection, once its rotation is kept).

What must run is decided conservatively: every tensor autograd packs, every op that
reads data and cannot be skipped (non-aten namespaces such as collectives, random ops,
in-place ops on tensors from outside the block, ops with several or non-tensor outputs,
tensor subclasses) and everything they read. View ops run whenever they are reached (they
read no data). A call whose op counts differ from the recorded call's keeps every
output and skips nothing, and the block is recorded again. Only in eager mode: under
torch.compile the partitioner plans the recompute.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten, tree_leaves

from parallelisms.ac_ops import MATMUL_OPS

# Callables given every tensor autograd packs inside a checkpointed forward (while the
# checkpoint was given `determinism_check=PACK_PROBE`).
PACK_LISTENERS: list = []


def _same_nodes() -> dict:
    """Autograd node types that stand for the same op: `reshape` (in `matmul` too) makes a
    `view` under a Python dispatch mode (the recorded calls) and an `_reshape_alias` without
    one (the replayed ones)."""
    try:
        from torch._C import _functions as nodes
        return {nodes.ReshapeAliasBackward0: nodes.ViewBackward0}
    except AttributeError:  # pragma: no cover - another torch
        return {}


_SAME_NODE = _same_nodes()


def pack_meta(x: torch.Tensor, seen: dict, j: int) -> tuple:
    """What the `j`-th pack of a call must share with the recorded call's `j`-th pack for a replay
    or a direct recompute built from that call to hold: its shape, dtype and the op that made it
    (its `grad_fn`'s type), and, for a plain tensor, its strides, its offset in its storage and
    which earlier pack of the call shares that storage. The kept outputs are cut from packs, and
    the direct steps read them, by the recorded (size, stride, offset) on the recorded storages:
    a pack with another offset or transposed strides, or two packs that shared a storage and no
    longer do (or the other way round), would hand backward other memory than the forward's.
    `seen`: the call's storages so far (held, so that no address is reused within the call)."""
    node = type(x.grad_fn)
    node = _SAME_NODE.get(node, node)
    if type(x) is not torch.Tensor and type(x) is not nn.Parameter:
        return x.shape, x.dtype, node, None, None, None  # (a subclass: its own layout is not ours to check)
    storage = x.untyped_storage()
    first = seen.get(storage._cdata)
    if first is None:
        first = seen[storage._cdata] = (j, storage)
    return x.shape, x.dtype, node, x.stride(), x.storage_offset(), first[0]


def pack_metas(packs: list) -> list:
    """`pack_meta` of each pack of one call, in order."""
    seen: dict = {}
    return [pack_meta(x, seen, j) for j, x in enumerate(packs)]


def pack_matches(listener, metas: list, x: torch.Tensor) -> int | None:
    """The index of `x` among a recorded call's packs when it is the pack recorded there (`pack_meta`:
    shape, dtype, the op that made it, strides, offset, aliasing; `listener.seen` holds the call's
    storages); else None, and `listener.ok` turns False for the rest of the call."""
    j = listener.count
    listener.count = j + 1
    if not listener.ok or j >= len(metas) or pack_meta(x, listener.seen, j) != metas[j]:
        listener.ok = False
        return None
    return j


# Callables given the (args, kwargs) of a wrapped block's forward (`watch_block_inputs`),
# registered by the calls that need them while their forward runs: the recording call (which
# tensor arguments the ops read) and a direct call whose steps read one (`ac_direct`). A block
# input that only casts and adds read (a bf16 residual stream: RMSNorm's `x.float()`, the
# residual add) is never packed; the checkpoint holds it, the steps must read it too.
INPUT_LISTENERS: list = []


def _note_inputs(module, args, kwargs) -> None:
    for listener in INPUT_LISTENERS:
        listener(args, kwargs)


def watch_block_inputs(block: nn.Module):
    """Hands each call's arguments of `block` to `INPUT_LISTENERS`; returns the hook's handle."""
    return block.register_forward_pre_hook(_note_inputs, with_kwargs=True)


def tensor_args(args, kwargs) -> list:
    """The tensors among a call's arguments, in order (positions in `CallRecorder.inputs`)."""
    return [x for x in tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]


PACK_PROBE = "titanlite_pack_probe"


def _pack_probe(x: torch.Tensor):
    from torch.utils.checkpoint import _default_meta_extractor
    for listener in PACK_LISTENERS:
        listener(x)
    return _default_meta_extractor(x)


def register_pack_probe() -> str | None:
    """Registers the pack-observing determinism check with torch's checkpoint; returns its
    name for `checkpoint(determinism_check=...)`, or None if this torch has no such
    registry (then nothing observes the packs: no recompute plan is made)."""
    try:
        from torch.utils import checkpoint as ckpt
        ckpt._allowed_determinism_checks_to_fns[PACK_PROBE] = _pack_probe
        return PACK_PROBE
    except Exception:  # noqa: BLE001 - private API
        return None


def block_kind(block: nn.Module | None) -> tuple:
    """Blocks with the same class and parameter shapes run the same ops (they share a
    memory-budget measurement)."""
    if block is None:
        return ()
    return type(block).__qualname__, tuple((n, tuple(p.shape), p.dtype) for n, p in block.named_parameters())


# A SAC cache entry for an in-place op on a tensor nobody reads: the recompute returns
# the op's input unchanged.
INPLACE_SKIP = object()

# A cached output at most this fraction of the block's largest activation is kept.
TINY_FRACTION = 32

# Ops that only move data (their output holds values of their input, rearranged).
_aten = torch.ops.aten
COPY_OPS = frozenset({_aten.clone, _aten.index_select, _aten.cat, _aten.stack, _aten.constant_pad_nd,
                      _aten.repeat_interleave, _aten.repeat, _aten._unsafe_view, _aten.copy, _aten.expand_copy,
                      _aten.permute_copy, _aten.slice_copy, _aten.narrow_copy, _aten.gather})


def _inner_tensors(t: torch.Tensor):
    """The plain tensors holding the data of `t`: itself, or for a tensor subclass (DTensor,
    funcol's AsyncCollectiveTensor) those its `__tensor_flatten__` names, recursively."""
    flatten = None if type(t) is torch.Tensor else getattr(t, "__tensor_flatten__", None)
    names = None
    if flatten is not None:
        try:
            names, _ = flatten()
        except Exception:  # noqa: BLE001 - a subclass whose flatten needs more context
            pass
    if names is None:
        yield t
        return
    for name in names:
        inner = getattr(t, name)
        if isinstance(inner, torch.Tensor):  # (DTensor also names its device mesh)
            yield from _inner_tensors(inner)


def _storage_keys(tree, alive: list | None = None) -> list:
    """The storages of the tensors in `tree`, as keys (None where a tensor has none). A
    tensor subclass counts by the storages of its inner tensors: a DTensor wrapper's own
    storage is a fresh stand-in, so keyed by it, an op on a DTensor made by `from_local` (no
    op) would not read the plain tensor inside it, and an op whose plain output only a
    DTensor op reads would look dead (it was given a Placeholder: wrong TP gradients).
    With `alive`, the storages are held there, so that no address is reused while recording."""
    keys = []
    for leaf in tree_leaves(tree):
        if isinstance(leaf, torch.Tensor):
            for t in _inner_tensors(leaf):
                try:
                    storage = t.untyped_storage()
                    keys.append(storage._cdata)
                    if alive is not None:
                        alive.append(storage)
                except Exception:  # noqa: BLE001 - storage-less tensors
                    keys.append(None)
    return keys


def _plain(t) -> bool:
    """A tensor a Placeholder can stand for: plain (or fake, when counting), not a subclass."""
    return type(t) is torch.Tensor or type(t).__name__ == "FakeTensor"


@dataclass
class _Event:
    func: object
    index: int
    saved: bool  # the policy keeps its output
    verdict: str
    inputs: set  # events whose outputs it reads
    alias_of: int | None  # for a view: the event whose storage it aliases
    placeholder: bool  # a functional aten op with one plain tensor output
    inplace_skip: bool  # an aten in-place op on a tensor made in the block, returning it
    must_run: bool  # reads data and cannot be answered without running
    nbytes: int
    mutated_later: bool = False


class Ref:
    """A tensor named by its storage and view (`ac_direct`): rebuilt with `as_strided` on
    any tensor holding that storage."""

    __slots__ = ("key", "size", "stride", "offset", "dtype")

    def __init__(self, t: torch.Tensor):
        self.key = t.untyped_storage()._cdata
        self.size, self.stride, self.offset, self.dtype = t.size(), t.stride(), t.storage_offset(), t.dtype


def plain_data(x) -> bool:
    """A tensor whose data is its own storage: a plain tensor or a plain Parameter."""
    return type(x) is torch.Tensor or type(x) is nn.Parameter


def _template(tree) -> tuple:
    """(leaves, spec) of `tree` with each plain tensor replaced by its `Ref` (None: a tensor
    subclass, which `ac_direct` does not rebuild)."""
    leaves, spec = tree_flatten(tree)
    return [(Ref(x) if plain_data(x) else None) if isinstance(x, torch.Tensor) else x for x in leaves], spec


@dataclass
class CallRecorder:
    """Records one checkpointed forward of a block (see the module docstring)."""

    events: list = field(default_factory=list)
    producer: dict = field(default_factory=dict)  # storage -> latest event writing it
    origin: dict = field(default_factory=dict)  # storage -> event that created it
    packed: set = field(default_factory=set)  # events whose outputs autograd packs
    stop: int = 0  # events dispatched before the last pack (what the recompute re-runs)
    counts: dict | None = None  # the SAC mode's per-op counts when the forward ended
    alive: list = field(default_factory=list)  # every storage seen (one block's activations, this call only)
    # For `ac_direct`: per event its arguments (`_template`) and (storage, dtype) per tensor
    # output; per pack its `Ref` (None: not a plain tensor); storages written in place.
    calls: list = field(default_factory=list)
    pack_refs: list = field(default_factory=list)
    written: set = field(default_factory=set)
    out_views: list = field(default_factory=list)  # per event, (size, stride, offset) per tensor output
    inputs: list | None = None  # per tensor argument of the block's call, its Ref (None: a subclass)
    scalars: tuple = ()  # the block's Python numbers when recorded (`ac_direct.scalar_state`)

    def on_op(self, func, index: int, args, kwargs, out, saved: bool, verdict: str) -> None:
        in_keys = _storage_keys((args, kwargs), self.alive)
        out_keys = _storage_keys(out, self.alive)
        producer = self.producer
        inputs = {producer[k] for k in in_keys if k in producer}
        schema = getattr(func, "_schema", None)
        mutable = schema is None or schema.is_mutable
        aten = isinstance(func, torch._ops.OpOverload) and func.namespace == "aten"
        plain = _plain(out)
        random = aten and torch.Tag.nondeterministic_seeded in func.tags
        alias_key = next((k for k in out_keys if k is not None and k in in_keys), None)
        alias_of = producer.get(alias_key) if alias_key is not None and not mutable else None
        inplace_skip = (aten and mutable and plain and bool(args) and out is args[0] and alias_key is not None
                        and alias_key in self.origin and not random)
        is_view = alias_key is not None and not mutable
        placeholder = aten and plain and not mutable and not is_view and not random and None not in out_keys
        i = len(self.events)
        if mutable:
            self.written.update(in_keys)
            for k in out_keys:
                if k in self.origin:
                    self.events[self.origin[k]].mutated_later = True
        outs = [x for x in tree_leaves(out) if isinstance(x, torch.Tensor)]
        self.calls.append((_template((args, kwargs)),
                           [(x.untyped_storage()._cdata, x.dtype) if plain_data(x) else (None, None) for x in outs]))
        self.out_views.append([(x.size(), x.stride(), x.storage_offset()) if plain_data(x) else None for x in outs])
        for k in out_keys:
            producer[k] = i
            if not mutable and not is_view:
                self.origin[k] = i
        nbytes = out.untyped_storage().nbytes() if plain and isinstance(out, torch.Tensor) else 0
        self.events.append(_Event(func, index, saved, verdict, inputs, alias_of, placeholder, inplace_skip,
                                  must_run=not (placeholder or inplace_skip or is_view), nbytes=nbytes))

    def on_inputs(self, args, kwargs) -> None:
        self.inputs = [Ref(x) if plain_data(x) else None for x in tensor_args(args, kwargs)]

    def on_pack(self, x: torch.Tensor) -> None:
        self.pack_refs.append(Ref(x) if plain_data(x) else None)
        for k in _storage_keys(x):
            if k in self.producer:
                self.packed.add(self.producer[k])
        self.stop = len(self.events)


@dataclass
class RecomputePlan:
    """What later calls of a block do differently (see the module docstring)."""

    keep: dict  # id(op) -> {invocation index} kept beyond the policy (and those to placeholder)
    placeholders: list  # (op, index): replaced by a Placeholder when the forward ends
    inplace: list  # (op, index): in-place ops answered with their input
    counts: dict  # the recorded call's per-op counts (the plan holds only for the same)
    promoted: list  # (op, index) kept beyond the policy
    released: int  # cached outputs released (nobody reads them)
    forced: list = field(default_factory=list)  # (op, index) in `keep` that the policy recomputes
    disabled: str = ""  # why this block has no plan (its recompute ran other ops than its forward)
    fast: dict = field(default_factory=dict)  # id(op) -> policy (see OpSACPolicy.fast)
    replay: object = None  # ac_replay.Replay: later forwards run without a dispatch mode
    direct: object = None  # ac_direct.Direct: ... and later recomputes too
    source: object = None  # the CallRecorder the plan was made from (ac_direct builds from it)
    replay_tried: bool = False  # a call that applied the plan has tried to build `replay`

    def drop_replay(self) -> None:
        """A replayed forward packed other tensors than the call it was built from: back to
        the dispatch-mode path (whose op counts decide whether the plan still holds)."""
        self.replay = None
        self.direct = None

    def describe(self) -> str:
        if self.disabled:
            return f"no plan: {self.disabled}"
        names = sorted({f"{op}#{i}" for op, i in self.promoted})
        return (f"keeps {len(self.promoted)} more outputs ({', '.join(names) or '-'}), skips "
                f"{len(self.placeholders) + len(self.inplace) - self.released} ops in the recompute, "
                f"releases {self.released} cached outputs")


def make_plan(rec: CallRecorder, attention_ops: frozenset, *, promote: bool = True,
              release_saved: bool = True) -> RecomputePlan:
    """The plan for the calls after `rec`. `attention_ops`: op packets whose inputs are
    kept (with `promote`); `release_saved`: also release cached outputs nobody reads (a
    memory budget keeps exactly what it chose: False)."""
    events, stop = rec.events, rec.stop
    saved = [e.saved for e in events]

    def promotable(e: _Event) -> bool:  # matmuls stay the policy's (alternation, force-recompute)
        return not e.saved and e.placeholder and not e.mutated_later and e.verdict == "RECOMPUTE" \
            and getattr(e.func, "overloadpacket", e.func) not in MATMUL_OPS

    def root(i: int) -> int:  # the event whose storage a view reads
        while events[i].alias_of is not None:
            i = events[i].alias_of
        return i

    def copies_kept(i: int, nbytes: int) -> bool:
        """Whether event i reads, directly or through copies only (`COPY_OPS`), a kept output
        of at least `nbytes` (CP's reorder of the gathered K/V, Ulysses' regroup of the
        received q/k/v): keeping i would hold the same data twice, to spare a copy."""
        for r in map(root, events[i].inputs):
            if saved[r] and events[r].nbytes >= nbytes:
                return True
            if not saved[r] and getattr(events[r].func, "overloadpacket", None) in COPY_OPS and copies_kept(r, nbytes):
                return True
        return False

    promoted: dict[int, None] = {}  # (ordered, without repeats)
    if promote and events:
        largest = max((e.nbytes for e in events if e.placeholder), default=0)
        for i in range(stop):
            e = events[i]
            if promotable(e) and 0 < e.nbytes * TINY_FRACTION <= largest:
                promoted[i] = None
                saved[i] = True
        for i in range(stop):
            e = events[i]
            if e.saved and getattr(e.func, "overloadpacket", e.func) in attention_ops:
                for p in map(root, e.inputs):
                    if promotable(events[p]) and not copies_kept(p, events[p].nbytes):
                        promoted[p] = None
                        saved[p] = True
    needed = [False] * len(events)
    for i in rec.packed:
        needed[i] = True
    # An output no recorded op reads and autograd does not pack may still be read, by code that
    # dispatches no op: `.tolist()` of a CPU tensor (EP's split sizes) reads its memory directly.
    # A Placeholder there handed garbage split sizes to the recompute (an intermittent overflow
    # in test_compile_layouts' ep2 cases): such dead ends run.
    consumed = [False] * len(events)
    for e in events:
        for p in e.inputs:
            consumed[p] = True
    for i in range(stop):
        if not consumed[i]:
            needed[i] = True
    placeholders, inplace, released = [], [], 0
    for i in reversed(range(stop)):
        e = events[i]
        if e.verdict == "SKIP":  # the rules' own skips (answered by a Placeholder already)
            continue
        if saved[i]:
            if not needed[i] and e.placeholder and (release_saved or not e.saved):
                placeholders.append(i)
                released += e.saved
            continue
        if not needed[i]:
            if e.placeholder:
                placeholders.append(i)
                continue
            if e.inplace_skip:
                inplace.append(i)
                continue
            if not e.must_run:  # a view: it runs, on whatever its input is
                continue
        needed[i] = True
        for p in e.inputs:
            needed[p] = True
    keep: dict = {}  # the forward caches these; a placeholder's entry gives it its metadata
    for i in [*promoted, *placeholders]:
        keep.setdefault(id(events[i].func), set()).add(events[i].index)
    return RecomputePlan(
        keep={k: frozenset(v) for k, v in keep.items()},
        placeholders=[(events[i].func, events[i].index) for i in placeholders],
        inplace=[(events[i].func, events[i].index) for i in inplace],
        counts=dict(rec.counts or {}),
        promoted=[(events[i].func, events[i].index) for i in promoted],
        released=released,
        forced=[(events[i].func, events[i].index) for i in {*promoted, *placeholders} if not events[i].saved],
        source=rec)
