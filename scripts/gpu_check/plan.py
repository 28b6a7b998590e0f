"""The sections of the GPU check, in order of value, with their timeouts (no torch import).

Core sections run in this order; their timeouts add up to CORE_TIMEOUT_S < 8 minutes. The
extras run only while time remains before the global deadline. Every trainer config is its
own section, so a cold inductor compile of an 8B block (30-90 s) can only cost its own row.
"""

from __future__ import annotations

from dataclasses import dataclass

# The whole check: sections stop starting at DEADLINE_S; the table is then written (< 1 s).
DEADLINE_S = 470
# --dry on a shared 2-core CPU: tiny shapes, but torch imports and CPU compiles are slow.
DRY_SCALE = 8


@dataclass(frozen=True)
class Section:
    name: str
    timeout_s: int
    # bench: a timeout cuts the row off (marked, not counted as a measurement, not a failure);
    # check: a timeout is a hang, so FAILED; diagnostic: informs only, never fails the check.
    kind: str
    core: bool
    what: str
    # Llama trainer configs: (compile, float8, AC mode).
    llama: tuple[bool, bool, str] | None = None
    # In --dry without --only, a section whose code path an earlier one already runs (the same
    # function with other flags) is not run: this names that section. Keeps the whole --dry
    # run cheap enough for the test suite while every code path of the check still runs.
    dry_as: str | None = None


def _llama(name: str, timeout_s: int, compiled: bool, float8: bool, mode: str, core: bool = True,
           dry_as: str | None = None) -> Section:
    what = f"Llama 3 8B shape, 2 and 4 layers -> 32: AC {mode}, compile {'on' if compiled else 'off'}, " \
           f"float8 {'on' if float8 else 'off'}"
    return Section(name, timeout_s, "bench", core, what, (compiled, float8, mode), dry_as)


PLAN: tuple[Section, ...] = (
    Section("env", 20, "check", True, "versions, device, imports, a trivial torch.compile, SDPA backend choices"),
    _llama("llama_eager_none", 25, False, False, "none", dry_as="llama_eager_op"),
    _llama("llama_eager_op", 25, False, False, "op"),
    _llama("llama_compile_op", 70, True, False, "op"),
    _llama("llama_compile_float8_op", 60, True, True, "op", dry_as="llama_compile_op"),
    _llama("llama_compile_none", 40, True, False, "none", dry_as="llama_compile_op"),
    _llama("llama_compile_float8_none", 40, True, True, "none", dry_as="llama_compile_op"),
    Section("mla_flash", 10, "check", True, "DeepSeek 16B MLA shapes (q/k 192, v 128 padded) under flash attention"),
    Section("grouped_mm", 25, "check", True, "bf16 grouped GEMM: empty experts padded vs the loop; inductor with "
                                             "dynamic rows"),
    Section("fused_adamw", 10, "check", True, "fused AdamW over DTensors (one-rank mesh) vs plain tensors"),
    Section("ep_mesh", 50, "check", True, "DeepSeek 16B shape, 2 layers, one-rank EP mesh (NCCL), compile + AC op, "
                                          "AC_TRACE=1"),
    Section("float8_grouped_mm", 100, "check", True, "torchao float8 grouped GEMM (16B experts): cold autotune, "
                                                     "then warm vs bf16"),
    # Only while time remains.
    _llama("llama_eager_full", 25, False, False, "full", core=False, dry_as="llama_eager_op"),
    _llama("llama_eager_budget", 25, False, False, "budget", core=False, dry_as="llama_eager_op"),
    _llama("llama_compile_memory_budget", 40, True, False, "memory_budget", core=False,
           dry_as="llama_compile_op"),
    _llama("llama_eager_float8_none", 25, False, True, "none", core=False, dry_as="llama_eager_op"),
    Section("chunked_ce", 30, "bench", False, "Llama 3 8B head (vocab 128256, seq 8192): peak memory, chunked CE "
                                              "off vs on"),
    Section("deepseek", 60, "bench", False, "DeepSeek 16B shape, 3 layers, grouped GEMMs: AC op vs full",
            dry_as="chunked_ce"),
    Section("unpadded_groups", 15, "diagnostic", False, "empty groups reaching the grouped GEMM unpadded (the "
                                                        "reported hang)", dry_as="grouped_mm"),
)
BY_NAME = {s.name: s for s in PLAN}
CORE_TIMEOUT_S = sum(s.timeout_s for s in PLAN if s.core)
assert CORE_TIMEOUT_S < 480, CORE_TIMEOUT_S
assert all(BY_NAME[s.dry_as].dry_as is None for s in PLAN if s.dry_as), "dry_as names a section that runs"


def start_timeout(section: Section, left_s: float, scale: int = 1) -> tuple[float | None, str]:
    """The timeout to start `section` with when `left_s` seconds remain before the deadline, or
    (None, why) to skip it: a core section runs while at least half its timeout remains (capped
    to what remains); an extra one only with its whole timeout left."""
    full = section.timeout_s * scale
    need = full / 2 if section.core else full
    if left_s < need:
        rule = "" if section.core else " (an extra: runs only with its whole timeout left)"
        return None, f"skipped: {max(left_s, 0):.0f} s left before the deadline, needs {need:.0f} s{rule}"
    return min(full, left_s), ""
