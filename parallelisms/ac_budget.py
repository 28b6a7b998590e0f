"""The eager memory-budget SAC (`activation_checkpoint.mode = "budget"`): measure one block, solve a knapsack.

Why: the compile partitioner's `memory_budget` needs torch.compile; op-level SAC's
"every other matmul" rule ignores what each op costs. Here the first call of each kind
of block is run as full AC while `BlockCalibration` records, exactly, every op (by
storage, as the recompute plan does: `ac_dce.CallRecorder`) and every tensor autograd
packs. The items of the knapsack are the **packed** outputs, the only ones backward
reads (RoPE's q and k, v, the attention output, h, w1's and w3's outputs, ...):

- an item's weight is the bytes of the storage it occupies (what the SAC cache would
  hold, the same count as `ac_measure.SavedActivationCounter`);
- its value is the recompute FLOPs that keeping it avoids: its own op and every op
  that only fed it (keeping q after RoPE kills `wq` and the rotation: the recompute
  plan skips them). Ops that run anyway (collectives, other packs' chains) are not
  counted. Packed outputs whose chain has no FLOPs (norms, SiLU, copies) are kept
  with the room the FLOP-valued choice leaves, most ops avoided per byte first.

Keeping a matmul output autograd does not pack (`wq`'s, before RoPE) would save the
same FLOPs for the same bytes as keeping the packed tensor after it, and still re-run
the element-wise ops in between; worse, it bars the block from the fast paths, whose
kept outputs are cut from autograd's packs (`ac_replay`, `ac_direct`). So only packed
outputs are chosen. Also measured: what `none` would keep for the block (every tensor
autograd packs, deduplicated by storage, without parameters and constant inputs), for a
budget given as a fraction; ops after the last pack never run in the early-stopping
recompute and are worth nothing.

`solve_knapsack` picks the most valuable set that fits the budget; later calls of
blocks of that kind keep exactly that set (by op and per-op invocation index, as torch's
SAC storage indexes its entries), and `recompute_flops` says, by the recompute plan's
own rules (`ac_dce.make_plan`), what their recompute runs.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

import torch
import torch.nn as nn
from torch.utils._pytree import tree_unflatten

from parallelisms.ac_ops import (D2H_OPS, MATMUL_OPS, draws_random, has_flop_formula, is_device_to_host, is_runtime_op,
                                 op_flops, op_key)
from parallelisms.ac_dce import PACK_LISTENERS, CallRecorder, block_kind, make_plan
from parallelisms.ac_sac import plain_tensors, tracing_for_compile
from parallelisms.ac_trace import trace_enabled, trace_line
from parallelisms.activation_checkpoint import OpSAC

logger = logging.getLogger("ac")


def _storage(t: torch.Tensor):
    from torch.multiprocessing.reductions import StorageWeakRef
    try:
        return StorageWeakRef(t.untyped_storage()), int(t.untyped_storage().nbytes())
    except Exception:  # noqa: BLE001 - storage-less tensors
        return ("id", id(t)), t.numel() * t.element_size()


class _Storages:
    """A set of storages that forgets freed ones: the calibration call keeps nothing
    alive, so a freed storage's address (what a StorageWeakRef compares) is reused."""

    def __init__(self):
        self._refs: dict = {}

    def __contains__(self, key) -> bool:
        ref = self._refs.get(key)
        return ref is not None and not (hasattr(ref, "expired") and ref.expired())

    def add(self, key) -> None:
        self._refs.pop(key, None)
        self._refs[key] = key


def _is_parameter(t: torch.Tensor) -> bool:
    return isinstance(t, nn.Parameter) or isinstance(getattr(t, "_base", None), nn.Parameter)


@dataclass
class Candidate:
    op: object  # the OpOverload whose output is kept
    index: int  # its invocation index among this op's calls in the block (torch's SAC storage key)
    position: int  # its position among all the block's ops
    nbytes: int
    flops: int  # of the op itself
    value: int = 0  # the recompute FLOPs keeping it avoids (its op and the ops that only fed it)
    ops: int = 1  # the ops keeping it avoids (ranks the outputs whose chains have no FLOPs)

    @property
    def key(self) -> tuple[str, int]:
        return str(self.op), self.index


