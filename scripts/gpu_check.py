#!/usr/bin/env python
"""The prepared GPU check: one section per process, driven by scripts/gpu_check.sh.

    scripts/gpu_check.sh [--dry] [--out FILE]            # all sections, one markdown table in FILE
    python scripts/gpu_check.py SECTION --json FILE [--dry] [--budget-s S]
    python scripts/gpu_check.py report DIR --out FILE [--dry]

Sections (each run under its own `timeout` by the .sh, so a hang becomes a row, not a stuck job):
  empty_groups  MoE grouped GEMM forward + backward with empty experts, padded as CUDA runs it,
                vs the per-expert loop (and float8 grouped GEMMs on SM90+).
  mla_flash     DeepSeek 16B MLA attention shapes (q/k head 192, v 128 padded to 192) forward
                + backward under sdpa_kernel(FLASH_ATTENTION): fails loudly if flash does not apply.
  chunked_ce    Llama 3 8B head (vocab 128256, seq 8192, bf16): peak memory, chunked CE vs plain.
  llama         Llama 3 8B shape, 4 layers, seq 8192, bf16: AC none/full/op/budget x compile off/on x
                float8 off/on: tokens/s, MFU, peak memory next to the estimator's figure, and the
                host syncs per step (aten::_local_scalar_dense in a profiled step).
  deepseek      DeepSeek 16B shape, 3 layers (1 dense + 2 MoE, 64 experts top-6), seq 4096, bf16,
                the CUDA grouped-GEMM path: AC op vs full (and float8 grouped GEMMs on SM90+).
  unpadded_groups  diagnostic: the grouped GEMM with empty groups reaching the kernel (the
                reported hang the padding avoids); its failure does not fail the check.

`--dry` runs every section on CPU with tiny shapes (the test suite does, so the script works the
first time a GPU appears). MFU follows docs/performance.md: training FLOPs per token as the model
summary counts them (6 x non-embedding params + 12 x layers x heads x head_dim x seq, no causal
halving, TorchTitan's convention) x tokens/s / the device's dense bf16 peak, float8 runs included.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

SECTIONS = ("empty_groups", "mla_flash", "chunked_ce", "llama", "deepseek", "unpadded_groups")
# Sections that only inform: their failure (the hang padding avoids) does not fail the check.
DIAGNOSTIC = ("unpadded_groups",)
COLUMNS = ("section", "config", "tokens/s", "MFU %", "peak GiB", "estimator GiB", "syncs/step", "result")
ROWS: list[dict] = []
ROWS_PATH: Path | None = None


def emit(row: dict) -> dict:
    """Records a row and rewrites the section's JSON file, so rows survive a timeout."""
    ROWS.append(row)
    print(json.dumps(row), flush=True)
    if ROWS_PATH is not None:
        ROWS_PATH.write_text(json.dumps(ROWS))
    return row


def device(dry: bool) -> torch.device:
    if dry:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        sys.exit("gpu_check: no CUDA device; run with --dry on a CPU")
    return torch.device("cuda")


def register_flavor(model: str, base: str, name: str, **overrides) -> str:
    from models import get_model_spec

    flavors = get_model_spec(model).flavors
    flavors[name] = dataclasses.replace(flavors[base], **overrides)
    return name


# --------------------------------------------------------------------------- trainer runs

def shapes(dry: bool) -> dict:
    """Trainer args per section: the real shapes, or tiny ones for --dry."""
    if dry:
        llama = ["--model.name", "llama3", "--model.flavor", register_flavor("llama3", "debug_small", "gc_llama",
                                                                             n_layers=2),
                 "--training.seq_len", "64", "--training.local_batch_size", "2"]
        deepseek = ["--model.name", "deepseek_v3", "--model.flavor",
                    register_flavor("deepseek_v3", "debug", "gc_deepseek", n_layers=3),
                    "--training.seq_len", "64", "--training.local_batch_size", "2"]
        head = [*llama[:3], register_flavor("llama3", "debug_small", "gc_head", n_layers=1), "--training.seq_len",
                "256", "--training.local_batch_size", "2"]
        return {"llama": llama, "deepseek": deepseek, "chunked_ce": head, "steps": (1, 2),
                "compile": ["--compile.backend", "aot_eager"], "precision": ["--training.mixed_precision_on_cpu",
                                                                             "true"]}
    return {
        "llama": ["--model.name", "llama3", "--model.flavor", register_flavor("llama3", "8B", "gc_llama", n_layers=4),
                  "--training.seq_len", "8192", "--training.local_batch_size", "1"],
        "deepseek": ["--model.name", "deepseek_v3", "--model.flavor",
                     register_flavor("deepseek_v3", "16B", "gc_deepseek", n_layers=3),
                     "--training.seq_len", "4096", "--training.local_batch_size", "1"],
        "chunked_ce": ["--model.name", "llama3", "--model.flavor", register_flavor("llama3", "8B", "gc_head",
                                                                                    n_layers=1),
                       "--training.seq_len", "8192", "--training.local_batch_size", "1"],
        "steps": (2, 4), "compile": [], "precision": [],
    }


