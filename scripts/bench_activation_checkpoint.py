#!/usr/bin/env python
"""Cost of each activation-checkpointing mode on one process: memory, FLOPs, speed.

    python scripts/bench_activation_checkpoint.py --config llama_debug.toml [--section.key value ...]
    python scripts/bench_activation_checkpoint.py --block-8b            # one Llama 3 8B layer, seq 256, batch 1

Prints one row per mode (none, full, selective, op, budget; memory_budget too when
--compile.enable true, and then every mode is compiled so the comparison holds
compile fixed):

- saved/block: activation bytes one block keeps for backward, averaged over the
  blocks; exact, including what the op-level SAC cache holds. Measured as (bytes
  saved by the whole model) - (bytes saved by the same model with 0 blocks), divided
  by the number of blocks, with parameters and buffers excluded.
- fwd / bwd / recompute: FLOPs per step from FlopCounterMode, CPU flash attention
  included. recompute = backward-phase FLOPs minus those of `none`; bwd is the
  backward proper. These are counted eagerly (compiled kernels are invisible to the
  counter), so for memory_budget the recompute is n/a.
- recomp %: recompute FLOPs as a share of all the step's FLOPs.
- tokens/s: forward + backward (no optimizer), best of the timed steps (the least
  disturbed on a shared machine), after a warm-up step; tok/cpu-s divides
  by the process's CPU time instead of wall time, which is steadier on a shared machine
  (on GPU it is meaningless: use tokens/s).
- peak mem: peak RSS during the timed steps on CPU (Linux VmHWM, reset before them;
  each mode runs in its own process), or peak allocated CUDA memory on GPU; "+step" is
  that peak minus the memory held just before the steps (weights, gradients). It also
  holds backward's transient buffers, and during a block's recompute that block's whole
  activations, so it falls less than saved/block suggests.

Bench flags: --block-8b, --modes none,full,..., --budgets 0,0.25,...,inf (rows of mode=budget
with those budget_fraction values, inf = no limit, next to none and full; the first step
of a budget row measures the blocks and is not counted), --steps N (timed), --seq-len, --batch,
--check-bytes (cross-check saved/block against saved_activation_bytes per block),
--threads N (torch threads; 1 gives steadier tok/cpu-s on a shared machine), --interleaved R
(speed from R rounds in which the modes take turns in one process: the fairest comparison on
a shared machine; eager, CPU),
--in-process (all modes in this process; peak RSS is then not per mode).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from trainer.memory import _hwm_bytes, _malloc_trim, _reset_hwm, _rss_bytes  # noqa: E402
from parallelisms.ac_measure import SavedActivationCounter, flop_counter, saved_activation_bytes  # noqa: E402
from parallelisms.activation_checkpoint import apply_activation_checkpointing, unwrap_block  # noqa: E402

EAGER_MODES = ("none", "full", "selective", "op", "budget")


def _bench_args(argv: list[str]):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--block-8b", action="store_true", help="one Llama 3 8B layer (seq 256, batch 1 unless given)")
    p.add_argument("--modes", default=None, help="comma-separated subset of the modes")
    p.add_argument("--budgets", default=None,
                   help="rows of mode=budget instead: comma-separated fractions of none's bytes (and inf), "
                        "next to none and full, e.g. 0,0.1,0.25,0.5,0.75,1,inf")
    p.add_argument("--steps", type=int, default=None, help="timed steps per mode (default 3; 1 with --block-8b)")
    p.add_argument("--check-bytes", action="store_true",
                   help="also count each block with saved_activation_bytes and warn on any difference")
    p.add_argument("--seq-len", type=int, default=None)
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads for the runs")
    p.add_argument("--in-process", action="store_true", help="run every mode in this process")
    p.add_argument("--interleaved", type=int, default=0, metavar="R",
                   help="speed columns from R interleaved rounds of all modes in one process (CPU, eager) "
                        "instead of each mode's own process")
    p.add_argument("--_worker", default=None, help=argparse.SUPPRESS)
    return p.parse_known_args(argv)


def _load_cfg(rest: list[str]):
    from trainer.config import load_config
    from configuration.fields import ConfigError
    try:
        return load_config(rest)
    except ConfigError as e:
        # The TOML may not exist yet: fall back to the defaults plus the other overrides.
        if "not found" not in str(e):
            raise
        drop = {"--config", "--config-file", "--config_file", "--job.config_file"}
        kept, skip = [], False
        for a in rest:
            if skip:
                skip = False
                continue
            if a.split("=", 1)[0] in drop:
                skip = "=" not in a
                continue
            kept.append(a)
        print(f"note: {e}; using model.name/flavor defaults", file=sys.stderr)
        return load_config(kept)


def _setup(opts, cfg):
    """(spec, model args, batch, seq) for the run."""
    from models import MODEL_SPECS
    if opts.block_8b:
        spec = MODEL_SPECS["llama3"]
        seq = opts.seq_len or 256
        # One 8B block; a small vocabulary so the embedding and head are negligible.
        args = dataclasses.replace(spec.flavors["8B"], n_layers=1, vocab_size=1024, max_seq_len=seq)
        return spec, args, opts.batch or 1, seq, "llama3 8B x 1 layer"
    spec = MODEL_SPECS[cfg.model.name]
    seq = opts.seq_len or cfg.training.seq_len
    args = dataclasses.replace(spec.flavors[cfg.model.flavor])
    if hasattr(args, "max_seq_len"):
        args.max_seq_len = max(seq, 1)
    return spec, args, opts.batch or cfg.training.local_batch_size, seq, f"{cfg.model.name} {cfg.model.flavor}"


def _build(spec, args, device, dtype):
    from parallelisms.apply import build_model

    torch.manual_seed(0)
    model = build_model(spec, args)
    model.to_empty(device=device)
    model.init_weights()
    return model.to(dtype)


def _ac_cfg(base, mode: str):
    """The AC config of a row: a mode, or `budget:F` (budget_fraction F of none's bytes;
    `budget:inf` for no limit)."""
    if not mode.startswith("budget:"):
        return dataclasses.replace(base, mode=mode)
    value = mode.split(":", 1)[1]
    if value == "inf":
        return dataclasses.replace(base, mode="budget", budget_mib=1e12)
    return dataclasses.replace(base, mode="budget", budget_mib=None, budget_fraction=float(value))


def _peak_rss_bytes() -> int:
    peak = _hwm_bytes()
    return peak if peak is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # lifetime peak


def _loss(model, tokens):
    return model(tokens).float().logsumexp(-1).mean()


def run_mode(mode: str, opts, cfg) -> dict:
    from parallelisms.compile import apply_compile
    spec, args, batch, seq, _ = _setup(opts, cfg)
    device = torch.device("cuda" if torch.cuda.is_available() and cfg.training.device != "cpu" else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    compiled = bool(cfg.compile.enable)
    ac_cfg = _ac_cfg(cfg.activation_checkpoint, mode)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, args.vocab_size, (batch, seq), generator=g).to(device)

    model = _build(spec, args, device, dtype)
    head_only = _build(spec, dataclasses.replace(args, n_layers=0), device, dtype)
    n_layers = len(model.layers)
    apply_activation_checkpointing(model, ac_cfg, spec=spec, compile_enabled=compiled)

    if ac_cfg.mode == "budget":  # its first call of each kind of block measures (and runs as full), the
        for _ in range(2):        # second records the block's plan: the counted step is the first to apply it
            _loss(model, tokens).backward()
            model.zero_grad(set_to_none=True)

    def forward_counted(m):
        exclude = list(m.parameters()) + list(m.buffers())
        with SavedActivationCounter(exclude) as counter:
            loss = _loss(m, tokens)
        return loss, counter.total_bytes

    # 1) One eager step: FLOPs (compiled kernels are invisible to FlopCounterMode) and,
    #    when not compiling, the saved bytes. It is also the warm-up step.
    fwd = bwd = None
    if mode != "memory_budget":
        with flop_counter() as fc_f:
            loss, total = forward_counted(model)
        with flop_counter() as fc_b:
            loss.backward()
        fwd, bwd = fc_f.get_total_flops(), fc_b.get_total_flops()
    # 2) Compiled: what the partitioner keeps is what the compiled blocks save.
    if compiled:
        apply_compile(model, cfg.compile, ac_cfg)
        loss, total = forward_counted(model)
        loss.backward()  # compiles (warm-up)
    head = forward_counted(head_only)[1]
    del head_only
    per_block = (total - head) / max(n_layers, 1)
    check = None
    if opts.check_bytes and not compiled:  # cross-check with the per-block counter
        ref = 0
        for key, block in model.layers.items():
            x = torch.randn(batch, seq, args.dim, device=device, dtype=dtype, requires_grad=True)
            ref += saved_activation_bytes(unwrap_block(block), x, model.rope_cache[:seq], mode=ac_cfg.mode, cfg=ac_cfg,
                                          spec=spec, layer_id=int(key))
        check = ref / max(n_layers, 1)

    # 3) Speed and peak memory: weights and grads are already allocated.
    for p in model.parameters():
        p.grad = None if p.grad is None else p.grad.zero_()
    if device.type == "cuda":
        torch.cuda.synchronize()
        base_mem = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    else:
        _malloc_trim()  # hand freed heap pages back, so the baseline is what is really held
        _reset_hwm()
        base_mem = _rss_bytes()
    walls, cpus = [], []
    for _ in range(opts.steps):
        t0, c0 = time.perf_counter(), time.process_time()
        _loss(model, tokens).backward()
        if device.type == "cuda":
            torch.cuda.synchronize()
        walls.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - c0)
    # Best of the timed steps: on a shared machine the minimum is the least disturbed.
    dt, cpu = min(walls), min(cpus)
    peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else _peak_rss_bytes()
    return {"mode": mode, "saved_per_block": per_block, "saved_per_block_check": check, "fwd": fwd, "bwd": bwd,
            "tokens_per_s": batch * seq / dt,
            "tokens_per_cpu_s": batch * seq / max(cpu, 1e-9),
            "peak": peak, "peak_over_base": peak - base_mem,
            "device": device.type, "compiled": compiled}


def interleaved_speed(modes: list[str], opts, cfg) -> dict[str, tuple[float, float]]:
    """Median tokens/s and tokens per CPU-second of each mode, measured in this process with
    the modes taking turns, one fwd+bwd step each, for `opts.interleaved` rounds (the order
    reversed every other round), so that the machine's drift hits every mode alike."""
    import statistics
    spec, args, batch, seq, _ = _setup(opts, cfg)
    tokens = torch.randint(0, args.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0))
    models = {}
    for mode in modes:
        models[mode] = _build(spec, args, torch.device("cpu"), torch.float32)
        apply_activation_checkpointing(models[mode], _ac_cfg(cfg.activation_checkpoint, mode), spec=spec)
        _loss(models[mode], tokens).backward()  # warm-up (and the budget policy's measuring call)
    walls: dict = {m: [] for m in modes}
    cpus: dict = {m: [] for m in modes}
    for r in range(opts.interleaved):
        for mode in (modes if r % 2 == 0 else modes[::-1]):
            models[mode].zero_grad(set_to_none=True)
            t0, c0 = time.perf_counter(), time.process_time()
            _loss(models[mode], tokens).backward()
            walls[mode].append(time.perf_counter() - t0)
            cpus[mode].append(time.process_time() - c0)
    return {m: (batch * seq / statistics.median(walls[m]), batch * seq / statistics.median(cpus[m])) for m in modes}


