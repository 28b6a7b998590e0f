"""Per-rank memory of a plan, from the project's exact estimator (trainer/memory/), cached.

Why cached and scaled: the estimator lays one rank out through the trainer's assembly
path on fake tensors, which takes 0.5 s for an 8B model and several seconds for 671B
with PP (every PP rank is assembled). A search visits thousands of plans, but only a few
distinct *local shapes*. So the estimator runs once per structural key (tp, cp and its
method, pp with its schedule and stages, ep, AC, chunked CE, HSDP or not) on the smallest
world with those degrees and the smallest microbatch, through its fast path
(`trainer.memory.estimate_cache.EstimateCache`, shared by every key: one assembled rank per
distinct stage or module shape, probes shared across keys, equal bytes to the full path),
and a plan is then read off it:

- parameters, gradients and AdamW states are sharded over dp_shard (x cp, x tp for
  experts): they scale by dp_shard(reference) / dp_shard (exact up to FSDP's padding),
  also the gradients a backward phase holds (`MemoryEstimate.phase_grads`, the head's;
  `earlier_blocks`, those of the blocks done with backward while an earlier one runs its
  own, block by block);
- what the blocks keep for backward, the loss peak and a block's backward transient are
  linear in the microbatch's tokens; under PP the kept activations also scale with the
  schedule's in-flight stage-microbatches (`_in_flight_units`, the estimator's own rule);
- FSDP's gathered buffers do not change; accumulated gradients are held when the plan
  accumulates (PP or gradient accumulation), and under PP with FSDP every unit's gradient
  is held unsharded over the microbatches (the same at any dp_shard);
- the GPU terms (CUDA context, NCCL buffers, EP imbalance) come from the estimator
  (`trainer/memory/device_overhead.py`); the allocator's margin is re-taken on the
  scaled peak.

Each key has two points, the reference and its double microbatch (`MemoryModel.reference`);
the second is read for its phases only, so it skips the EP-skewed probe. Keys whose plans
rarely fit (`LAZY_AC`) start from the first point without that probe, which bounds each
plan's memory from below (`scale(bound=True)`), and get the rest only when a bound fits
(`MemoryModel.fit`): the search's verdicts and numbers are the eager ones, for less work.

A plan whose dp_shard and microbatch equal the reference's is the estimator's exact
number (`PlanMemory.exact`); `--verify` re-runs the estimator on the chosen plan itself.
float8 and compile are counted as eager bf16 (the estimator's convention; both keep less).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

from planner.layout import Plan
from trainer.memory.estimate import EARLIER_BLOCK_BACKWARD


@dataclass
class PlanMemory:
    total: int  # bytes that must fit per rank (tensors + device terms on CUDA)
    tensors: int  # the tensor peak (params + optimizer + the largest step phase)
    persistent: int
    activations: int
    peak_phase: str
    device_terms: int
    exact: bool  # the estimator ran on this very plan (no scaling)
    reference: object = None  # the MemoryEstimate it was read from


def structural_key(plan: Plan) -> tuple:
    return (plan.tp, plan.cp, plan.cp_method if plan.cp > 1 else "", plan.pp,
            _schedule_class(plan), plan.stages_per_rank, plan.ep, plan.ac,
            plan.budget_fraction if plan.ac == "budget" else None, plan.chunked_ce, plan.dp_replicate > 1,
            plan.dp_shard > 1)


def _schedule_class(plan: Plan) -> str:
    """Schedules with the same stage placement share a reference (their in-flight counts are
    scaled): "V" schedules put the first and the last stage on PP rank 0, the others loop."""
    from parallelisms.parallel_dims import V_SCHEDULES

    if plan.pp == 1:
        return ""
    return "V" if plan.schedule in V_SCHEDULES else "loop"


def reference_plan(plan: Plan) -> Plan:
    """The smallest plan with the same local shapes except dp_shard and the microbatch."""
    d0 = plan.dp_shard
    for d in range(1, plan.dp_shard + 1):
        if plan.dp_shard % d == 0 and (d > 1 or plan.dp_shard == 1) and (d * plan.cp * plan.tp) % plan.ep == 0:
            d0 = d
            break
    rep = 2 if plan.dp_replicate > 1 else 1
    if plan.pp > 1:
        # The fewest microbatches each schedule accepts (parallel_dims.check_pipeline_layout refuses fewer).
        need = {"1F1B": plan.pp, "Interleaved1F1B": plan.pp, "InterleavedZeroBubble": plan.pp,
                "ZBVZeroBubble": plan.pp, "DualPipeV": plan.pp * plan.stages_per_rank}.get(plan.schedule, 1)
        mb, lb = 1, need
    else:
        mb, lb = 1, 1
    world = rep * d0 * plan.cp * plan.tp * plan.pp
    return dataclasses.replace(plan, world=world, dp_replicate=rep, dp_shard=d0, microbatch=mb, local_batch=lb,
                               grad_accum=1, float8=False, float8_all_gather=False, compile=False)


# AC modes whose references are estimated lazily: the EP-skewed probe and the second point
# only once a plan's lower bound fits. `budget` gives every probe a fresh assembly anyway (so
# laziness costs nothing); `none` only where the EP skew applies (a MoE model, whose `none`
# plans the bound rejects): elsewhere most `none` plans fit and would cost a second assembly.
LAZY_AC = ("budget", "none")


@dataclass
class _Reference:
    """What a structural key's plans are read off (`MemoryModel.of`)."""

    plan: Plan  # the reference plan
    double: Plan  # the reference at twice its microbatch
    est: object  # its MemoryEstimate; without the EP-skewed probe until `skewed`
    skewed: bool  # `est` is the estimator's own (the skewed probe ran, or none applies)
    est2: object | None  # the estimate of `double` (phases only), None until needed


