"""The eager memory-budget SAC (`activation_checkpoint.mode = "budget"`): measure one block, solve a knapsack.

Why: the compile partitioner's `memory_budget` needs torch.compile; op-level SAC's
"every other matmul" rule ignores what each op costs. Here the first call of each kind
of block is run as full AC while `BlockCalibration` records, exactly, for every op
whose output could be kept:

- its weight: the bytes of the new storage its outputs occupy (what the SAC cache would
  hold, the same count as `ac_measure.SavedActivationCounter`);
- its value: the recompute FLOPs that keeping it avoids, i.e. its FLOPs
  (`ac_ops.op_flops`, FlopCounterMode's formulas) if the early-stopping recompute
  re-runs it, and 0 if the recompute stops before reaching it (a block's last matmul);
- what `none` would keep for the block (every tensor autograd packs, deduplicated by
  storage, without parameters and constant inputs), for a budget given as a fraction.

Where the recompute stops is read from the checkpoint's own pack events: autograd packs
an op's inputs just before the op runs, the recompute stops at the last pack, so the ops
dispatched before the last pack are the ones it re-runs. The packs are observed through
`ac_sac.PACK_LISTENERS` (the op-level policy's `determinism_check` hook, which also
returns the default metadata, so the determinism check is unchanged).

`solve_knapsack` then picks the most valuable set that fits the budget; later calls of
blocks of that kind keep exactly that set (by op and per-op invocation index, as torch's
SAC storage indexes its entries).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from parallelisms.ac_ops import D2H_OPS, MATMUL_OPS, has_flop_formula, is_device_to_host, is_runtime_op, op_flops, op_key
from parallelisms.ac_dce import PACK_LISTENERS, block_kind
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
    op: object  # the OpOverload
    index: int  # its invocation index among this op's calls in the block (torch's SAC storage key)
    position: int  # its position among all the block's ops
    nbytes: int
    flops: int
    value: int = 0  # flops if the recompute re-runs it, else 0

    @property
    def key(self) -> tuple[str, int]:
        return str(self.op), self.index


@dataclass
class BlockCalibration:
    """What one full-AC call of a block reveals (see the module docstring)."""

    candidates: list[Candidate] = field(default_factory=list)
    forced: list[Candidate] = field(default_factory=list)  # force-recompute matmuls
    pinned_bytes: int = 0  # outputs kept whatever the budget (collectives, routing, ...)
    none_bytes: int = 0
    input_bytes: int = 0
    stop: int | None = None  # ops dispatched before the last pack
    position: int = 0
    _produced: _Storages = field(default_factory=_Storages)  # storages created inside the block
    _external: _Storages = field(default_factory=_Storages)  # from outside (inputs, parameters)
    _packed: _Storages = field(default_factory=_Storages)

    def __enter__(self):
        PACK_LISTENERS.append(self.on_pack)
        return self

    def __exit__(self, *exc):
        if self.on_pack in PACK_LISTENERS:
            PACK_LISTENERS.remove(self.on_pack)
        for c in self.candidates + self.forced:
            c.value = c.flops if self.stop is None or c.position < self.stop else 0

    def _storages(self, tree):
        from torch.utils._pytree import tree_leaves
        for leaf in tree_leaves(tree):
            if isinstance(leaf, torch.Tensor):
                for t in plain_tensors(leaf):
                    yield _storage(t)

    def on_op(self, func, index: int, args, kwargs, out, kind: str) -> None:
        """Notes one op of the forward. `kind`: "candidate" (recorded if it has FLOPs),
        "forced" (always recomputed), "pinned" (kept whatever the budget) or "other"."""
        for key, _ in self._storages((args, kwargs)):
            if key not in self._produced:
                self._external.add(key)  # the block's inputs, parameters, constants
        nbytes = 0
        for key, size in self._storages(out):
            if key not in self._produced and key not in self._external:
                self._produced.add(key)
                nbytes += size
        if kind in ("candidate", "forced"):
            flops = op_flops(func, args, kwargs, out)
            if flops > 0:
                (self.candidates if kind == "candidate" else self.forced).append(
                    Candidate(func, index, self.position, nbytes, flops))
        elif kind == "pinned":
            self.pinned_bytes += nbytes
        self.position += 1

    def on_pack(self, x: torch.Tensor) -> None:
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
    recompute_flops: int  # what the recompute re-runs (force-recompute matmuls included)
    total_flops: int  # of every op the recompute of full AC re-runs
    keep_ids: frozenset = frozenset()  # `keep` as {(id(op), index)}: what the per-op check reads

    def describe(self, calibration: BlockCalibration) -> str:
        names = [f"{c.op}#{c.index}" for c in calibration.candidates if c.key in self.keep]
        return (f"keeps {len(names)} of {len(calibration.candidates)} candidate ops "
                f"({self.kept_bytes / 2**20:.2f} MiB for a budget of {self.budget / 2**20:.2f} MiB, none keeps "
                f"{calibration.none_bytes / 2**20:.2f} MiB); recomputes {self.recompute_flops / 1e9:.4f} of "
                f"{self.total_flops / 1e9:.4f} GFLOP: {', '.join(names) or 'nothing'}")


def choose(calibration: BlockCalibration, budget_mib: float | None, fraction: float) -> BudgetChoice:
    budget = calibration.budget_bytes(budget_mib, fraction)
    cands = calibration.candidates
    capacity = budget - calibration.input_bytes - calibration.pinned_bytes
    picked = solve_knapsack([(c.nbytes, c.value) for c in cands], capacity)
    total = sum(c.value for c in cands + calibration.forced)
    kept = calibration.input_bytes + calibration.pinned_bytes + sum(cands[i].nbytes for i in picked)
    return BudgetChoice(frozenset(cands[i].key for i in picked), budget, kept,
                        total - sum(cands[i].value for i in picked), total,
                        frozenset((id(cands[i].op), cands[i].index) for i in picked))


# ---------------------------------------------------------------------------
# The policy
# ---------------------------------------------------------------------------

class BudgetSAC(OpSAC):
    """mode = "budget": eager memory-budget SAC. Each block keeps the set of op outputs
    that avoids the most recompute FLOPs within `budget_mib` (or `budget_fraction` of
    what `none` keeps), chosen by `solve_knapsack` from a measurement of the first call of
    each kind of block (that call runs as full AC). Ops `OpSAC` always saves that have no
    FLOPs (collectives, routing, device-to-host copies, the spec's and plan's ops) are
    kept whatever the budget, and charged to it first; force-recompute matmuls stay
    recomputed; everything else is recomputed. `choices` / `calibrations` (by block
    kind) hold what was chosen and measured."""

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
            call.calibration = BlockCalibration().__enter__()

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
        calibration.__exit__(None, None, None)
        choice = choose(calibration, self.cfg.budget_mib, self.cfg.budget_fraction)
        self.choices[call.kind], self.calibrations[call.kind] = choice, calibration
        text = choice.describe(calibration)
        logger.info("activation checkpointing budget: %s %s", call.prefix, text)
        if trace_enabled():
            trace_line(text, f"BUDGET {call.prefix}: {text}")
