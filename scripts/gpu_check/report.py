"""The markdown table of a gpu_check output folder (no torch import: it is rewritten after
every section, and must work when torch itself is what is broken).

Inputs: `<out>/rows/<section>.json` (each section's rows), `<out>/status.json` (the driver's
view of each section: pending, running, done, timeout, exit, skipped, killed) and
`<out>/env.json` (the device, for the header). Output: `<out>/gpu_check.md`.
"""

from __future__ import annotations

import json
from pathlib import Path

from gpu_check import numbers
from gpu_check.plan import BY_NAME, NUMBERS_STEPS, PLAN
from gpu_check.rows import ANCHOR_COLUMN, COLUMNS

TABLE = "gpu_check.md"
BAD = ("FAILED", "MISMATCH")
NOTES = f"""\
tokens/s and MFU: Llama 3 8B shape at local batch 2 x seq 8192 on one GPU (no FSDP), the 2- and
4-layer step times extrapolated per block to 32 layers (a 4-layer 8B spends ~31% of its FLOPs in
the head, 5% at 32). MFU % counts attention as non-causal (TorchTitan's convention, `mfu_pct`) at
57.91 GFLOP/token for 32 layers, MFU causal % the FLOPs a causal kernel does (`mfu_causal_pct`),
both on the device's dense bf16 peak (989 TFLOP/s for an H100 SXM or H200 SXM). {ANCHOR_COLUMN}:
TorchTitan's published Llama 3.1 8B runs at the same batch and AC (docs/performance.md there: FSDP
over 8 GPUs, selective op AC, 500 W power limit), with their MFU at the same FLOPs per token and
peak. alloc / reserved: the largest max_memory_allocated / max_memory_reserved of the timed
4-layer steps (the peak reset before each), next to scripts/estimate_memory.py's figure for that
4-layer config. syncs/step: synchronizing CUDA calls in one step under
torch.cuda.set_sync_debug_mode("warn") (on CPU: `_local_scalar_dense` calls). {numbers.COLUMN}:
the 4-layer run's; each trainer row's losses, grad norms and per-parameter grad norms at steps
{", ".join(map(str, NUMBERS_STEPS))} of each depth are checked against its group's reference (eager, AC none):
beyond the tolerance of its precision the row is marked a mismatch (scripts/gpu_check/numbers.py)."""


def _read(path: Path, default):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return default


def _resolve(section: str, rows: list[dict], status: dict) -> list[dict]:
    """The section's rows with what its process status says about them."""
    kind = BY_NAME[section].kind if section in BY_NAME else "check"
    state = status.get("state", "pending")
    limit = status.get("timeout_s")
    finished = [r for r in rows if r.get("result") != "running"]
    running = [r for r in rows if r.get("result") == "running"]
    if state in ("pending", "skipped"):
        why = status.get("why") or "not run: the check stopped before this section"
        return finished + [{"section": section, "config": "", "result": why}]
    if state == "running":
        return finished + [{**r, "result": f"running: {r.get('phase', '')}"} for r in running] or \
            [{"section": section, "config": "", "result": "running"}]
    if state == "timeout":
        what = f"timed out after {limit:.0f} s" if limit else "timed out"
    elif state == "killed":
        what = "the check was stopped"
    elif state == "exit" and status.get("rc", 0) != 0:
        what = f"exited with status {status.get('rc')} (see gpu_check.log)"
    else:
        what = ""
    if what:
        if kind == "bench" and state in ("timeout", "killed"):
            tag = "cut off"  # a cold compile that ran long is not a failure of the code: marked, not counted
        else:
            tag = "diagnostic" if kind == "diagnostic" else "FAILED"
        cut = [{"section": r["section"], "config": r["config"],
                "result": f"{tag}: {what} during {r.get('phase', '?')}: not counted"} for r in running]
        return finished + (cut or [{"section": section, "config": "(the rest)", "result": f"{tag}: {what}"}])
    if not finished:
        return [{"section": section, "config": "", "result": "FAILED: no rows (see gpu_check.log)"}]
    return finished


def table_rows(folder: Path) -> list[dict]:
    statuses = _read(folder / "status.json", {}).get("sections", {})
    names = [s.name for s in PLAN if s.name in statuses] or [p.stem for p in sorted((folder / "rows").glob("*.json"))]
    out = []
    for name in names:
        rows = _read(folder / "rows" / f"{name}.json", [])
        out += _resolve(name, rows, statuses.get(name, {"state": "exit", "rc": 0}))
    return numbers.judge(out)


def passed(rows: list[dict]) -> bool:
    """No row FAILED or MISMATCHed, outside the diagnostic sections."""
    diagnostic = {s.name for s in PLAN if s.kind == "diagnostic"}
    return not any(str(r.get("result", "")).startswith(BAD) for r in rows if r.get("section") not in diagnostic)


def render(folder: Path) -> tuple[str, bool]:
    """Writes `<folder>/gpu_check.md`; returns its text and whether every row passed."""
    folder = Path(folder)
    env = _read(folder / "env.json", {})
    status = _read(folder / "status.json", {})
    rows = table_rows(folder)
    where = env.get("device", "device unknown (the env section did not finish)")
    if status.get("dry"):
        where += ", --dry (tiny shapes: figures are not GPU figures)"
    head = f"gpu_check on {where}; torch {env.get('torch', '?')}"
    if status:
        head += f"; {status.get('elapsed_s', 0):.0f} s of the {status.get('deadline_s', 0):.0f} s deadline"
        if status.get("finished_at"):
            head += f"; finished {status['finished_at']}"
        elif status.get("stopped"):
            head += f"; stopped: {status['stopped']}"
    lines = [head, "", "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in rows:
        lines.append("| " + " | ".join(str(r.get(c, "")).replace("|", "/") for c in COLUMNS) + " |")
    text = "\n".join(lines) + "\n\n" + NOTES + "\n"
    tmp = folder / f".{TABLE}.tmp"
    tmp.write_text(text)
    tmp.replace(folder / TABLE)
    return text, passed(rows)