_ALWAYS = -1  # the owner of an op that runs in the recompute whatever is kept


@dataclass
class BlockCalibration:
    """What one full-AC call of a block reveals (see the module docstring)."""

    candidates: list[Candidate] = field(default_factory=list)  # packed outputs worth FLOPs
    extras: list[Candidate] = field(default_factory=list)  # packed outputs whose chain has no FLOPs
    forced: list[Candidate] = field(default_factory=list)  # ops with FLOPs that run whatever is kept
    pinned_bytes: int = 0  # outputs kept whatever the budget (collectives, routing, ...)
    none_bytes: int = 0
    input_bytes: int = 0
    stop: int | None = None  # ops dispatched before the last pack
    position: int = 0
    recorder: CallRecorder = field(default_factory=CallRecorder)
    flops: list = field(default_factory=list)  # per op
    nbytes: list = field(default_factory=list)  # per op: the new storages it made
    kinds: list = field(default_factory=list)  # per op: its kind (see `on_op`)
    _produced: _Storages = field(default_factory=_Storages)  # storages created inside the block
    _external: _Storages = field(default_factory=_Storages)  # from outside (inputs, parameters)
    _packed: _Storages = field(default_factory=_Storages)

    def close(self) -> None:
        """When the measured forward ends (its call registered `on_pack` while it ran)."""
        if self.on_pack in PACK_LISTENERS:
            PACK_LISTENERS.remove(self.on_pack)
        self.recorder.alive.clear()
        self._value_outputs()

    def _storages(self, tree):
        from torch.utils._pytree import tree_leaves
        for leaf in tree_leaves(tree):
            if isinstance(leaf, torch.Tensor):
                for t in plain_tensors(leaf):
                    yield _storage(t)

    def on_op(self, func, index: int, args, kwargs, out, kind: str) -> None:
        """Notes one op of the forward. `kind`: "candidate" (its output may be kept),
        "forced" (a force-recompute matmul: never kept), "pinned" (kept whatever the
        budget) or "other"."""
        for key, _ in self._storages((args, kwargs)):
            if key not in self._produced:
                self._external.add(key)  # the block's inputs, parameters, constants
        nbytes = 0
        for key, size in self._storages(out):
            if key not in self._produced and key not in self._external:
                self._produced.add(key)
                nbytes += size
        if kind == "pinned":
            self.pinned_bytes += nbytes
        pinned = kind == "pinned"
        self.recorder.on_op(func, index, args, kwargs, out, pinned, "SAVE" if pinned else "RECOMPUTE")
        self.flops.append(op_flops(func, args, kwargs, out) if kind in ("candidate", "forced") else 0)
        self.nbytes.append(nbytes)
        self.kinds.append(kind)
        self.position += 1

    def on_pack(self, x: torch.Tensor) -> None:
        self.recorder.on_pack(x)
        self.stop = self.position
        for t in plain_tensors(x):
            if _is_parameter(t):
                continue
            key, nbytes = _storage(t)
            inside = key in self._produced
            if key in self._packed or not (inside or t.requires_grad):
                continue  # already counted, or a constant from outside (RoPE table, mask)
            self._packed.add(key)
            self.none_bytes += nbytes
            if not inside:
                self.input_bytes += nbytes

    def _root(self, i: int) -> int:
        events = self.recorder.events
        while events[i].alias_of is not None:  # a view: the op that made its storage
            i = events[i].alias_of
        return i

    def _keepable(self, i: int) -> bool:
        """Whether op i's output can be kept for the packs on it: a functional aten op of
        the forward that made a storage (not a view of a weight), not written in place
        later, not kept anyway, and drawing no random numbers (a skipped dropout would shift
        the RNG of the random ops after it)."""
        e = self.recorder.events[i]
        func = e.func
        if not (self.kinds[i] == "candidate" and self.nbytes[i] > 0 and not e.saved and not e.mutated_later
                and i < (self.stop or 0) and isinstance(func, torch._ops.OpOverload) and func.namespace == "aten"
                and not func._schema.is_mutable):
            return False
        (leaves, spec), _ = self.recorder.calls[i]
        return not draws_random(func, *tree_unflatten(leaves, spec))

    def _value_outputs(self) -> None:
        """Splits the packed outputs into `candidates` (their chains have FLOPs) and
        `extras`, and the ops that run whatever is kept into `forced`. Each op the recompute
        could run is owned by the packs whose chains reach it (walking back from a pack
        through ops that are neither packed, kept nor run anyway); an op owned by one
        candidate only is avoided by keeping it. An op owned by several, or by something
        that always runs (a collective, an unkept output nothing reads, a pack that cannot
        be kept), counts as always run: `recompute_flops` then says what really runs."""
        rec, stop = self.recorder, self.stop or 0
        events = rec.events
        packed = {self._root(p) for p in rec.packed}
        cands = sorted(i for i in packed if self._keepable(i))
        is_cand = set(cands)
        consumed = {p for e in events for p in e.inputs}
        starts = {i: (i if i in is_cand else _ALWAYS) for i in range(stop) if not events[i].saved and (
            i in packed or events[i].must_run or i not in consumed)}
        owners: dict[int, set] = {}
        for start, owner in starts.items():
            todo, seen = list(events[start].inputs), set()
            while todo:
                i = todo.pop()
                if i in seen or i in starts or events[i].saved:
                    continue
                seen.add(i)
                owners.setdefault(i, set()).add(owner)
                todo.extend(events[i].inputs)
        value = {c: self.flops[c] for c in cands}
        ops = {c: 1 for c in cands}
        always = [i for i, o in starts.items() if o == _ALWAYS]
        for i, who in owners.items():
            if len(who) == 1 and _ALWAYS not in who:
                (c,) = who
                value[c] += self.flops[i]
                ops[c] += events[i].alias_of is None  # (views cost nothing)
            else:
                always.append(i)
        for c in cands:
            e = events[c]
            item = Candidate(e.func, e.index, c, self.nbytes[c], self.flops[c], value[c], ops[c])
            (self.candidates if value[c] > 0 else self.extras).append(item)
        self.forced = [Candidate(events[i].func, events[i].index, i, 0, self.flops[i], self.flops[i])
                       for i in sorted(always) if self.flops[i] > 0]

    def recompute_flops(self, kept: list[Candidate]) -> int:
        """The FLOPs the recompute runs when `kept` (and the pinned outputs) are kept,
        by the recompute plan's rules (`ac_dce.make_plan`: what backward reads, and
        what it is made from)."""
        import dataclasses
        rec, stop = self.recorder, self.stop or 0
        chosen = {c.position for c in kept}
        events = [dataclasses.replace(e, saved=e.saved or i in chosen) for i, e in enumerate(rec.events)]
        plan = make_plan(dataclasses.replace(rec, events=events), frozenset(), promote=False, release_saved=False)
        skipped = {(id(f), i) for f, i in plan.placeholders + plan.inplace}
        return sum(self.flops[i] for i in range(stop)
                   if not events[i].saved and (id(events[i].func), events[i].index) not in skipped)

    def budget_bytes(self, budget_mib: float | None, fraction: float) -> int:
        if budget_mib is not None:
            return int(min(budget_mib * 2**20, 2**62))
        reference = self.none_bytes if self.stop is not None else \
            self.input_bytes + self.pinned_bytes + sum(c.nbytes for c in self.candidates)
        return int(fraction * reference)


