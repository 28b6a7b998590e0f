"""The sections of the GPU check, in order, with their time budgets (no torch import).

Every budget is a sum of named cold-start costs (`COSTS`, each with its basis), so a budget
says what it pays for and one wrong estimate is corrected in one place. The core sections'
budgets add up to CORE_BUDGET_S, which must stay at least HEADROOM_S under the DEADLINE_S
(tests/test_gpu_check.py fails otherwise). Timeouts are elastic (`start_timeout`): a section
may use the time earlier ones left unused, as long as every core section after it keeps its
whole budget, so a cold compile that runs long finishes instead of being cut off while a
hang still cannot take more than twice its budget. Extras run only with their whole budget
left. Cheap sections come first: the SDPA rows before the first inductor compile, the
one-rank checks before the 8B trainer configs. Every trainer config is its own section, so
a cold inductor compile of an 8B block can only cost its own row.

The costs are estimates until the first GPU run; its status.json records every section's
wall_s, from which they are to be reset.
"""

from __future__ import annotations

from dataclasses import dataclass

# The whole check: sections stop starting at DEADLINE_S; the table is then written (< 1 s).
# 470 s: one command of the lent machine (10 minutes at most) with room for its start.
DEADLINE_S = 470
# What the core budgets leave unspent for a cold H200 slower than estimated: 15%.
HEADROOM_S = 70
# A section's timeout never exceeds this many times its budget (a hang costs at most that).
STRETCH = 2
# --dry on a shared 2-core CPU: tiny shapes, but torch imports and CPU compiles are slow.
DRY_SCALE = 8

# Cold-start costs in seconds, and where each figure comes from.
COSTS: dict[str, tuple[float, str]] = {
    "first process": (15, "the first section's process on a fresh machine: python, `import torch` with its CUDA "
                          "libraries from a cold page cache, the CUDA context"),
    "process": (6, "a section's process: `import torch` (1.1 s for the CPU build here, `python -c \"import torch\"`; "
                   "the CUDA build maps ~3 GB more of libraries), the CUDA context (~1 s), this repo (0.6 s here)"),
    "nccl": (3, "a one-rank NCCL communicator, created eagerly (device_id)"),
    "kernel check": (2, "a kernel check's tensors, drawn on the GPU, its kernels and its reference (TF32)"),
    "first kernels": (2, "the first kernels of a process: cuBLAS / cuDNN handles, flash and CUTLASS modules loaded"),
    "trainer build": (3, "meta model -> GPU, init drawn on the GPU (1.5-1.9 B params at 2-4 layers of the 8B "
                         "shape), optimizer, and the memory estimator (0.3-0.8 s for 8B at 4 layers, measured here)"),
    "8B step": (0.6, "one step of the 8B shape at 4 layers, batch 2 x 8192: 164 TFLOP at >= 30% of 989 TFLOP/s"),
    "8B step, 2 layers": (0.4, "the same at 2 layers: 108 TFLOP (also the bound for one DeepSeek 16B MoE layer at "
                               "batch 1 x 4096)"),
    "op plan": (1, "op-level SAC's first calls record and plan each block kind on the host (CPU work)"),
    "triton first": (10, "a machine's first Triton kernel: Triton builds its CUDA launcher and driver utils with gcc"),
    "inductor first": (5, "inductor's first use in a process: its imports and compile worker pool"),
    "compile cold": (35, "inductor, one 8B-shape block forward + backward, cold caches: vLLM's Llama-3-8B forward "
                         "graph took 14.8 s in inductor + ~5 s of Triton + 4.6 s of dynamo on an H100 "
                         "(vllm-project/vllm#11005); a backward graph has ~2x the forward's nodes; dynamo + AOT "
                         "tracing of one of our blocks takes ~1 s (--dry's first compiled step)"),
    "compile warm": (8, "the same block rebuilt at 4 layers: dynamo retraces (~1 s a graph), inductor's FX graph "
                        "cache hits (vLLM: 4.2 s to load a cached 8B graph, vllm-project/vllm#16848)"),
    "small compile": (12, "inductor on one small function forward + backward (a few grouped GEMMs and gathers, or "
                          "one flex attention with its mask), cold: a third of a block"),
    "float8 autotune": (55, "torchao 0.18's float8 grouped GEMM, first call, cold cache: the backward's per-group "
                            "scales kernel (`_triton_fp8_per_group_colwise_scales_dual_kernel`) autotunes 36 configs "
                            "(3 x 3 block sizes x 2 warps x 2 stages) per (K, groups) key, 2 keys for the 3 expert "
                            "GEMMs: 72 Triton compiles at ~0.7 s; the forward's kernels have one config each"),
}


