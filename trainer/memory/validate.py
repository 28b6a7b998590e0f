"""Validation: the estimate against a real step measured on this machine, case by case.

Each case is a trainer command line and a rank count. The measurements run in fresh
processes with `MALLOC_ENV` (see `trainer.memory.measure`): all cases with the same rank
count in one process (one torchrun launch for the multi-rank ones, every case in one
process group), each case measuring its own baseline after its warm-up. The estimate is
made for the same config at `--device cpu`, world = ranks; the worst rank is compared.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from trainer.memory.estimate import MiB, estimate_memory

# glibc: serve every allocation above 64 KiB with its own mmap and give it back on free
# (a fixed threshold also stops glibc from raising it after frees), one arena, so that
# RSS follows the live bytes instead of the allocator's cache.
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "65536", "MALLOC_ARENA_MAX": "1",
              "OMP_NUM_THREADS": "1"}


@dataclass
class ValidationCase:
    name: str
    argv: list  # trainer CLI args
    nproc: int = 1
    tensor_peak: bool = False  # also measure the step's tensor bytes alone (`measure_step`)


def run_measurements(cases: list[ValidationCase], workdir: str, timeout: int = 300) -> dict[str, list[dict]]:
    """Runs `measure_step` for every case, one process (or torchrun launch) per rank count.
    Returns, per case name, one result per rank."""
    import json
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, **MALLOC_ENV, "PYTHONPATH": str(repo)}
    groups: dict[int, list[ValidationCase]] = {}
    for c in cases:
        groups.setdefault(c.nproc, []).append(c)
    results: dict[str, list[dict]] = {}
    for nproc, group in groups.items():
        spec_path = Path(workdir) / f"cases{nproc}.json"
        spec_path.write_text(json.dumps([
            {"name": c.name, "argv": list(c.argv) + ["--job.dump_folder", str(Path(workdir) / c.name)],
             "out": str(Path(workdir) / f"{c.name}.json"), "tensor_peak": c.tensor_peak} for c in group]))
        cmd = [sys.executable, "-m", "trainer.memory.measure", "--measure-cases", str(spec_path)]
        if nproc > 1:
            import socket
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(nproc),
                   "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", *cmd[1:]]
        proc = _run_in_own_group(cmd, cwd=repo, env=env, timeout=timeout)
        if proc.returncode != 0:
            raise RuntimeError(f"measurement of {[c.name for c in group]} failed ({proc.returncode}):\n"
                               f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        for c in group:
            out = Path(workdir) / f"{c.name}.json"
            results[c.name] = [json.loads(Path(f"{out}.rank{r}").read_text()) for r in range(c.nproc)]
    return results


def _run_in_own_group(cmd, *, cwd, env, timeout):
    """subprocess.run in a new session; on timeout the launcher and every worker are killed."""
    import signal
    import subprocess

    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise RuntimeError(f"measurement timed out after {timeout} s:\n{out[-3000:]}\n{err[-3000:]}") from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def validate_cases(cases: list[ValidationCase], workdir: str, timeout: int = 300) -> list[dict]:
    """Estimate (cpu, world = nproc) vs measurement (worst rank) for each case."""
    from trainer.config import load_config

    measured = run_measurements(cases, workdir, timeout)
    rows = []
    for case in cases:
        est = estimate_memory(load_config(list(case.argv)), case.nproc, device="cpu")
        ranks = measured[case.name]
        m = max(ranks, key=lambda r: r["peak_growth"])
        saved = max(r["saved_bytes"] for r in ranks)
        measured_total = m["persistent_bytes"] + m["peak_growth"]
        rows.append({
            "case": case.name, "nproc": case.nproc, "ac": est.ac_mode, "chunked_ce": est.chunked_ce,
            "est_saved": est.saved_activations, "meas_saved": saved,
            "saved_err": est.saved_activations / saved - 1,
            "est_step_peak": est.step_peak, "meas_peak_growth": m["peak_growth"],
            "peak_err": est.step_peak / m["peak_growth"] - 1,
            "est_total": est.total, "meas_total": measured_total, "total_err": est.total / measured_total - 1,
            "est_persistent": est.persistent, "meas_persistent": max(r["persistent_bytes"] for r in ranks),
            "peak_phase": max(est.phases, key=est.phases.get), "hwm_used": m["hwm_used"],
        })
        if case.tensor_peak:
            tensors = max(r["tensor_peak"] for r in ranks)
            opt_step = max(r["optimizer_step_tensor_peak"] for r in ranks)  # 0: the step was skipped
            # RSS beyond the tensors, rank by rank (the worst RSS rank need not be the worst tensor rank)
            runtime = [r["peak_growth"] - r["tensor_peak"] for r in ranks]
            rows[-1].update(meas_tensor_peak=tensors, tensor_err=est.step_peak / tensors - 1,
                            runtime_growth=max(runtime, key=abs), runtime_growth_by_rank=runtime,
                            est_optimizer_step=est.phases["optimizer step"], meas_optimizer_step=opt_step,
                            optimizer_step_err=est.phases["optimizer step"] / opt_step - 1 if opt_step else float("nan"))
    return rows


def format_validation(rows: list[dict]) -> str:
    head = (f"{'case':<22}{'ranks':>5} {'saved est':>10} {'saved meas':>10} {'err':>7}  "
            f"{'step peak est':>13} {'RSS growth':>10} {'err':>7}  {'total est':>10} {'total meas':>10} {'err':>7}"
            f"  peak phase")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['case']:<22}{r['nproc']:>5} {r['est_saved'] / MiB:>8.1f}Mi {r['meas_saved'] / MiB:>8.1f}Mi "
            f"{r['saved_err'] * 100:>+6.1f}%  {r['est_step_peak'] / MiB:>11.1f}Mi {r['meas_peak_growth'] / MiB:>8.1f}Mi "
            f"{r['peak_err'] * 100:>+6.1f}%  {r['est_total'] / MiB:>8.1f}Mi {r['meas_total'] / MiB:>8.1f}Mi "
            f"{r['total_err'] * 100:>+6.1f}%  {r['peak_phase']}"
            + (f"\n{'':<27}tensors: step {r['meas_tensor_peak'] / MiB:.1f}Mi (est {r['tensor_err'] * 100:+.1f}%),"
               f" optimizer step {r['meas_optimizer_step'] / MiB:.1f}Mi (est {r['est_optimizer_step'] / MiB:.1f}Mi,"
               f" {r['optimizer_step_err'] * 100:+.1f}%); RSS beyond the step's tensors {r['runtime_growth'] / MiB:+.1f}Mi"
               if "meas_tensor_peak" in r else ""))
    return "\n".join(lines)