def solve_knapsack(items: list[tuple[int, int]], capacity: int, buckets: int = 1 << 15) -> list[int]:
    """Indices of a subset of `items` ((weight, value) pairs) with the largest total value
    and total weight <= `capacity`. 0/1 knapsack by dynamic programming over weights in
    units of their gcd (exact), or, when that grid would be finer than `buckets` cells, of
    capacity / buckets with weights rounded up (never over capacity; a loss of value is
    possible only within n units of slack). Items of value 0 are never taken."""
    live = [i for i, (w, v) in enumerate(items) if v > 0]
    if capacity <= 0 or not live:
        return [i for i in live if items[i][0] == 0]
    unit = 0
    for i in live:
        unit = math.gcd(unit, items[i][0])
    unit = max(unit, 1, -(-capacity // buckets))
    cap = capacity // unit
    weights = {i: -(-items[i][0] // unit) for i in live}
    best = [0] * (cap + 1)
    took: dict[int, list[bool]] = {}
    for i in live:
        w, v, row = weights[i], items[i][1], [False] * (cap + 1)
        for c in range(cap, w - 1, -1):
            if best[c - w] + v > best[c]:
                best[c], row[c] = best[c - w] + v, True
        took[i] = row
    chosen, c = [], cap
    for i in reversed(live):
        if took[i][c]:
            chosen.append(i)
            c -= weights[i]
    return sorted(chosen)


@dataclass
class BudgetChoice:
    """The ops a kind of block keeps, and the figures behind the choice (for AC_TRACE)."""

    keep: frozenset  # {(str(op), invocation index)}
    budget: int
    kept_bytes: int  # input + pinned + chosen candidates
    recompute_flops: int  # what the recompute runs (`BlockCalibration.recompute_flops`)
    total_flops: int  # what it runs when nothing is kept
    keep_ids: frozenset = frozenset()  # `keep` as {(id(op), index)}: what the per-op check reads

    def describe(self, calibration: BlockCalibration) -> str:
        everything = calibration.candidates + calibration.extras
        names = [f"{c.op}#{c.index}" for c in everything if c.key in self.keep]
        return (f"keeps {len(names)} of {len(everything)} packed outputs "
                f"({self.kept_bytes / 2**20:.2f} MiB for a budget of {self.budget / 2**20:.2f} MiB, none keeps "
                f"{calibration.none_bytes / 2**20:.2f} MiB); recomputes {self.recompute_flops / 1e9:.4f} of "
                f"{self.total_flops / 1e9:.4f} GFLOP: {', '.join(names) or 'nothing'}")


def choose(calibration: BlockCalibration, budget_mib: float | None, fraction: float) -> BudgetChoice:
    """The packed outputs to keep: the knapsack over those worth FLOPs, then, in the room
    left, those whose chains have none (most ops avoided per byte first)."""
    budget = calibration.budget_bytes(budget_mib, fraction)
    cands = calibration.candidates
    capacity = budget - calibration.input_bytes - calibration.pinned_bytes
    picked = [cands[i] for i in solve_knapsack([(c.nbytes, c.value) for c in cands], capacity)]
    room = capacity - sum(c.nbytes for c in picked)
    for c in sorted(calibration.extras, key=lambda c: (-c.ops / max(c.nbytes, 1), c.position)):
        if c.nbytes <= room:
            picked.append(c)
            room -= c.nbytes
    kept = calibration.input_bytes + calibration.pinned_bytes + sum(c.nbytes for c in picked)
    return BudgetChoice(frozenset(c.key for c in picked), budget, kept, calibration.recompute_flops(picked),
                        calibration.recompute_flops([]), frozenset((id(c.op), c.index) for c in picked))


# ---------------------------------------------------------------------------
# The policy
# ---------------------------------------------------------------------------

class BudgetSAC(OpSAC):
    """mode = "budget": eager memory-budget SAC. Each block keeps the set of packed
    outputs that avoids the most recompute FLOPs within `budget_mib` (or `budget_fraction`
    of what `none` keeps), chosen by `choose` from a measurement of the first call of
    each kind of block (that call runs as full AC). Ops `OpSAC` always saves that have no
    FLOPs (collectives, routing, device-to-host copies, the spec's and plan's ops) are
    kept whatever the budget, and charged to it first; force-recompute matmuls' outputs
    are never kept (the recompute plan skips them when what they feed is kept); the
    recompute plan skips every op only kept outputs need. `choices` / `calibrations` (by
    block kind) hold what was chosen and measured."""

    mode = "budget"
    cache_decisions = False  # decisions depend on each op's invocation index

    def __init__(self, cfg, **kwargs):
        super().__init__(cfg, **kwargs)
        self.choices: dict[tuple, BudgetChoice] = {}
        self.calibrations: dict[tuple, BlockCalibration] = {}

    def pinned_ops(self) -> frozenset:
        """Kept whatever the budget: the always-saved ops that have no FLOPs, and the ops
        a spec or plan lists."""
        return frozenset(op for op in self.save_ops() if not has_flop_formula(op)) | self.explicit_save_ops()

    def decisions_final(self, call) -> bool:
        return call.choice is not None

    def plan_options(self) -> dict:
        # Keep exactly the chosen set: no more outputs kept, none of them released.
        return {"promote": False, "release_saved": False}

    def calibrated(self, block: nn.Module, prefix: str = "") -> bool:
        return block_kind(block) in self.choices and super().calibrated(block, prefix)

    def block_info(self, block: nn.Module | None, prefix: str) -> dict:
        kind = block_kind(block) if block is not None else (prefix,)
        return {**super().block_info(block, prefix), "kind": kind, "pinned": self.pinned_ops()}

    def start_call(self, call) -> None:
        call.kind, call.prefix = call.info.get("kind", ("?",)), call.info.get("prefix", "")
        call.pinned = call.info.get("pinned", frozenset())
        call.choice = self.choices.get(call.kind)
        call.calibration = None
        if call.choice is None and not tracing_for_compile():
            call.calibration = BlockCalibration()
            call.listening.append(call.calibration.on_pack)  # (while the forward runs: OpSACPolicy.open)

    def decide(self, call, func, is_recompute: bool, args=(), out=None):
        from torch.utils.checkpoint import CheckpointPolicy as P
        key = op_key(func)
        call.op_kind = "other"
        if is_runtime_op(func):
            return P.PREFER_RECOMPUTE, "RECOMPUTE", "runtime op"
        forced = call.scope.current() if call.scope is not None and key in MATMUL_OPS else None
        if forced is not None:
            call.op_kind = "forced"
            return P.PREFER_RECOMPUTE, "RECOMPUTE", f"force_recompute_mm_fqns: {forced}"
        if key in call.pinned or func in call.pinned or (key in D2H_OPS and is_device_to_host(args, out)):
            call.op_kind = "pinned"
            return P.MUST_SAVE, "SAVE", "kept whatever the budget"
        call.op_kind = "candidate"
        if call.choice is None:
            return P.PREFER_RECOMPUTE, "RECOMPUTE", "budget: measuring this block"
        if (id(func), call.index) in call.choice.keep_ids:  # (ints: no OpOverload hash, no str)
            return P.MUST_SAVE, "SAVE", "budget"
        return P.PREFER_RECOMPUTE, "RECOMPUTE", ""

    def observe(self, call, func, args, kwargs, out, policy) -> None:
        if call.calibration is not None:
            call.calibration.on_op(func, call.index, args, kwargs, out, call.op_kind)

    def end_call(self, call, storage) -> None:
        calibration, call.calibration = call.calibration, None
        if calibration is None:
            return
        calibration.close()
        choice = choose(calibration, self.cfg.budget_mib, self.cfg.budget_fraction)
        self.choices[call.kind], self.calibrations[call.kind] = choice, calibration
        text = choice.describe(calibration)
        logger.info("activation checkpointing budget: %s %s", call.prefix, text)
        if trace_enabled():
            trace_line(text, f"BUDGET {call.prefix}: {text}")