@dataclass(frozen=True)
class Section:
    name: str
    # bench: a timeout cuts the row off (marked, not counted as a measurement, not a failure);
    # check: a timeout is a hang, so FAILED; diagnostic: informs only, never fails the check.
    kind: str
    core: bool
    what: str
    # (count, cost name) pairs: the budget is sum(count x COSTS[name]).
    parts: tuple[tuple[float, str], ...]
    # The module of gpu_check that holds `run_<name>` (Llama configs: bench.run_llama).
    module: str = "kernels"
    # Llama trainer configs: (compile, float8, AC mode).
    llama: tuple[bool, bool, str] | None = None
    # In --dry without --only, a section whose code path an earlier one already runs (the same
    # function with other flags) is not run: this names that section. Keeps the whole --dry
    # run cheap enough for the test suite while every code path of the check still runs.
    dry_as: str | None = None

    @property
    def budget_s(self) -> int:
        return round(sum(n * COSTS[c][0] for n, c in self.parts) + 0.499)

    def basis(self) -> str:
        """'2 x process 6 + compile cold 35' (what the budget pays for)."""
        return " + ".join(f"{'' if n == 1 else f'{n:g} x '}{c} {COSTS[c][0]:g}" for n, c in self.parts)


# Steps of a trainer config at each depth: warm-up (the first one compiles), timed, and one
# more that counts host syncs. NUMBERS_STEPS: the steps whose loss, grad norm and per-parameter
# grad norms are compared between rows (the 5th: op SAC's replayed forward and direct
# recompute run from a block's third call on; every config runs at least 5 steps).
WARMUP_STEPS = {False: 1, True: 2}  # by compile
TIMED_STEPS = 3
NUMBERS_STEPS = (1, 5)


def trainer_steps(compiled: bool) -> int:
    return WARMUP_STEPS[compiled] + TIMED_STEPS + 1


assert all(trainer_steps(c) >= max(NUMBERS_STEPS) for c in (False, True))


def _llama(name: str, compiled: bool, float8: bool, mode: str, core: bool = True, dry_as: str | None = None) -> Section:
    what = f"Llama 3 8B shape, batch 2, 2 and 4 layers -> 32: AC {mode}, compile {'on' if compiled else 'off'}, " \
           f"float8 {'on' if float8 else 'off'}"
    steps = trainer_steps(compiled)
    parts = [(1, "process"), (2, "trainer build"), (steps, "8B step, 2 layers"), (steps, "8B step"),
             (1, "first kernels")]
    if compiled:
        parts += [(1, "inductor first"), (1, "compile cold"), (1, "compile warm")]
    if mode in ("op", "budget") and not compiled:  # compiled, the partitioner applies the policy
        parts += [(2, "op plan")]
    return Section(name, "bench", core, what, tuple(parts), "bench", (compiled, float8, mode), dry_as)