def base_args(dump: str) -> list[str]:
    return ["--data.type", "synthetic", "--training.steps", "1000", "--metrics.log_freq", "1000000",
            "--metrics.enable_tensorboard", "false", "--job.dump_folder", dump, "--training.mixed_precision_param",
            "bfloat16", "--checkpoint.enable", "false"]


class SyncCounter(torch.utils._python_dispatch.TorchDispatchMode):
    """Host syncs on `device`'s tensors: `aten::_local_scalar_dense` (what `.item()` and a
    data-dependent `if` run; the op the profiler shows) and device-to-host copies (what
    `.tolist()` and `.cpu()` run). Reads of CPU tensors (e.g. AdamW's step counters) are not
    syncs on a GPU, so only `device`'s count."""

    def __init__(self, device: torch.device):
        super().__init__()
        self.device_type, self.item, self.d2h = device.type, 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        src = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if src is not None and src.device.type == self.device_type:
            if func is torch.ops.aten._local_scalar_dense.default:
                self.item += 1
            elif func is torch.ops.aten._to_copy.default and str(kwargs.get("device", src.device)) == "cpu" \
                    and self.device_type != "cpu":
                self.d2h += 1
        return func(*args, **kwargs)


def count_syncs(trainer) -> str:
    with SyncCounter(trainer.device) as counter:
        trainer.train_step(trainer.next_microbatches(), with_metrics=False)
    return f"{counter.item} item, {counter.d2h} d2h"


def run_trainer(args: list[str], dev: torch.device, steps: tuple[int, int], *, syncs: bool = False) -> dict:
    """Builds a Trainer, runs warm-up + timed steps; tokens/s, MFU, peak memory, estimator figure."""
    from trainer.config import load_config
    from trainer.memory import estimate_memory
    from trainer.metrics import device_peak_flops
    from trainer.train import Trainer

    cfg = load_config(args)
    # memory_budget's saved set is the compile partitioner's choice: the estimator has no count.
    est = None if cfg.activation_checkpoint.mode == "memory_budget" else \
        estimate_memory(cfg, world_size=1, device=dev.type).total / 2**30
    torch._dynamo.reset()
    trainer = Trainer(cfg)
    try:
        warmup, timed = steps
        for _ in range(warmup):
            trainer.train_step(trainer.next_microbatches(), with_metrics=False)
        if dev.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        times = []
        for _ in range(timed):
            batches = trainer.next_microbatches()
            t0 = time.perf_counter()
            trainer.train_step(batches, with_metrics=False)  # returns floats: synchronised
            times.append(time.perf_counter() - t0)
        n_syncs = count_syncs(trainer) if syncs else None
        tokens = cfg.training.local_batch_size * cfg.training.seq_len * trainer.grad_accum_steps
        tps = tokens / statistics.median(times)
        peak_flops = device_peak_flops(dev)
        if dev.type == "cuda":
            peak = torch.cuda.max_memory_allocated() / 2**30
        else:
            from trainer.metrics import memory_stats

            peak = memory_stats(dev)["memory/peak_rss_gib"]
        return {"tokens/s": f"{tps:,.0f}", "MFU %": f"{100 * trainer.flops_per_token * tps / peak_flops:.1f}"
                if peak_flops else "n/a", "peak GiB": f"{peak:.2f}" + ("" if dev.type == "cuda" else " (RSS)"),
                "estimator GiB": "n/a" if est is None else f"{est:.2f}", "syncs/step": n_syncs or "",
                "result": "ok"}
    finally:
        trainer.close(destroy_process_group=False)
        del trainer
        if dev.type == "cuda":
            torch.cuda.empty_cache()


def grid(section: str, rows: list[tuple[str, list[str]]], dev, sh, budget_s: float, first_syncs: bool) -> None:
    """Runs configs in order until the time budget would be exceeded; the rest are reported skipped."""
    start, slowest = time.perf_counter(), 0.0
    for i, (name, extra) in enumerate(rows):
        left = budget_s - (time.perf_counter() - start)
        if left < 1.2 * slowest:
            emit({"section": section, "config": name, "result": f"skipped: {left:.0f} s of the budget left"})
            continue
        t0 = time.perf_counter()
        with tempfile.TemporaryDirectory() as dump:
            try:
                row = run_trainer([*sh[section], *base_args(dump), *sh["precision"], *extra], dev, sh["steps"],
                                  syncs=first_syncs and i == 0)
            except Exception as e:  # noqa: BLE001 - a failed config is a row of the report, not the end of it
                row = {"result": f"FAILED: {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"}
        slowest = max(slowest, time.perf_counter() - t0)
        emit({"section": section, "config": name, **row})