def _fmt_bytes(n) -> str:
    if n is None:
        return "n/a"
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def _fmt_flops(n) -> str:
    return "n/a" if n is None else f"{n / 1e9:.2f}"


def print_table(rows: list[dict], title: str) -> None:
    base_bwd = next((r["bwd"] for r in rows if r["mode"] == "none" and r["bwd"] is not None), None)
    mem_name = "peak CUDA" if rows and rows[0]["device"] == "cuda" else "peak RSS"
    header = (f"{'mode':<14}{'saved/block':>13}{'fwd GFLOP':>11}{'bwd GFLOP':>11}{'recomp GFLOP':>14}"
              f"{'recomp %':>10}{'tokens/s':>10}{'tok/cpu-s':>11}{mem_name:>12}{'+step':>12}")
    print(title)
    print(header)
    print("-" * len(header))
    for r in rows:
        if r["bwd"] is None or base_bwd is None:
            rec = pure_bwd = None
        else:
            rec, pure_bwd = r["bwd"] - base_bwd, base_bwd
        pct = "n/a" if rec is None else f"{100 * rec / (r['fwd'] + r['bwd']):.1f}%"
        print(f"{r['mode']:<14}{_fmt_bytes(r['saved_per_block']):>13}{_fmt_flops(r['fwd']):>11}"
              f"{_fmt_flops(pure_bwd):>11}{_fmt_flops(rec):>14}{pct:>10}{r['tokens_per_s']:>10.0f}"
              f"{r['tokens_per_cpu_s']:>11.0f}{_fmt_bytes(r['peak']):>12}{_fmt_bytes(r['peak_over_base']):>12}")


