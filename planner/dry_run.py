"""What `./run_train.sh --config X --dry-run` adds: the prediction for X's own layout, and
one line when a layout predicted at least 10% faster fits.

Why bounded: a dry run is a quick check, so the search for a faster layout may run the
memory estimator at most `MAX_ESTIMATES` times (the full search is scripts/plan.py).
The GPU is `TITAN_PLAN_GPU`: a name (default h100-sxm; cpu-gloo once calibrated) or a
hardware TOML file;
`TITAN_DRY_RUN_PLAN=0` turns the lines off (the test suite does, to keep CI short).
Any failure here is one line, never a failed dry run.
"""

from __future__ import annotations

MAX_ESTIMATES = 3
GiB = 1024**3


def dry_run_lines(argv: list[str], cfg, world: int) -> list[str]:
    from configuration.environment import env_value

    if env_value("TITAN_DRY_RUN_PLAN", "1").strip() == "0":
        return []
    try:
        return _lines(argv, cfg, world)
    except Exception as e:  # the prediction is advice: it must not fail the dry run
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        return [f"plan: no prediction for this config ({first})"]


def _lines(argv: list[str], cfg, world: int) -> list[str]:
    from planner.cli import space_for
    from planner.hardware import get_hardware
    from planner.layout import plan_of_config
    from planner.memory import MemoryModel
    from planner.search import DEFAULT_MARGIN, Search
    from planner.step_time import predict
    from planner.workload import workload_of

    from configuration.environment import env_value

    choice = env_value("TITAN_PLAN_GPU") or "h100-sxm"
    hw = get_hardware(path=choice) if choice.endswith(".toml") else get_hardware(choice)
    plan = plan_of_config(cfg, world)
    w = workload_of(cfg, hw)
    seq = cfg.training.seq_len
    esize = 4 if hw.device == "cpu" else 2
    st = predict(plan, w, hw, seq, compute_bytes=esize)
    memory = MemoryModel(list(argv), hw.device, hw.gpus_per_node)
    capacity = hw.hbm_gib * GiB * (1 - DEFAULT_MARGIN)
    try:
        mem = memory.of(plan)
        fits = mem.total <= capacity
        mem_text = (f"{mem.total / GiB:.1f} GiB per rank of {hw.hbm_gib:g} ({'fits' if fits else 'does NOT fit'} "
                    f"with {DEFAULT_MARGIN:.0%} kept free)")
    except Exception as e:  # e.g. AC memory_budget, which the estimator cannot count
        mem_text = f"memory n/a ({str(e).splitlines()[0]})"
    out = [f"plan: predicted on {world} x {hw.name}: {st.tokens_per_s_per_gpu:,.0f} tokens/s/GPU, MFU {st.mfu:.1%}, "
           f"step {st.step_s:.2f} s, {mem_text}; bottleneck {st.bottleneck} (TITAN_PLAN_GPU picks the GPU; "
           "python scripts/plan.py --explain 1 breaks it down)"]
    search = Search(cfg, list(argv), w, hw, world, seq, plan.global_batch, space_for(
        {"compile": None, "float8": None, "ac": None}, hw), memory, max_estimates=memory.calls + MAX_ESTIMATES)
    found = search.run(1)
    if found and found[0].time.step_s <= 0.9 * st.step_s:
        b = found[0]
        gain = st.step_s / b.time.step_s - 1
        out.append(f"plan: a layout predicted {gain:.0%} faster fits: {b.plan.layout_label()}, AC {b.plan.ac_label()}, "
                   f"{b.plan.options_label()} ({b.memory.total / GiB:.1f} GiB per rank); python scripts/plan.py "
                   f"--config {cfg.job.config_file} --gpus {world} --gpu {hw.name} --write best.toml writes it")
    return out