def section_llama(dev, dry, budget_s) -> None:
    from parallelisms.activation_checkpoint import AC_MODES

    sh = shapes(dry)
    rows = []
    # Most telling first, in case the time budget runs out: bf16 eager, bf16 compiled, float8
    # compiled (float8 pays off only compiled), float8 eager.
    for compiled, float8 in ((False, False), (True, False), (True, True), (False, True)):
        # The eager byte budget ("budget") and the compile partitioner's ("memory_budget")
        # are one column: each is refused outside its own compile setting.
        for mode in ("none", "full", "op", "memory_budget" if compiled else "budget"):
            extra = ["--activation_checkpoint.mode", mode]
            extra += ["--compile.enable", "true", *sh["compile"]] if compiled else []
            extra += ["--float8.enable", "true"] if float8 else []
            name = f"AC {mode}, compile {'on' if compiled else 'off'}, float8 {'on' if float8 else 'off'}"
            rows.append((name, extra if mode in AC_MODES else None))
    for name, extra in rows:
        if extra is None:
            emit({"section": "llama", "config": name, "result": "n/a: this build has no such AC mode"})
    grid("llama", [(n, e) for n, e in rows if e is not None], dev, sh, budget_s, first_syncs=True)


def section_deepseek(dev, dry, budget_s) -> None:
    sh = shapes(dry)
    rows = [(f"AC {m}", ["--activation_checkpoint.mode", m]) for m in ("op", "full")]
    if not dry and torch.cuda.get_device_capability() >= (9, 0):
        rows.append(("AC op, float8 linears + grouped GEMMs", ["--activation_checkpoint.mode", "op",
                                                               "--float8.enable", "true",
                                                               "--float8.moe_grouped_gemm", "true"]))
    grid("deepseek", rows, dev, sh, budget_s, first_syncs=True)


def section_chunked_ce(dev, dry, budget_s) -> None:
    sh = shapes(dry)
    rows = [(f"chunked_ce {flag}", ["--activation_checkpoint.mode", "full", "--loss.chunked_ce", flag])
            for flag in ("false", "true")]
    grid("chunked_ce", rows, dev, sh, budget_s, first_syncs=False)


# --------------------------------------------------------------------------- kernel checks

def section_empty_groups(dev, dry, budget_s, padded: bool = True) -> None:
    """Padded grouped GEMM (what CUDA runs) forward + backward with empty experts vs the loop;
    `padded=False`: the same with empty groups reaching the kernel (diagnostic)."""
    from models.common.moe import GROUP_ALIGN_BF16, GROUP_ALIGN_FLOAT8, experts_grouped_mm, experts_loop

    e, d, h = (8, 64, 128) if dry else (64, 2048, 1408)
    dtype = torch.float32 if dry else torch.bfloat16
    counts = torch.zeros(e, dtype=torch.int64)
    counts[::3] = torch.arange(1, len(counts[::3]) + 1) * (3 if dry else 97)  # 2 of 3 experts empty
    cases = [(f"padded to {GROUP_ALIGN_BF16}", GROUP_ALIGN_BF16, False)]
    if not dry and torch.cuda.get_device_capability() >= (9, 0):
        cases.append((f"float8, padded to {GROUP_ALIGN_FLOAT8}", GROUP_ALIGN_FLOAT8, True))
    if not padded:
        cases = [("unpadded: empty groups reach the kernel", 0, False)]
    g = torch.Generator(device="cpu").manual_seed(0)
    ws = [(torch.randn(*s, generator=g) * 0.05).to(dev, dtype) for s in ((e, d, h), (e, h, d), (e, d, h))]
    x = torch.randn(int(counts.sum()), d, generator=g).to(dev, dtype)
    n = counts.to(dev)
    ref_ws = [w.detach().float().clone().requires_grad_() for w in ws]
    ref_x = x.detach().float().clone().requires_grad_()
    ref = experts_loop(*ref_ws, ref_x, n)
    ref.square().sum().backward()
    for name, align, float8 in cases:
        w = [t.detach().clone().requires_grad_() for t in ws]
        xi = x.detach().clone().requires_grad_()
        t0 = time.perf_counter()
        y = experts_grouped_mm(*w, xi, n, align=align, float8=float8)
        y.float().square().sum().backward()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        rel = max(((a.grad.float() - b.grad).norm() / b.grad.norm()).item() for a, b in zip([xi, *w], [ref_x, *ref_ws]))
        fwd = ((y.float() - ref).norm() / ref.norm()).item()
        empty_ok = all(t.grad[counts == 0].abs().max().item() == 0 for t in w)
        tol = 0.1 if float8 else 2e-2
        ok = fwd < tol and rel < tol and empty_ok
        emit({"section": "empty_groups" if padded else "unpadded_groups", "config": f"{name}: {e} experts, {int((counts == 0).sum())} empty",
              "result": f"{'ok' if ok else 'MISMATCH'}: fwd rel {fwd:.1e}, grad rel {rel:.1e}, "
                        f"empty experts' grads zero: {empty_ok}, {time.perf_counter() - t0:.2f} s"})


