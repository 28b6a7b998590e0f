"""`python scripts/plan.py`: the command line of the planner (scripts/plan.py is a shim).

    python scripts/plan.py --config llama8b.toml --gpus 8 --gpu h100-sxm --seq-len 8192 \
        --global-batch-tokens 131072 [--explain 1] [--write best.toml]
    python scripts/plan.py --config my.toml --gpus 8 --predict   # time and memory of my.toml's own layout
    python scripts/plan.py --calibrate                       # measure this CPU (cpu-gloo entry)

Planner options (everything else is a trainer override, `--section.key value`, applied to
the base config before the search sets the layout):
  --gpus N                 GPUs (ranks) to plan for (required)
  --gpu NAME               a known GPU (h100-sxm, h100-tt, h100-pcie, h200, b200, gb200, a100, mi300x) or
                           cpu-gloo (after --calibrate); default h100-sxm
  --hardware FILE          a TOML hardware entry instead (docs/planner.md lists the fields)
  --seq-len S              tokens per sample (default: the config's training.seq_len)
  --global-batch-tokens T  tokens per optimizer step (default: the config's local batch x seq x GPUs)
  --top N                  plans to print (default 10)
  --margin F               share of each GPU's memory a plan must leave free (default 0.1; 0 to 0.9)
  --predict                no search: the step time and memory of the config's own layout on --gpus
  --explain N              break plan N's step and memory into parts
  --write FILE             write plan 1 (or --explain's plan) as a config ./run_train.sh runs as is
  --ac MODES               AC modes to search, comma-separated from none,op,full,budget (default all)
  --compile on|off|both    (default both on GPUs, off on CPU)
  --float8 on|off|both     (default both where the GPU has fp8; float8 plans gather in float8 where FSDP shards)
  --max-estimates N        stop the search before the memory estimator runs more than N times
  --verify                 re-run the exact estimator on plan 1's own layout and print both numbers
  --calibrate              measure this machine (matmul, attention, memory, gloo) into the cpu-gloo entry
  --calibration-file F     where the cpu-gloo entry lives (default ~/.cache/titanlite/cpu-gloo.toml)
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from configuration.fields import ConfigError

_VALUE = {"--gpus": "gpus", "--gpu": "gpu", "--hardware": "hardware", "--seq-len": "seq", "--global-batch-tokens":
          "tokens", "--top": "top", "--explain": "explain", "--write": "write", "--ac": "ac", "--compile": "compile",
          "--float8": "float8", "--calibration-file": "calibration", "--max-estimates": "max_estimates",
          "--margin": "margin"}
_FLAG = {"--calibrate": "calibrate", "--verify": "verify", "--predict": "predict", "--help": "help", "-h": "help"}
_INT = ("gpus", "seq", "tokens", "top", "explain", "max_estimates")
NEUTRAL = ["--parallelism.data_parallel_replicate_degree", "1", "--parallelism.data_parallel_shard_degree", "-1",
           "--parallelism.tensor_parallel_degree", "1", "--parallelism.context_parallel_degree", "1",
           "--parallelism.pipeline_parallel_degree", "1", "--parallelism.pipeline_parallel_schedule", "1F1B",
           "--parallelism.pipeline_parallel_stages_per_rank", "1", "--parallelism.expert_parallel_degree", "1",
           "--loss.chunked_ce", "false", "--compile.enable", "false", "--float8.enable", "false",
           "--activation_checkpoint.mode", "none", "--training.global_batch_size", "-1"]


def parse(argv: list[str]) -> tuple[dict, list[str]]:
    opts: dict = {"gpus": None, "gpu": None, "hardware": None, "seq": None, "tokens": None, "top": 10,
                  "explain": None, "write": None, "ac": None, "compile": None, "float8": None, "calibration": None,
                  "calibrate": False, "verify": False, "help": False, "max_estimates": None, "margin": None,
                  "predict": False}
    rest, i = [], 0
    while i < len(argv):
        key, eq, inline = argv[i].partition("=")
        if key in _VALUE:
            if not eq:
                if i + 1 >= len(argv):
                    raise ConfigError(f"config error: {key} needs a value")
                inline, i = argv[i + 1], i + 1
            name = _VALUE[key]
            if name in _INT:
                if not inline.isdigit() or int(inline) < 1:
                    raise ConfigError(f"config error: {key}: expected a positive whole number, got {inline!r}")
                inline = int(inline)
            if name == "margin":
                inline = _margin(key, inline)
            opts[name] = inline
        elif argv[i] in _FLAG:
            opts[_FLAG[argv[i]]] = True
        else:
            rest.append(argv[i])
        i += 1
    for name in ("compile", "float8"):
        if opts[name] not in (None, "on", "off", "both"):
            raise ConfigError(f"config error: --{name}: {opts[name]!r} is not one of on, off, both")
    return opts, rest


def _margin(key: str, text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value <= 0.9:
        raise ConfigError(f"config error: {key}: expected a share of the memory from 0 to 0.9 (e.g. 0.1 for 10%), "
                          f"got {text!r}")
    return value


def _choices(value, default):
    return {"on": (True,), "off": (False,), "both": (False, True)}[value] if value else default


def space_for(opts: dict, hw):
    from planner.search import Space

    cuda = hw.device == "cuda"
    space = Space(compile=_choices(opts["compile"], (False, True) if cuda else (False,)),
                  float8=_choices(opts["float8"], (False, True) if cuda and hw.fp8_tflops > 0 else (False,)),
                  min_tokens_per_cp_rank=4096 if cuda else 64)
    if opts["ac"]:
        modes = tuple(m.strip() for m in opts["ac"].split(","))
        bad = [m for m in modes if m not in ("none", "op", "full", "budget")]
        if bad:
            raise ConfigError(f"config error: --ac: {bad[0]!r} is not one of none, op, full, budget")
        space.ac_modes = modes
    # Flag combinations nothing can satisfy: one line each, before any search.
    if space.compile == (True,) and set(space.ac_modes) == {"budget"}:
        raise ConfigError("config error: --ac budget with --compile on: AC budget is the eager memory budget and the "
                          "trainer refuses it under compile; use --compile off, or another --ac mode")
    if opts["float8"] == "on" and not (cuda and hw.fp8_tflops > 0):
        raise ConfigError(f"config error: --float8 on: {hw.name} has no float8 matmuls (fp8_tflops "
                          f"{hw.fp8_tflops:g}{', a CPU entry' if not cuda else ''}); use --float8 off or a GPU with "
                          "float8 (h100-sxm, h200, b200)")
    return space


def run(opts: dict, rest: list[str]) -> int:
    from planner import report
    from planner.hardware import get_hardware
    from planner.layout import legend
    from planner.memory import MemoryModel
    from planner.search import DEFAULT_MARGIN, GiB, Search
    from planner.workload import workload_of
    from trainer.config import load_config

    hw = get_hardware(opts["gpu"], opts["hardware"], Path(opts["calibration"]) if opts["calibration"] else None)
    margin = DEFAULT_MARGIN if opts["margin"] is None else opts["margin"]
    if not any(a in ("--config", "--job.config_file") or a.startswith(("--config=", "--job.config_file="))
               for a in rest) and not any(a.startswith("--model.") for a in rest):
        raise ConfigError("config error: --config: pass a model config (e.g. --config llama8b.toml) or "
                          "--model.hf_path DIR")
    if opts["gpus"] is None:
        raise ConfigError("config error: --gpus: say how many GPUs to plan for (e.g. --gpus 8)")
    if opts["predict"]:
        return predict_config(opts, rest, hw, margin)
    base = load_config(rest + NEUTRAL)
    seq = opts["seq"] or base.training.seq_len
    base_argv = rest + NEUTRAL + ["--training.seq_len", str(seq)]
    cfg = load_config(base_argv)
    world = opts["gpus"]
    tokens = opts["tokens"] or base.training.local_batch_size * seq * world
    if tokens % seq:
        raise ConfigError(f"config error: --global-batch-tokens: {tokens} is not a multiple of the sequence length "
                          f"{seq}; use a multiple")
    t0 = time.perf_counter()
    w = workload_of(cfg, hw)
    memory = MemoryModel(base_argv, hw.device, hw.gpus_per_node)
    search = Search(cfg, base_argv, w, hw, world, seq, tokens // seq, space_for(opts, hw), memory, margin=margin,
                    max_estimates=opts["max_estimates"])
    results = search.run(max(opts["top"], opts["explain"] or 1))
    elapsed = time.perf_counter() - t0
    if not results:
        raise ConfigError(no_fit_line(search, w, hw, world, seq, tokens, opts))
    st = search.stats
    title = (f"plans for {w.name} on {world} x {hw.name} ({hw.hbm_gib:g} GiB), seq {seq}, {tokens:,} tokens per "
             f"step: {st.skeletons} layouts, {st.visited} searched, {st.options_tried} options checked; "
             f"{memory.calls} estimator runs, {memory.hits} cache hits, {memory.shared.assemblies} ranks assembled; "
             f"{elapsed:.1f} s\n"
             f"(memory margin {margin:.0%}: a plan leaves at least {margin * hw.hbm_gib:.1f} GiB of each GPU free, "
             "--margin changes it; ~: memory read off a cached estimate of the same local shapes, see --explain)"
             + (f"\nstopped at --max-estimates {opts['max_estimates']}: faster plans may be missing"
                if search.truncated else ""))
    hbm = hw.hbm_gib * GiB
    print(report.table(results[:opts["top"]], hbm, title))
    print(legend([r.plan for r in results[:opts["top"]]]))
    chosen = opts["explain"] or 1
    if chosen > len(results):
        raise ConfigError(f"config error: --explain: {chosen}, but only {len(results)} plans were found")
    if opts["explain"]:
        print()
        print(report.explain(results[chosen - 1], chosen, hbm))
    if opts["verify"]:
        est = memory.estimate_exact(results[chosen - 1].plan)
        print(f"\nverify: the estimator on plan {chosen} itself: {est.device_total / GiB:.2f} GiB per rank "
              f"(planner: {results[chosen - 1].memory.total / GiB:.2f} GiB)")
    if opts["write"]:
        base_file = cfg.job.config_file
        extra = user_overrides(rest)
        extra.setdefault("training", {})["seq_len"] = seq
        report.write_config(opts["write"], results[chosen - 1].plan, base_file, extra)
        print(f"\nwrote plan {chosen} to {opts['write']}: NGPU={world} ./run_train.sh --config {opts['write']}")
    return 0


def predict_config(opts: dict, rest: list[str], hw, margin: float) -> int:
    """`--predict`: the step time and memory of the config's own layout on --gpus (no search),
    with --seq-len and --global-batch-tokens applied as overrides when given."""
    from planner import report
    from planner.layout import legend, plan_of_config
    from planner.memory import MemoryModel
    from planner.search import GiB, Result
    from planner.step_time import predict
    from planner.workload import workload_of
    from trainer.config import load_config

    argv = list(rest)
    if opts["seq"]:
        argv += ["--training.seq_len", str(opts["seq"])]
    world = opts["gpus"]
    cfg = load_config(argv, world_size=world)
    seq = cfg.training.seq_len
    if opts["tokens"]:
        if opts["tokens"] % seq:
            raise ConfigError(f"config error: --global-batch-tokens: {opts['tokens']} is not a multiple of the "
                              f"sequence length {seq}; use a multiple")
        argv += ["--training.global_batch_size", str(opts["tokens"] // seq)]
        cfg = load_config(argv, world_size=world)
    from trainer.layout import layout_for

    layout_for(cfg, world)  # what ./run_train.sh checks before a worker starts
    plan = plan_of_config(cfg, world)
    st = predict(plan, workload_of(cfg, hw), hw, seq, compute_bytes=4 if hw.device == "cpu" else 2)
    mem = MemoryModel(argv, hw.device, hw.gpus_per_node).exact(plan)
    hbm = hw.hbm_gib * GiB
    free = 1 - mem.total / hbm
    verdict = (f"fits, {free:.0%} free (margin {margin:.0%})" if free >= margin else
               f"does NOT fit within the {margin:.0%} margin ({free:.0%} free)" if free >= 0 else "does NOT fit")
    print(f"predicted for {cfg.job.config_file or 'the config'} on {world} x {hw.name} ({hw.hbm_gib:g} GiB): "
          f"{plan.layout_label()}, AC {plan.ac_label()}, {plan.options_label()}: step {st.step_s:.3f} s, "
          f"{st.tokens_per_s_per_gpu:,.0f} tokens/s/GPU, MFU {st.mfu:.1%}; memory {mem.total / GiB:.2f} GiB per rank, "
          f"{verdict}\n")
    print(report.explain(Result(plan, st, mem), 0, hbm))
    print(legend([plan]))
    return 0


def user_overrides(rest: list[str]) -> dict[str, dict]:
    """The user's `--section.key value` overrides (not --config), for the written TOML, typed as
    the config loader types them."""
    from planner.report import _parse
    from trainer.config import _parse_cli

    out: dict[str, dict] = {}
    for section, key, value in _parse_cli(rest):
        if (section, key) != ("job", "config_file"):
            out.setdefault(section, {})[key] = _parse(value) if isinstance(value, str) else value
    return out


def no_fit_line(search, w, hw, world, seq, tokens, opts) -> str:
    """One line: why nothing fits, and the smallest GPU count (by doubling) that does."""
    from planner.search import GiB, Search

    best = search.min_footprint()
    floor = 16 * w.total_params / world
    if best:
        why = (f"the smallest footprint found is {best[0] / GiB:.2f} GiB per rank ({best[1].layout_label()}, AC "
               f"{best[1].ac_label()}: params + AdamW states {best[2].persistent / GiB:.2f} GiB, activations "
               f"{best[2].activations / GiB:.2f} GiB)")
    elif floor > search.capacity:
        why = (f"even the parameters, gradients and AdamW states ({floor / GiB:.2f} GiB per rank at 16 bytes per "
               "parameter, sharded over every GPU) exceed it")
    else:
        why = ("no layout of the searched space passes the project's layout checks with a lower bound of its memory "
               "that fits (--ac, --compile and --float8 narrow the space)")
    hint = f"; more than {world * 16} GPUs would be needed"
    for k in range(1, 5):  # the same search space (AC modes, compile, float8, margin) on more GPUs
        more = world * 2**k
        toks = max(tokens, seq * more)
        small = Search(search.cfg, search.base_argv, w, hw, more, seq, toks // seq, search.space, search.memory,
                       margin=search.margin)  # the estimates are per local shape: shared
        found = small.run(1)
        if found:
            r = found[0]
            hint = (f"; {more} GPUs fit ({r.plan.layout_label()}, AC {r.plan.ac_label()}, "
                    f"{r.memory.total / GiB:.2f} GiB per rank)")
            if best:
                hint += f", or GPUs with {best[0] / GiB / (1 - search.margin):.2f} GiB"
            break
    return (f"config error: --gpus: {w.name} fits at no layout on {world} x {hw.name} ({hw.hbm_gib:g} GiB each, "
            f"{search.margin:.0%} kept free): {why}{hint}")


def main(argv: list[str] | None = None) -> int:
    from trainer.errors import report_user_error, user_error_types

    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        opts, rest = parse(argv)
        if opts["help"]:
            print(__doc__)
            return 0
        if opts["calibrate"]:
            from planner.calibrate import calibrate_cpu

            _, text = calibrate_cpu(Path(opts["calibration"]) if opts["calibration"] else None)
            print(text)
            return 0
        return run(opts, rest)
    except user_error_types() as e:
        return report_user_error(str(e))
