#!/usr/bin/env python
"""Planner benchmarks and validation tables (docs/planner.md quotes their output).

  python scripts/bench_plan.py search [--max-estimates N]   # search time: Llama 3.1 8B on 8 and
                                          # DeepSeek V3 671B on 1,024 H100 (N bounds the 671B search)
  python scripts/bench_plan.py fastpath [--whole]   # 671B: the planner's cached estimates vs the
                                          # full estimator (--whole: every estimate of the 1,024-GPU search)
  python scripts/bench_plan.py h100       # the H100 calibration rows, the published runs not fitted to,
                                          # and other GPU predictions
  python scripts/bench_plan.py fit        # the four fitted H100 efficiencies, from the calibration rows
  python scripts/bench_plan.py validate [--quick] [--rounds N]   # CPU: predicted vs measured step time and memory
                                          # through ./run_train.sh (needs --calibrate first)
  python scripts/bench_plan.py syncpoint  # CPU: a 2-rank gather between matmuls with 1 and 2 ranks
                                          # per core: its latency and sync point (step_time.py's rule)

The machine is shared: search times are wall and process CPU seconds, side by side.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

GiB = 1024**3


def _search(argv: list[str]) -> tuple[str, float, float]:
    import contextlib
    import io

    from planner.cli import main

    buf = io.StringIO()
    w0, c0 = time.perf_counter(), time.process_time()
    with contextlib.redirect_stdout(buf):
        rc = main(argv)
    wall, cpu = time.perf_counter() - w0, time.process_time() - c0
    lines = buf.getvalue().splitlines()
    return (lines[0] if lines and rc == 0 else f"exit {rc}") + ("\n" + "\n".join(lines[3:6]) if rc == 0 else ""), wall, cpu


def bench_search() -> None:
    cases = [["--config", "llama8b.toml", "--gpus", "8", "--gpu", "h100-sxm", "--seq-len", "8192",
              "--global-batch-tokens", "131072", "--top", "5"],
             ["--config", "deepseek_v3_671b.toml", "--gpus", "1024", "--gpu", "h100-sxm", "--seq-len", "4096",
              "--global-batch-tokens", str(4096 * 1024 * 4), "--top", "5", *sys.argv[2:]]]
    print("| search | wall s | CPU s (this process) | first lines |\n|---|---|---|---|")
    for argv in cases:
        text, wall, cpu = _search(argv)
        print(f"| {' '.join(argv[:4])} | {wall:.1f} | {cpu:.1f} | {text.splitlines()[0]} |")
        print("\n".join(text.splitlines()[1:]))


def bench_fastpath_whole() -> None:
    """The whole 671B search on 1,024 H100 through the planner, then every estimate it made
    through the full estimator (a lazy reference's first point without the EP-skewed probe,
    as it was made): every field must be equal. About 10 minutes on a quiet machine."""
    import contextlib
    import io

    import planner.memory as pm
    from planner.cli import main

    models = []
    init = pm.MemoryModel.__init__

    def keep(self, *args, **kwargs):
        init(self, *args, **kwargs)
        models.append(self)

    pm.MemoryModel.__init__ = keep
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        main(["--config", "deepseek_v3_671b.toml", "--gpus", "1024", "--gpu", "h100-sxm", "--seq-len", "4096",
              "--global-batch-tokens", str(4096 * 1024 * 4), "--top", "5"])
    pm.MemoryModel.__init__ = init
    print(buf.getvalue().splitlines()[0], flush=True)
    mm, n, differ = models[0], 0, 0
    for key, ref in mm.cache.items():
        points = [(ref.plan, ref.est, not ref.skewed)] + ([(ref.double, ref.est2, True)] if ref.est2 else [])
        for plan, got, phases_only in points:
            want = mm.estimate_exact(plan, phases_only=phases_only).to_dict()
            diff = [k for k, v in want.items() if got.to_dict()[k] != v]
            n, differ = n + 1, differ + bool(diff)
            if diff:
                print(f"differs: {plan} {diff}", flush=True)
    print(f"{n} estimates of {len(mm.cache)} structural keys compared with the full estimator, field by field: "
          f"{differ} differ")


def bench_fastpath() -> None:
    """DeepSeek V3 671B reference estimates that the 1,024-GPU search visits, through the
    planner's shared EstimateCache (in this order, so later ones reuse earlier readings) and
    through the full estimator (every PP rank assembled afresh): every field must be equal. The
    second microbatch is estimated for its phases only (no EP-skewed probe), both ways."""
    import dataclasses

    from planner.cli import NEUTRAL
    from planner.layout import Plan
    from planner.memory import MemoryModel, reference_plan

    mm = MemoryModel(["--config", "deepseek_v3_671b.toml", *NEUTRAL, "--training.seq_len", "4096"], "cuda", 8)

    def plan(d, rep=1, lb=4, **kw):
        return Plan(world=1024, dp_replicate=rep, dp_shard=d, local_batch=lb, microbatch=1, **kw)

    plans = [plan(256, pp=4, schedule="Interleaved1F1B", stages_per_rank=2, ep=8, ac="full"),
             plan(256, pp=4, schedule="ZBVZeroBubble", stages_per_rank=2, ep=8, ac="op"),
             plan(128, tp=2, pp=4, schedule="Interleaved1F1B", stages_per_rank=2, ep=8, ac="op"),
             plan(64, rep=2, tp=2, pp=4, schedule="Interleaved1F1B", stages_per_rank=2, ep=8, ac="full"),
             plan(128, pp=8, schedule="1F1B", ep=4, ac="budget", lb=8),
             plan(64, tp=2, pp=8, schedule="Interleaved1F1B", stages_per_rank=2, ep=4, ac="none", lb=8)]
    print("| reference of | AC | microbatch | GiB (tensors + GPU terms) | fields that differ | fast s (ranks assembled) "
          "| full s |\n|---|---|---|---|---|---|---|")
    for p in plans:
        ref = reference_plan(p)
        double = dataclasses.replace(ref, microbatch=2 * ref.microbatch, local_batch=2 * ref.local_batch)
        t, a0 = time.perf_counter(), mm.shared.assemblies
        _, est, est2 = mm.reference(p)
        fast = time.perf_counter() - t
        for point, got in ((ref, est), (double, est2)):
            t = time.perf_counter()
            want = mm.estimate_exact(point, phases_only=point is double).to_dict()
            full = time.perf_counter() - t
            diff = [k for k, v in want.items() if got.to_dict()[k] != v]
            print(f"| {p.layout_label()} | {p.ac} | {point.microbatch} | {got.device_total / GiB:.2f} | "
                  f"{', '.join(diff) or 'none'} | {f'{fast:.1f} ({mm.shared.assemblies - a0})' if point is ref else ''} | "
                  f"{full:.1f} |", flush=True)


# ---- H100 -------------------------------------------------------------------------------------

H100_ROWS = [  # TorchTitan's published H100 rows (the only ones the H100 efficiencies were fitted on)
    ("Llama 3.1 8B FSDP 8, eager, seq 8192, lbs 2, op SAC", dict(world=8, dp_shard=8, local_batch=2, ac="op"), 5762, 82.4),
    ("Llama 3.1 8B FSDP 8, compile", dict(world=8, dp_shard=8, local_batch=2, ac="op", compile=True), 6667, 77.0),
    ("Llama 3.1 8B FSDP 128, eager", dict(world=128, dp_shard=128, local_batch=2, ac="op"), 5605, 67.0),
    ("torchao float8 README: 8B, 8 GPUs, bs 1, SAC, compile, bf16",
     dict(world=8, dp_shard=8, local_batch=1, ac="op", compile=True), 6150, 47.65 * 1e9 / GiB),
]


def _predict(config: str, plan_fields: dict, gpu: str, seq: int, extra: list[str] | None = None):
    from planner.cli import NEUTRAL
    from planner.hardware import KNOWN
    from planner.layout import Plan
    from planner.memory import MemoryModel
    from planner.step_time import predict
    from planner.workload import workload_of
    from trainer.config import load_config

    argv = ["--config", config, *NEUTRAL, "--training.seq_len", str(seq), *(extra or [])]
    cfg = load_config(argv)
    hw = KNOWN[gpu]
    fields = dict(dp_replicate=1, **plan_fields)
    plan = Plan(**fields)
    from trainer.layout import layout_for

    layout_for(load_config(argv + plan.overrides(), world_size=plan.world), plan.world)  # the trainer's checks
    st = predict(plan, workload_of(cfg), hw, seq)
    mem = MemoryModel(argv, "cuda", hw.gpus_per_node).of(plan)
    return plan, st, mem, hw


def fit_h100() -> None:
    """The four fitted H100 efficiencies, from the four calibration rows (H100_ROWS) and nothing
    else: matmul, hbm and step_overhead_s from the three 8-GPU rows (the step is linear in
    1/matmul, 1/hbm and the overhead there: attention is set at 0.68 x matmul), and the
    contention of overlapped traffic (in-node set equal to inter-node) from the 128-GPU row, in
    turn until they settle. Prints the values H100_EFFICIENCY holds (it rounds them)."""
    import dataclasses

    import numpy as np

    from planner.cli import NEUTRAL
    from planner.hardware import KNOWN
    from planner.layout import Plan
    from planner.step_time import predict
    from planner.workload import workload_of
    from trainer.config import load_config

    base = KNOWN["h100-tt"]
    w = workload_of(load_config(["--config", "llama8b.toml", *NEUTRAL, "--training.seq_len", "8192"]))

    def step(fields, **eff):
        e = dataclasses.replace(base.efficiency, **eff)
        e = dataclasses.replace(e, attention=0.68 * e.matmul)
        return predict(Plan(dp_replicate=1, **fields), w, dataclasses.replace(base, efficiency=e), 8192).step_s

    def measured(fields, tps):
        return fields["local_batch"] * 8192 / tps  # per data-parallel rank (FSDP only)

    in_node = [r for r in H100_ROWS if r[1]["world"] <= base.gpus_per_node]
    (_, wide, wide_tps, _), = [r for r in H100_ROWS if r[1]["world"] > base.gpus_per_node]
    fitted = dict(contention_in_node=0.0, contention_inter_node=0.0)
    for _ in range(8):
        rows, rhs = [], []
        for _, fields, tps, _ in in_node:
            f1 = step(fields, **fitted | dict(matmul=1.0, hbm=1e9, step_overhead_s=0.0))
            a = step(fields, **fitted | dict(matmul=0.5, hbm=1e9, step_overhead_s=0.0)) - f1
            b = step(fields, **fitted | dict(matmul=1.0, hbm=1.0, step_overhead_s=0.0)) - f1
            rows.append([a, b, 1.0])
            rhs.append(measured(fields, tps) - (f1 - a))
        inv_m, inv_h, overhead = np.linalg.solve(np.array(rows), np.array(rhs))
        fitted |= dict(matmul=1 / inv_m, hbm=1 / inv_h, step_overhead_s=overhead)
        lo, hi = 0.0, 1.0
        for _ in range(40):
            mid = (lo + hi) / 2
            if step(wide, **fitted | dict(contention_in_node=mid, contention_inter_node=mid)) < measured(wide, wide_tps):
                lo = mid
            else:
                hi = mid
        fitted |= dict(contention_in_node=(lo + hi) / 2, contention_inter_node=(lo + hi) / 2)
    print(", ".join(f"{k}={v:.4f}" for k, v in fitted.items()))
    # Not fitted to any run: float8_matmul from torchao's microbenchmark of one compiled Linear on
    # H100 (README, "Performance": M, K, N = 4096, 8192, 16384 runs 1.39x bf16), through the model's
    # own cast cost at the fitted matmul and hbm.
    from planner.step_time import float8_linear_speedup

    sxm = KNOWN["h100-sxm"]
    lo, hi = 0.05, 1.0
    for _ in range(40):
        mid = (lo + hi) / 2
        eff = dataclasses.replace(sxm.efficiency, matmul=fitted["matmul"], hbm=fitted["hbm"], float8_matmul=mid)
        if float8_linear_speedup(dataclasses.replace(sxm, efficiency=eff), 4096, 8192, 16384) < 1.39:
            lo = mid
        else:
            hi = mid
    print(f"float8_matmul={(lo + hi) / 2:.4f} (torchao's 1.39x at 4096 x 8192 x 16384)")


TT24 = "torchtitan benchmarks/llama3_h100_202412_torchtitan.md"
TRAINY = "torchtitan benchmarks/llama3-8b_h200_202506_trainy-whitefiber.md"
F8 = dict(compile=True, float8=True, float8_all_gather=True)  # TorchTitan's float8 recipe: tensorwise, float8 all-gather
# Published runs the model was never fitted to: (row, source, config, seq, gpu, plan fields, tok/s/GPU,
# GiB (reserved, the busiest GPU), note)
PUBLISHED = [
    ("8B FSDP 8, compile + float8", f"{TT24} T1", "llama8b.toml", 8192, "h100-tt",
     dict(world=8, dp_shard=8, local_batch=2, ac="op", **F8), 8532, 76.8, ""),
    ("8B FSDP 8, CP 1, seq 32k", f"{TT24} T2", "llama8b.toml", 32768, "h100-tt",
     dict(world=8, dp_shard=8, local_batch=1, ac="full", **F8), 3890, 83.9, ""),
    ("8B FSDP 4 x CP 2, seq 64k", f"{TT24} T2", "llama8b.toml", 65536, "h100-tt",
     dict(world=8, dp_shard=4, cp=2, local_batch=1, ac="full", **F8), 2540, 84.2, "their CP: ring attention"),
    ("8B FSDP 2 x CP 4, seq 128k", f"{TT24} T2", "llama8b.toml", 131072, "h100-tt",
     dict(world=8, dp_shard=2, cp=4, local_batch=1, ac="full", **F8), 1071, 84.0, "their CP: ring attention"),
    ("8B CP 8, seq 256k", f"{TT24} T2", "llama8b.toml", 262144, "h100-tt",
     dict(world=8, dp_shard=1, cp=8, local_batch=1, ac="full", compile=True, float8=True), 548, 84.5,
     "their CP: ring attention; our 8B stops at max_seq_len 131072: time only"),
    ("8B FSDP 128, compile", f"{TT24} T3", "llama8b.toml", 8192, "h100-tt",
     dict(world=128, dp_shard=128, local_batch=2, ac="op", compile=True), 6514, 62.0, ""),
    ("8B FSDP 128, compile + float8", f"{TT24} T3", "llama8b.toml", 8192, "h100-tt",
     dict(world=128, dp_shard=128, local_batch=2, ac="op", **F8), 8380, 61.8, ""),
    ("70B FSDP 32 x TP 8", f"{TT24} T4", "llama70b.toml", 8192, "h100-tt",
     dict(world=256, dp_shard=32, tp=8, local_batch=16, ac="full", **F8), 829, 71.9, ""),
    ("70B FSDP 32 x TP 8, async TP", f"{TT24} T4", "llama70b.toml", 8192, "h100-tt",
     dict(world=256, dp_shard=32, tp=8, local_batch=16, ac="full", **F8), 876, 67.6, "async TP is not modelled"),
    ("405B FSDP 8 x TP 8 x PP 8, 1F1B", f"{TT24} T5", "llama405b.toml", 8192, "h100-tt",
     dict(world=512, dp_shard=8, tp=8, pp=8, schedule="1F1B", local_batch=32, microbatch=1, ac="full", **F8), 100,
     82.5, "with async TP (not modelled)"),
    ("405B FSDP 8 x TP 8 x PP 8, Interleaved 1F1B", f"{TT24} T5", "llama405b.toml", 8192, "h100-tt",
     dict(world=512, dp_shard=8, tp=8, pp=8, schedule="Interleaved1F1B", stages_per_rank=2, local_batch=32,
          microbatch=1, ac="full", **F8), 128, 72.7, "with async TP (not modelled)"),
    ("8B FSDP 32 on H200, compile + float8", TRAINY, "llama8b.toml", 8192, "h200",
     dict(world=32, dp_shard=32, local_batch=2, ac="op", **F8), 10938, 47.96, ""),
    ("8B FSDP 64 on H200, compile + float8", TRAINY, "llama8b.toml", 8192, "h200",
     dict(world=64, dp_shard=64, local_batch=2, ac="op", **F8), 10753, 46.97, ""),
]


def _time_only(config: str, plan_fields: dict, gpu: str, seq: int):
    """The time model on a plan the trainer's config check refuses (the 256k row)."""
    from planner.cli import NEUTRAL
    from planner.hardware import KNOWN
    from planner.layout import Plan
    from planner.step_time import predict
    from planner.workload import workload_of
    from trainer.config import load_config

    plan = Plan(**dict(dp_replicate=1, **plan_fields))
    return plan, predict(plan, workload_of(load_config(["--config", config, *NEUTRAL])), KNOWN[gpu], seq)