class MemoryModel:
    """Plans -> `PlanMemory`, with one estimator run per structural key."""

    def __init__(self, base_argv: list[str], device: str, gpus_per_node: int, overheads=None):
        self.base_argv, self.device, self.gpn, self.overheads = list(base_argv), device, gpus_per_node, overheads
        self.cache: dict = {}
        from trainer.memory.estimate_cache import EstimateCache

        self.shared = EstimateCache()  # assemblies and probes shared by all the references
        self.calls = 0
        self.hits = 0
        self.seconds = 0.0

    def config_for(self, plan: Plan):
        from trainer.config import load_config

        return load_config(self.base_argv + plan.overrides(), world_size=plan.world)

    def _phases_only(self):
        """The GPU terms without the EP-skewed probe: for an estimate read only for its step
        phases (`scale` reads no device term of `est2`), which then skips that probe."""
        from trainer.memory.device_overhead import GpuOverheads

        return dataclasses.replace(self.overheads or GpuOverheads(), ep_imbalance=1.0)

    def estimate_exact(self, plan: Plan, phases_only: bool = False):
        """The full estimator on `plan` (every PP rank assembled afresh); `phases_only`: as
        `reference` estimates its second point (no EP-skewed probe)."""
        from trainer.memory import estimate_memory

        t0 = time.perf_counter()
        cfg = self.config_for(plan)
        est = estimate_memory(cfg, plan.world, device=self.device, gpus_per_node=self.gpn,
                              overheads=self._phases_only() if phases_only else self.overheads)
        self.calls += 1
        self.seconds += time.perf_counter() - t0
        return est

    def _skewed(self, plan: Plan) -> bool:
        """Whether `plan`'s estimate probes the EP-skewed rows (the estimator's own rule)."""
        from trainer.memory.assemble import resolve_layout
        from trainer.memory.device_overhead import GpuOverheads
        from trainer.memory.estimate import _skew

        layout = resolve_layout(self.config_for(plan), plan.world)
        return _skew(layout, self.device, self.overheads or GpuOverheads()) is not None

    def _estimate(self, plans: list, overheads: list) -> list:
        """The estimator's fast path on plans of one layout and AC setting at once: equal bytes
        to `estimate_exact`, with assemblies and probes shared through `shared`."""
        from trainer.memory.estimate import estimate_memories

        t0 = time.perf_counter()
        out = estimate_memories([self.config_for(p) for p in plans], plans[0].world, device=self.device,
                                overheads=overheads, cache=self.shared)
        self.calls += len(plans)
        self.seconds += time.perf_counter() - t0
        return out

    def _entry(self, plan: Plan) -> _Reference:
        """The cache entry of `plan`'s structural key; a new one is estimated at once in full
        (both points, one assembly), except under the AC modes of `LAZY_AC`, and without its
        second point where `plan` has the reference's microbatch (most pipeline plans: a
        later plan that needs the point gets it then)."""
        key = structural_key(plan)
        if key in self.cache:
            self.hits += 1
            return self.cache[key]
        ref = reference_plan(plan)
        double = dataclasses.replace(ref, microbatch=2 * ref.microbatch, local_batch=2 * ref.local_batch)
        skew = self._skewed(ref)
        if plan.ac in LAZY_AC and (skew or plan.ac == "budget"):
            est, = self._estimate([ref], [self._phases_only()])
            entry = _Reference(ref, double, est, not skew, None)
        elif _tokens(ref, plan) == 1:  # e.g. PP at the reference's microbatch: `scale` reads no second point
            est, = self._estimate([ref], [self.overheads])
            entry = _Reference(ref, double, est, True, None)
        else:
            est, est2 = self._estimate([ref, double], [self.overheads, self._phases_only()])
            entry = _Reference(ref, double, est, True, est2)
        self.cache[key] = entry
        return entry

    def _complete(self, entry: _Reference, second: bool) -> None:
        """Estimates what `entry` lacks: the EP-skewed probe, and the second point if `second`."""
        plans, overheads = [], []
        if not entry.skewed:
            plans.append(entry.plan)
            overheads.append(self.overheads)
        if second and entry.est2 is None:
            plans.append(entry.double)
            overheads.append(self._phases_only())
        if not plans:
            return
        out = self._estimate(plans, overheads)
        if not entry.skewed:
            entry.est, entry.skewed = out.pop(0), True
        if out:
            entry.est2 = out[0]

    def reference(self, plan: Plan):
        """(reference plan, its estimate, the estimate at twice its microbatch): two points,
        because a block's backward transient and the loss peak have parts that do not grow
        with the tokens (gradient buffers of the block, the head's weight gradient). The
        second is read for its phases only, so its device terms lack the EP imbalance."""
        entry = self._entry(plan)
        self._complete(entry, second=True)
        return entry.plan, entry.est, entry.est2

    def exact(self, plan: Plan) -> PlanMemory:
        """The estimator on `plan` itself (its fast path: the full estimator's bytes), as a
        PlanMemory (`--predict`): nothing is scaled, whatever the plan accumulates."""
        est, = self._estimate([plan], [self.overheads])
        return PlanMemory(total=int(est.device_total), tensors=int(est.total), persistent=int(est.persistent),
                          activations=int(est.activations), peak_phase=max(est.phases, key=est.phases.get),
                          device_terms=int(sum(est.device_terms.values())), exact=True, reference=est)

    def cached(self, plan: Plan) -> bool:
        return structural_key(plan) in self.cache

    def of(self, plan: Plan) -> PlanMemory:
        entry = self._entry(plan)
        self._complete(entry, second=_tokens(entry.plan, plan) != 1)  # scale reads est2 only then
        return scale(entry.est, entry.plan, plan, entry.est2)

    def fit(self, plan: Plan, capacity: float) -> tuple[PlanMemory | None, float]:
        """(`of(plan)` if it fits in `capacity` bytes, else None; its total, or a lower bound of
        it where that already exceeds `capacity`). What an entry lacks is estimated only once
        a plan's lower bound (`scale(bound=True)`) fits."""
        entry = self._entry(plan)
        low = scale(entry.est, entry.plan, plan, entry.est2, bound=True).total
        if low > capacity:
            return None, low
        mem = self.of(plan)
        self.hits -= 1  # one lookup
        return (mem if mem.total <= capacity else None), mem.total