def section_unpadded_groups(dev, dry, budget_s) -> None:
    section_empty_groups(dev, dry, budget_s, padded=False)


def section_mla_flash(dev, dry, budget_s) -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from models.common.attention import SDPA

    b, heads, s, dqk, dv = (1, 2, 64, 24, 16) if dry else (1, 16, 4096, 192, 128)
    dtype = torch.float32 if dry else torch.bfloat16
    q, k = (torch.randn(b, heads, s, dqk, device=dev, dtype=dtype, requires_grad=True) for _ in range(2))
    v = torch.randn(b, heads, s, dv, device=dev, dtype=dtype, requires_grad=True)
    attn = SDPA(scale=dqk ** -0.5)
    try:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            out = attn(q, k, v)
            out.float().square().sum().backward()
        with sdpa_kernel(SDPBackend.MATH):
            ref = attn(q.detach().float(), k.detach().float(), v.detach().float())
        rel = ((out.float() - ref).norm() / ref.norm()).item()
        result = f"{'ok' if rel < 2e-2 else 'MISMATCH'}: flash applies, out {tuple(out.shape)}, rel vs math {rel:.1e}"
    except RuntimeError as e:
        result = f"FAILED: flash does not apply: {str(e).splitlines()[0][:160]}"
    emit({"section": "mla_flash", "config": f"q/k head {dqk}, v {dv} (padded), {heads} heads, seq {s}",
          "result": result})


# --------------------------------------------------------------------------- report

def report(folder: Path, out: Path, dry: bool, problems: dict) -> tuple[str, bool]:
    """The markdown table of every section's rows; and whether all of them passed."""
    rows = []
    for section in SECTIONS:
        path = folder / f"{section}.json"
        if path.exists():
            rows += json.loads(path.read_text())
        if section in problems:
            tag = "diagnostic" if section in DIAGNOSTIC else "FAILED"
            rows.append({"section": section, "config": "(the rest)", "result": f"{tag}: {problems[section]}"})
        elif not path.exists():
            rows.append({"section": section, "config": "", "result": "FAILED: no rows (see the log)"})
    where = "CPU, --dry (tiny shapes: figures are not GPU figures)" if dry else \
        f"{torch.cuda.get_device_name()} (torch {torch.__version__})"
    lines = [f"gpu_check on {where}", "", "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(str(r.get(c, "")) for c in COLUMNS) + " |" for r in rows]
    text = "\n".join(lines) + "\n"
    out.write_text(text)
    return text, not any(r["result"].startswith(("FAILED", "MISMATCH")) for r in rows
                         if r["section"] not in DIAGNOSTIC)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("section", choices=(*SECTIONS, "report"))
    parser.add_argument("folder", nargs="?", help="report: the folder of section JSON files")
    parser.add_argument("--json", help="section: where its rows go")
    parser.add_argument("--out", help="report: the markdown file")
    parser.add_argument("--dry", action="store_true", help="CPU, tiny shapes")
    parser.add_argument("--budget-s", type=float, default=300.0, help="section: stop starting configs after this")
    parser.add_argument("--problems", default="{}", help="report: JSON {section: what went wrong with its process}")
    args = parser.parse_args()
    if args.section == "report":
        text, passed = report(Path(args.folder), Path(args.out), args.dry, json.loads(args.problems))
        print(text, end="")
        return 0 if passed else 1
    import logging

    logging.basicConfig(level=logging.WARNING)
    dev = device(args.dry)
    if dev.type == "cuda":
        torch.cuda.set_device(0)
    global ROWS_PATH
    ROWS_PATH = Path(args.json)
    globals()[f"section_{args.section}"](dev, args.dry, args.budget_s)
    return 0


if __name__ == "__main__":
    sys.exit(main())