def bench_h100() -> None:
    print("Calibration rows (h100-tt: TorchTitan's 500 W, 96 GB H100), the only rows fitted to:\n")
    print("| row | published tok/s/GPU | predicted | error | published GiB | predicted GiB (tensors + GPU terms) |")
    print("|---|---|---|---|---|---|")
    for name, fields, tps, gib in H100_ROWS:
        plan, st, mem, _ = _predict("llama8b.toml", fields, "h100-tt", 8192)
        print(f"| {name} | {tps:,} | {st.tokens_per_s_per_gpu:,.0f} | {st.tokens_per_s_per_gpu / tps - 1:+.1%} | "
              f"{gib:.1f} | {mem.total / GiB:.1f} |")
    print("\nPublished runs, not fitted to:\n")
    print("| row | source | layout | AC | options | published tok/s/GPU | predicted | error | published GiB | "
          "predicted GiB | error | note |\n|---|---|---|---|---|---|---|---|---|---|---|---|")
    speed, memory = [], []
    for name, source, config, seq, gpu, fields, tps, gib, note in PUBLISHED:
        try:
            plan, st, mem, _ = _predict(config, fields, gpu, seq)
            mem_gib = mem.total / GiB
        except Exception:  # noqa: BLE001 - the trainer refuses the layout: the time model only
            plan, st = _time_only(config, fields, gpu, seq)
            mem_gib = None
        err = st.tokens_per_s_per_gpu / tps - 1
        speed.append(err)
        merr = None if mem_gib is None else mem_gib / gib - 1
        if merr is not None:
            memory.append(merr)
        print(f"| {name} | {source.split('/')[-1]} | {plan.layout_label()} | {plan.ac_label()} | {plan.options_label()} "
              f"| {tps:,} | {st.tokens_per_s_per_gpu:,.0f} | {err:+.0%} | {gib:.1f} | "
              f"{'n/a' if mem_gib is None else f'{mem_gib:.1f}'} | {'n/a' if merr is None else f'{merr:+.0%}'} | "
              f"{note} |", flush=True)
    print(f"\ntokens/s within 25%: {sum(abs(e) <= 0.25 for e in speed)} of {len(speed)}; memory within 15%: "
          f"{sum(abs(e) <= 0.15 for e in memory)} of {len(memory)}")
    print("\nOther predictions (h100-sxm; no published run):\n")
    print("| case | layout | AC | options | tok/s/GPU | MFU | memory GiB/rank | fits | bottleneck |")
    print("|---|---|---|---|---|---|---|---|---|")
    cases = [("DeepSeek V3 16B, 8 GPUs (its config: EP 8)", "deepseek_v3_16b.toml", 4096,
              dict(world=8, dp_shard=8, ep=8, local_batch=4, ac="op"), "h100-sxm")]
    for world in (256, 512, 1024):
        cases.append((f"DeepSeek V3 671B, {world} GPUs (its config: PP 8 I1F1B, EP {min(64, world // 8)})",
                      "deepseek_v3_671b.toml", 4096,
                      dict(world=world, dp_shard=world // 8, pp=8, schedule="Interleaved1F1B", stages_per_rank=2,
                           ep=min(64, world // 8), local_batch=8, microbatch=1, ac="full"), "h100-sxm"))
    for name, config, seq, fields, gpu in cases:
        plan, st, mem, hw = _predict(config, fields, gpu, seq)
        fits = "yes" if mem.total <= hw.hbm_gib * GiB else "NO"
        print(f"| {name} | {plan.layout_label()} | {plan.ac_label()} | {plan.options_label()} | "
              f"{st.tokens_per_s_per_gpu:,.0f} | {st.mfu:.1%} | {mem.total / GiB:.1f} | {fits} | {st.bottleneck} |",
              flush=True)


def bench_syncpoint() -> None:
    import os

    from planner.calibrate import measure_gloo, sync_point_worker

    cores = len(os.sched_getaffinity(0))
    print("| processes | per core | pair all-gather latency us | sync point us (gather between matmuls, "
          "minus the two apart) |\n|---|---|---|---|")
    for _ in range(2):  # interleaved rounds: the machine is shared
        for world in (cores, 2 * cores):
            world += world % 2
            latency, sync = measure_gloo(world, worker=sync_point_worker)
            print(f"| {world} | {world / cores:g} | {latency * 1e6:.0f} | {sync * 1e6:.0f} |", flush=True)


if __name__ == "__main__":
    what = sys.argv[1] if len(sys.argv) > 1 else "search"
    if what == "search":
        bench_search()
    elif what == "fastpath":
        bench_fastpath_whole() if "--whole" in sys.argv[2:] else bench_fastpath()
    elif what == "h100":
        bench_h100()
    elif what == "fit":
        fit_h100()
    elif what == "syncpoint":
        bench_syncpoint()
    elif what == "validate":
        from planner.validate import main as validate_main

        validate_main(sys.argv[2:])
    else:
        print(__doc__)
        sys.exit(2)