PLAN: tuple[Section, ...] = (
    Section("env", "check", True, "versions, device, imports, SDPA backends (forward + backward), a trivial "
                                  "torch.compile", ((1, "first process"), (1, "kernel check"), (1, "inductor first"),
                                                    (1, "triton first")), module="env"),
    Section("mla_flash", "check", True, "DeepSeek 16B MLA shapes (q/k 192, v 128 padded) under flash attention, "
                                        "forward + backward vs fp32 math",
            ((1, "process"), (1, "kernel check"), (1, "first kernels")), module="attention"),
    Section("fsdp", "check", True, "one rank, NCCL: reduce-scatter; fused AdamW over DTensors vs plain; FSDP2 "
                                   "trainer (bf16 params / fp32 reduce, and fp32 params), AC none vs op; found_inf 1 "
                                   "skips, 0 steps",
            ((1, "process"), (1, "nccl"), (1, "kernel check"), (4, "trainer build"), (22, "8B step, 2 layers"),
             (1, "first kernels"), (1, "op plan")), module="dist_checks"),
    _llama("llama_eager_none", False, False, "none"),
    _llama("llama_eager_op", False, False, "op"),
    Section("grouped_mm", "check", True, "bf16 grouped GEMM: empty experts padded vs the loop; inductor with "
                                         "dynamic rows", ((1, "process"), (1, "kernel check"), (1, "first kernels"),
                                                          (1, "inductor first"), (1, "small compile"))),
    Section("flex", "check", True, "flex attention forward + backward, compiled: lower-right causal (a CP chunk) "
                                   "and document masks vs fp32 math",
            ((1, "process"), (1, "kernel check"), (1, "first kernels"), (1, "inductor first"), (2, "small compile")),
            module="attention"),
    _llama("llama_compile_op", True, False, "op"),
    _llama("llama_compile_float8_op", True, True, "op", dry_as="llama_compile_op"),
    Section("ep_mesh", "check", True, "DeepSeek 16B shape, 1 MoE layer, one-rank EP mesh (NCCL), compile + AC op, "
                                      "AC_TRACE=1",
            ((1, "process"), (1, "nccl"), (1, "trainer build"), (1, "inductor first"), (1, "compile cold"),
             (trainer_steps(True), "8B step, 2 layers"), (1, "first kernels")), module="dist_checks"),
    # Only while time remains. First the float8 grouped GEMM: its cold autotune alone would
    # take the core budgets past the headroom.
    Section("float8_grouped_mm", "check", False, "torchao float8 grouped GEMM (16B experts, the trainer's [E, N, K] "
                                                 "layout): cold autotune, then warm vs bf16",
            ((1, "process"), (1, "kernel check"), (1, "first kernels"), (1, "float8 autotune"))),
    _llama("llama_compile_none", True, False, "none", core=False, dry_as="llama_compile_op"),
    _llama("llama_compile_float8_none", True, True, "none", core=False, dry_as="llama_compile_op"),
    _llama("llama_eager_full", False, False, "full", core=False, dry_as="llama_eager_op"),
    _llama("llama_eager_budget", False, False, "budget", core=False, dry_as="llama_eager_op"),
    _llama("llama_compile_memory_budget", True, False, "memory_budget", core=False, dry_as="llama_compile_op"),
    _llama("llama_eager_float8_none", False, True, "none", core=False, dry_as="llama_eager_op"),
    Section("chunked_ce", "bench", False, "Llama 3 8B head (vocab 128256, seq 8192): peak memory, chunked CE "
                                          "off vs on", ((1, "process"), (2, "trainer build"), (10, "8B step"),
                                                        (1, "first kernels")), module="bench"),
    Section("deepseek", "bench", False, "DeepSeek 16B shape, 3 layers, grouped GEMMs: AC op vs full",
            ((1, "process"), (2, "trainer build"), (10, "8B step"), (1, "first kernels"), (2, "op plan")),
            module="bench", dry_as="chunked_ce"),
    Section("unpadded_groups", "diagnostic", False, "empty groups reaching the grouped GEMM unpadded (the "
                                                    "reported hang)", ((1, "process"), (1, "kernel check")),
            dry_as="grouped_mm"),
)
BY_NAME = {s.name: s for s in PLAN}
CORE_BUDGET_S = sum(s.budget_s for s in PLAN if s.core)
assert all(BY_NAME[s.dry_as].dry_as is None for s in PLAN if s.dry_as), "dry_as names a section that runs"


def plan_lines() -> list[str]:
    """The plan as `--list` and every run's log print it: each section's budget and basis, and the sum."""
    lines = [f"{s.name:28s} {s.budget_s:4d} s  {'core ' if s.core else 'extra'}  {s.kind:10s}  {s.what}"
             f"{f' (--dry: as {s.dry_as})' if s.dry_as else ''}\n{'':36s}= {s.basis()}" for s in PLAN]
    lines.append(f"core budgets: {CORE_BUDGET_S} s of the {DEADLINE_S} s deadline ({DEADLINE_S - CORE_BUDGET_S} s "
                 f"headroom, {HEADROOM_S} s required); extras run only with their whole budget left")
    lines += ["the costs (seconds; estimates until a GPU run's status.json gives each section's wall_s):"] + \
        [f"  {name} {cost:g}: {basis}" for name, (cost, basis) in COSTS.items()]
    return lines


def start_timeout(section: Section, left_s: float, reserved_s: float = 0.0, scale: int = 1) -> tuple[float | None, str]:
    """The timeout to start `section` with, when `left_s` seconds remain before the deadline and
    the core sections still to run after it need `reserved_s` (their budgets), or (None, why)
    to skip it. A section may take what the others leave, up to STRETCH x its budget; a core
    section starts while at least half its budget is free, an extra only with all of it."""
    budget = section.budget_s * scale
    free = left_s - reserved_s
    need = budget / 2 if section.core else budget
    if free < need:
        rule = "" if section.core else " (an extra: runs only with its whole budget left)"
        return None, f"skipped: {max(free, 0):.0f} s free before the deadline, needs {need:.0f} s{rule}"
    return min(STRETCH * budget, free), ""