def _tokens(ref: Plan, plan: Plan) -> float:
    return plan.samples_per_microbatch / ref.samples_per_microbatch


def _units(plan: Plan) -> int:
    from trainer.memory.estimate import _in_flight_units

    n_mb = plan.local_batch // plan.microbatch if plan.pp > 1 else 1
    return _in_flight_units(plan.schedule, plan.pp, plan.stages_per_rank, n_mb)


def scale(est, ref: Plan, plan: Plan, est2=None, bound: bool = False) -> PlanMemory:
    """Reads `plan`'s memory off the estimate `est` of its reference plan `ref` (module doc);
    `est2`, the estimate at twice the reference's microbatch, splits each phase's non-activation
    part into what grows with the tokens and what does not (without it: all of it grows); only
    its phases, FSDP buffers and activations are read (its device terms are not).
    `bound`: a lower bound of the total where parts are missing: `est` without the EP-skewed
    probe (every device term grows with it) and, without `est2`, the least the phase can be:
    its token-growing part is residual2 - residual with residual2 >= 0 (each phase's residual
    is a peak above what the phase keeps), so residual + grows * (tok - 1) >= residual * (2 - tok).
    The two references have the same in-flight count and the same sharding."""
    s = ref.dp_shard / plan.dp_shard
    tok = _tokens(ref, plan)
    assert tok >= 1, (ref, plan)  # a reference has the smallest microbatch
    assert ref.grad_accum == 1, ref  # and does not accumulate (`reference_plan`): `held_grads` has no sharded part
    act = tok * _units(plan) / _units(ref)
    accum_ref = est.held_grads
    if plan.pp > 1 and plan.dp_shard * plan.cp * plan.dp_replicate > 1:
        # PP with FSDP holds every unit's gradient unsharded over the microbatches (the
        # estimator's `_pp_fsdp_held_grads`): the same at any dp_shard; a reference does not
        # accumulate, a plan that does also keeps the sharded gradients between its steps
        accum_new = est.held_grads + (est.grads * s if plan.grad_accum > 1 else 0)
    else:
        accum_new = est.grads * s if (plan.grad_accum > 1 or plan.pp > 1) else 0
    phases = {}
    def read(v, grads, v2):
        """A backward or forward phase of `v` bytes (`v2` at twice the tokens), `grads` of them
        the gradients of the blocks done with backward (sharded like the optimizer step's)."""
        residual = v - est.fsdp_buffers - accum_ref - est.activations - grads
        if est2 is not None:
            residual2 = v2 - est2.fsdp_buffers - accum_ref - est2.activations - grads
            grows = residual2 - residual  # per reference microbatch of tokens
            residual_new = residual + grows * (tok - 1)
        elif bound:
            residual_new = residual * (2 - tok)
        else:
            residual_new = residual * tok
        return est.fsdp_buffers + accum_new + est.activations * act + residual_new + grads * s

    for name, v in est.phases.items():
        if name == "optimizer step":
            phases[name] = v * s
        elif name == EARLIER_BLOCK_BACKWARD:  # block by block: which is the worst depends on s
            if plan.grad_accum > 1:
                continue  # the gradients are held all along (`accum_new`): the estimator has no such phase
            if est2 is not None or not bound:
                twice = est2.earlier_blocks if est2 is not None else [(0, 0)] * len(est.earlier_blocks)
                phases[name] = max(read(b, g, b2) for (b, g), (b2, _) in zip(est.earlier_blocks, twice))
            else:  # what a block keeps is not all activations (its residual may be < 0): the reference's tokens
                phases[name] = max(b - g + g * s for b, g in est.earlier_blocks) + accum_new - accum_ref
        else:
            v2 = est2.phases[name] if est2 is not None else 0
            phases[name] = read(v, est.phase_grads.get(name, 0), v2)
    persistent = est.persistent * s
    peak_phase = max(phases, key=phases.get)
    tensors = int(persistent + phases[peak_phase])
    terms = 0
    for name, v in est.device_terms.items():
        terms += v * (tensors / max(1, est.total)) if name.startswith("allocator") else v
    exact = s == 1 and tok == 1 and act == 1 and accum_new == accum_ref
    return PlanMemory(total=int(tensors + terms), tensors=tensors, persistent=int(persistent),
                      activations=int(est.activations * act), peak_phase=peak_phase, device_terms=int(terms),
                      exact=exact, reference=est)