def main(argv: list[str] | None = None) -> list[dict]:
    argv = list(sys.argv[1:] if argv is None else argv)
    opts, rest = _bench_args(argv)
    if opts.steps is None:
        opts.steps = 1 if opts.block_8b else 3
    if opts.threads:
        torch.set_num_threads(opts.threads)
    cfg = _load_cfg(rest)
    if opts._worker:
        print("RESULT " + json.dumps(run_mode(opts._worker, opts, cfg)), flush=True)
        return []
    # (budget is the eager memory budget: under compile, memory_budget is the one.)
    modes = [m for m in EAGER_MODES if m != "budget"] + ["memory_budget"] if cfg.compile.enable else list(EAGER_MODES)
    if opts.modes:
        modes = [m.strip() for m in opts.modes.split(",") if m.strip()]
    if opts.budgets:
        modes = ["none", "full"] + [f"budget:{b.strip()}" for b in opts.budgets.split(",") if b.strip()]
    _, args, batch, seq, what = _setup(opts, cfg)
    title = (f"{what}: {args.n_layers} blocks, batch {batch}, seq {seq}, "
             f"compile {'on' if cfg.compile.enable else 'off'}, selective every "
             f"{cfg.activation_checkpoint.selective_layer_interval}, torch {torch.__version__}, "
             f"{torch.get_num_threads()} threads")
    rows = []
    for mode in modes:
        if opts.in_process:
            rows.append(run_mode(mode, opts, cfg))
            continue
        cmd = [sys.executable, str(Path(__file__).resolve()), *argv, "--_worker", mode]
        env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
        if proc.returncode != 0 or line is None:
            sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-3000:])
            raise SystemExit(f"mode {mode} failed (exit {proc.returncode})")
        rows.append(json.loads(line[len("RESULT "):]))
    if opts.interleaved:
        speeds = interleaved_speed(modes, opts, cfg)
        for r in rows:
            r["tokens_per_s"], r["tokens_per_cpu_s"] = speeds[r["mode"]]
        title += f"; speed: median of {opts.interleaved} interleaved rounds in one process"
    for r in rows:
        chk = r.get("saved_per_block_check")
        if chk is not None and abs(chk - r["saved_per_block"]) > 0.5:
            print(f"warning: {r['mode']}: per-block counter says {chk:.0f} B, model difference "
                  f"{r['saved_per_block']:.0f} B", file=sys.stderr)
    print_table(rows, title)
    return rows


if __name__ == "__main__":
    main()
