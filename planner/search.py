"""The search: enumerate layouts, prune with the project's validators, rank by predicted time.

Why branch and bound: the space (dp_replicate, dp_shard, tp, cp and its method, ep, pp
with schedule, microbatch and stages per rank, local batch, AC mode and budget, chunked
CE, float8, compile) has millions of points for a 671B model on 1,024 GPUs, and the exact
memory estimate costs seconds. A *skeleton* (the degrees) has an optimistic time (largest
local batch, no recompute, compile and float8 where they help) that bounds every option
under it. Skeletons are walked fastest first; within one, options are tried in predicted
time order and the first that passes the validators and fits is its plan (every other
option of that skeleton is slower). The walk stops when the next skeleton's bound is
slower than the top-N plans found. Memory comes from planner/memory.py (one estimator
run per structural key); a cheap lower bound (16 bytes per local parameter) skips
skeletons that cannot fit before any estimate runs.

Validators: `check_layout` and `ParallelDims` (the config checks) prune each candidate,
and every plan returned has passed `load_config(...)` plus `batch_layout` on its world,
which is what `./run_train.sh` runs before it starts a worker.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from dataclasses import dataclass, field

from planner.hardware import Hardware
from planner.layout import Plan
from planner.memory import MemoryModel, PlanMemory
from planner.step_time import StepTime, predict
from planner.workload import Workload

GiB = 1024**3
# The share of a GPU's memory a plan leaves free (--margin): the estimate counts tensors and the
# GPU terms, while the allocator's fragmentation and what the estimate misses come on top
# (docs/planner.md, "Known blind spots": published reserved memory runs 6-12% above ours).
DEFAULT_MARGIN = 0.10
PP_SCHEDULES = (("1F1B", 1), ("Interleaved1F1B", 2), ("InterleavedZeroBubble", 2), ("ZBVZeroBubble", 2))
# AC modes by what they keep, least first: full keeps each block's input only; budget 0.5 and
# op keep part of the rest; none keeps it all (full's least option bounds every mode's).
FRUGAL_ORDER = ("full", "budget", "op", "none")


@dataclass
class Space:
    """What the search may choose (the CLI narrows it)."""

    ac_modes: tuple = ("none", "op", "full", "budget")
    budgets: tuple = (0.5,)
    compile: tuple = (False, True)
    float8: tuple = (False, True)
    chunked_ce: tuple = (False, True)
    max_local_batch: int = 16
    min_tokens_per_cp_rank: int = 4096
    fixed: dict = field(default_factory=dict)  # plan field -> value every plan must have


@dataclass
class Result:
    plan: Plan
    time: StepTime
    memory: PlanMemory


@dataclass
class SearchStats:
    skeletons: int = 0
    visited: int = 0
    options_tried: int = 0
    rejected_by_validators: int = 0
    rejected_by_bound: int = 0
    rejected_by_memory: int = 0


def _pow2_upto(n: int) -> list[int]:
    out, v = [], 1
    while v <= n:
        out.append(v)
        v *= 2
    return out


class Search:
    def __init__(self, cfg, base_argv: list[str], w: Workload, hw: Hardware, world: int, seq_len: int,
                 global_samples: int, space: Space, memory: MemoryModel, margin: float = DEFAULT_MARGIN,
                 max_estimates: int | None = None):
        self.cfg, self.base_argv, self.w, self.hw = cfg, base_argv, w, hw
        self.world, self.seq, self.samples, self.space, self.memory = world, seq_len, global_samples, space, memory
        self.margin = margin  # the share of the device's memory a plan must leave free
        self.capacity = hw.hbm_gib * GiB * (1 - margin)
        self.esize = 4 if hw.device == "cpu" else 2
        self.stats = SearchStats()
        self._layout_ok: dict = {}
        self._mem_fail: dict = {}
        self._footprints: list = []  # per plan checked: (bytes or a lower bound, order, plan, PlanMemory or None)
        self.max_estimates = max_estimates  # stop the walk before the estimator runs more often (--dry-run)
        self.truncated = False

    # ---- enumeration ----
    def skeletons(self):
        W, gpn, w, sp = self.world, self.hw.gpus_per_node, self.w, self.space
        moe = bool(w.moe_layers)
        fx = sp.fixed
        for tp in _pow2_upto(min(gpn, W)):
            for cp in _pow2_upto(W // tp):
                if cp > 1 and (self.seq % (2 * cp) or self.seq // cp < sp.min_tokens_per_cp_rank):
                    continue
                for method in (("allgather", "alltoall") if cp > 1 else ("allgather",)):
                    for pp in _pow2_upto(min(W // (tp * cp), w.n_layers)):
                        if W % (tp * cp * pp):
                            continue
                        dp = W // (tp * cp * pp)
                        if self.samples % dp:
                            continue
                        scheds = PP_SCHEDULES if pp > 1 else (("1F1B", 1),)
                        for sched, spr in scheds:
                            if pp * spr > w.n_layers:  # a stage needs a block (check_pipeline_layout)
                                continue
                            for mb in ((1, 2) if pp > 1 else (1,)):
                                for rep in _pow2_upto(dp):
                                    shard = dp // rep
                                    if rep > 1 and shard * cp * tp < gpn:  # a replica spans at least a node
                                        continue
                                    eps = [1]
                                    if moe:
                                        routed = getattr(self.cfg.model_args, "n_routed_experts", 1)
                                        eps += [e for e in _pow2_upto(shard * cp * tp)[1:] if routed % e == 0]
                                    for ep in eps:
                                        plan = Plan(world=W, dp_replicate=rep, dp_shard=shard, tp=tp, cp=cp,
                                                    cp_method=method, pp=pp, schedule=sched, stages_per_rank=spr,
                                                    microbatch=mb, ep=ep)
                                        if all(getattr(plan, k) == v for k, v in fx.items()
                                               if k in ("tp", "cp", "pp", "ep", "dp_replicate", "dp_shard",
                                                        "cp_method", "schedule", "stages_per_rank", "microbatch")):
                                            yield plan

    def options(self, skel: Plan):
        sp = self.space
        per_dp = self.samples // skel.dp
        cuda = self.hw.device == "cuda"
        for lb in _pow2_upto(min(per_dp, sp.max_local_batch)):
            if per_dp % lb or (skel.pp > 1 and lb % skel.microbatch):
                continue
            for ac in sp.ac_modes:
                budgets = sp.budgets if ac == "budget" else (0.5,)
                for b in budgets:
                    for cce in sp.chunked_ce:
                        if cce and (skel.tp > 1 or skel.pp > 1):
                            continue
                        for comp in sp.compile:
                            if comp and ac == "budget":
                                continue
                            for f8 in sp.float8:
                                if f8 and not (cuda and self.hw.fp8_tflops > 0):
                                    continue
                                p = dataclasses.replace(skel, local_batch=lb, grad_accum=per_dp // lb, ac=ac,
                                                        budget_fraction=b, chunked_ce=cce, compile=comp, float8=f8,
                                                        float8_all_gather=f8 and self._float8_gather(skel))
                                if all(getattr(p, k) == v for k, v in sp.fixed.items()):
                                    yield p

    def _float8_gather(self, skel: Plan) -> bool:
        """float8 plans gather in float8 wherever FSDP shards (half the bytes; tensorwise only)."""
        sharded = skel.dp_shard * skel.cp * skel.dp_replicate > 1
        return sharded and self.cfg.float8.recipe == "tensorwise"

    # ---- checks ----
    def layout_ok(self, plan: Plan) -> bool:
        """`check_layout` and `ParallelDims` on the plan's degrees (cached: no dp in the key)."""
        from parallelisms.float8 import float8_filter
        from parallelisms.parallel_dims import ParallelDims, check_layout
        from configuration.fields import ConfigError

        key = (plan.tp, plan.cp, plan.cp_method, plan.pp, plan.schedule, plan.stages_per_rank, plan.microbatch,
               plan.ep, plan.local_batch, plan.chunked_ce, plan.dp_shard, plan.dp_replicate)
        if key not in self._layout_ok:
            par = dataclasses.replace(
                self.cfg.parallelism, data_parallel_replicate_degree=plan.dp_replicate,
                data_parallel_shard_degree=plan.dp_shard, tensor_parallel_degree=plan.tp,
                context_parallel_degree=plan.cp, context_parallel_method=plan.cp_method,
                pipeline_parallel_degree=plan.pp, pipeline_parallel_schedule=plan.schedule,
                pipeline_parallel_stages_per_rank=plan.stages_per_rank,
                pipeline_parallel_microbatch_size=plan.microbatch, expert_parallel_degree=plan.ep,
                module_fqns_per_model_part=None)
            try:
                check_layout(par, self.cfg.model_args, seq_len=self.seq, local_batch_size=plan.local_batch,
                             model_spec=self.cfg.model_spec, chunked_ce=plan.chunked_ce,
                             float8_filter=float8_filter(self.cfg.float8))
                ParallelDims.from_config(par, plan.world)
                self._layout_ok[key] = True
            except ConfigError:
                self._layout_ok[key] = False
        return self._layout_ok[key]

    def accepted(self, plan: Plan) -> bool:
        """What ./run_train.sh checks before a worker starts: the full config load on the world."""
        from configuration.fields import ConfigError
        from trainer.layout import layout_for

        try:
            layout_for(self.memory.config_for(plan), plan.world)
        except (ConfigError, ImportError):
            return False
        return True

    def persistent_bound(self, plan: Plan) -> float:
        """A lower bound of the tensors per rank: 16 bytes (param, grad, 2 moments, fp32) per
        local parameter of an average PP rank, plus FSDP's gathered parameters in the compute
        dtype (under PP the trainer keeps a stage's units gathered: reshard_after_forward
        default; otherwise at least one block), and under PP the stage's gradients, unsharded in
        fp32 over the microbatches. Routed experts are sharded over
        dp_shard x cp x tp with EP, over dp_shard x cp without it."""
        w = self.w
        tp_dense = plan.tp
        dense = (sum(w.layer_dense) + sum(w.layer_norms) + w.embedding + (0 if w.tied_head else w.head)) / tp_dense
        expert_ranks = plan.dp_shard * plan.cp * (plan.tp if plan.ep > 1 else 1)
        experts = sum(w.layer_experts)
        local = (dense / (plan.dp_shard * plan.cp) + experts / expert_ranks) / plan.pp
        gathered_stage = (dense + experts / (plan.ep if plan.ep > 1 else 1)) / plan.pp
        fsdp = plan.dp_shard * plan.cp > 1 or plan.dp_replicate > 1
        if not fsdp:
            buffers = 0.0
        elif plan.pp > 1:  # the sharded gradients give way to the unsharded ones (fp32) held over microbatches
            return 0.97 * (12 * local + gathered_stage * (self.esize + 4))
        else:
            buffers = gathered_stage / self.w.n_layers * self.esize
        return 0.97 * (16 * local + buffers)

    def activation_bound(self, plan: Plan) -> float:
        """`persistent_bound` plus what any AC mode keeps: each block's input (one hidden
        state per token of the rank) for the microbatches a PP rank holds at once."""
        from planner.memory import _units

        rows = plan.samples_per_microbatch * self.seq / (plan.cp * (plan.tp if plan.tp > 1 else 1))
        blocks = self.w.n_layers / plan.pp
        per_unit = blocks / plan.stages_per_rank
        held = _units(plan) * per_unit if plan.pp > 1 else blocks
        return self.persistent_bound(plan) + 0.9 * rows * self.w.dim * self.esize * held

    def predict(self, plan: Plan) -> StepTime:
        return predict(plan, self.w, self.hw, self.seq, compute_bytes=self.esize)

    def optimistic(self, skel: Plan) -> float:
        per_dp = self.samples // skel.dp
        lbs = [lb for lb in _pow2_upto(min(per_dp, self.space.max_local_batch)) if per_dp % lb == 0
               and (skel.pp == 1 or lb % skel.microbatch == 0)]
        if not lbs:
            return math.inf
        lb = lbs[-1]
        best = math.inf
        for comp in self.space.compile:
            for f8 in self.space.float8:
                f8 = f8 and self.hw.fp8_tflops > 0 and self.hw.device == "cuda"
                p = dataclasses.replace(skel, local_batch=lb, grad_accum=per_dp // lb, ac="none", compile=comp,
                                        float8=f8, float8_all_gather=f8 and self._float8_gather(skel))
                best = min(best, self.predict(p).step_s)
        return best

    @staticmethod
    def _memory_key(plan: Plan) -> Plan:
        """The plan without what its memory does not depend on (the batch aside): compile and
        float8 count as eager bf16."""
        return dataclasses.replace(plan, local_batch=0, grad_accum=0, compile=False, float8=False,
                                   float8_all_gather=False)

    def _dominated(self, plan: Plan) -> bool:
        return plan.local_batch >= self._mem_fail.get(self._memory_key(plan), math.inf)

    def fits(self, plan: Plan) -> PlanMemory | None:
        mem, total = self.memory.fit(plan, self.capacity)
        self._footprints.append((total, len(self._footprints), plan, mem))
        if mem is None:
            key = self._memory_key(plan)
            self._mem_fail[key] = min(self._mem_fail.get(key, math.inf), plan.local_batch)
            return None
        return mem

    def min_footprint(self) -> tuple | None:
        """(bytes, plan, PlanMemory) of the smallest footprint among the plans checked (the
        first of equals). A plan rejected on a lower bound is estimated here only if that
        bound does not exceed the best footprint known."""
        best = None
        for low, order, plan, mem in sorted(self._footprints, key=lambda f: f[:2]):
            if best is not None and low > best[0]:
                break
            mem = mem or self.memory.of(plan)
            if best is None or (mem.total, order) < best[:2]:
                best = (mem.total, order, plan, mem)
        return None if best is None else (best[0], best[2], best[3])

    def frugal_fits(self, skel: Plan) -> bool:
        """Whether the skeleton's least memory fits: per AC mode the space allows, least-memory
        mode first (`FRUGAL_ORDER`), its smallest local batch; one estimate per mode at most,
        and none once a mode fits. Memory does not depend on compile or float8 (the estimator
        counts both as eager bf16), so whichever values the space allows stand for all. With
        `full` allowed, its option is the least of all and decides alone."""
        opts = [p for p in self.options(skel) if self.layout_ok(p)]
        modes = sorted({p.ac for p in opts}, key=FRUGAL_ORDER.index)
        if "full" in modes:
            modes = ["full"]
        for mode in modes:
            small = min((p for p in opts if p.ac == mode), key=lambda p: (p.local_batch, not p.chunked_ce))
            if self.activation_bound(small) > self.capacity:
                self.stats.rejected_by_bound += 1
                continue
            if self.max_estimates is not None and self.memory.calls >= self.max_estimates \
                    and not self.memory.cached(small):
                return True  # unknown: let the options decide (the walk stops at its next estimate)
            if self.fits(small) is not None:
                return True
        return False

    # ---- the walk ----
    def run(self, top: int = 10) -> list[Result]:
        skels = []
        for s in self.skeletons():
            self.stats.skeletons += 1
            if self.persistent_bound(s) > self.capacity:
                self.stats.rejected_by_bound += 1
                continue
            t = self.optimistic(s)
            if t < math.inf:
                skels.append((t, self.stats.skeletons, s))
        heapq.heapify(skels)
        results: list[Result] = []
        while skels:
            bound, _, skel = heapq.heappop(skels)
            if len(results) >= top and bound >= results[top - 1].time.step_s:
                break
            self.stats.visited += 1
            if not self.frugal_fits(skel):
                continue
            opts = sorted(((self.predict(p), p) for p in self.options(skel)), key=lambda x: x[0].step_s)
            for st, plan in opts:
                if len(results) >= top and st.step_s >= results[top - 1].time.step_s:
                    break  # every later option of this skeleton is slower than the top N
                self.stats.options_tried += 1
                if self.activation_bound(plan) > self.capacity:
                    self.stats.rejected_by_bound += 1
                    continue
                if not self.layout_ok(plan):
                    self.stats.rejected_by_validators += 1
                    continue
                if self._dominated(plan):
                    self.stats.rejected_by_memory += 1
                    continue
                if self.max_estimates is not None and self.memory.calls >= self.max_estimates \
                        and not self.memory.cached(plan):
                    self.truncated = True
                    return results[:top]
                mem = self.fits(plan)
                if mem is None:
                    self.stats.rejected_by_memory += 1
                    continue
                if not self.accepted(plan):
                    self.stats.rejected_by_validators += 1
                    continue
                results.append(Result(plan, st, mem))
                results.sort(key=lambda r: r.time.step_s)
                break
        return results[:top]
