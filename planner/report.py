"""What the planner prints and writes: the ranked table, `--explain N`, `--write FILE`.

Why a TOML and not a command line: the written file is the base config with the plan's
fields set, so `./run_train.sh --config best.toml` runs it as is (NGPU = the plan's world),
and it keeps the user's data, optimizer and checkpoint settings.
"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

from planner.layout import Plan

GiB = 1024**3


def _gib(n: float) -> str:
    return f"{n / GiB:.1f}"


def table(results, hbm: float, title: str) -> str:
    """`hbm`: the device's memory in bytes (the column shows the share of it left free)."""
    lines = [title, "",
             "| # | layout | AC | options | memory/rank GiB (free) | tokens/s/GPU | MFU | step s | bottleneck |",
             "|---|---|---|---|---|---|---|---|---|"]
    for i, r in enumerate(results, 1):
        margin = 1 - r.memory.total / hbm
        mark = "" if r.memory.exact else "~"
        lines.append(f"| {i} | {r.plan.layout_label()} | {r.plan.ac_label()} | {r.plan.options_label()} | "
                     f"{mark}{_gib(r.memory.total)} ({margin:.0%}) | {r.time.tokens_per_s_per_gpu:,.0f} | "
                     f"{r.time.mfu:.1%} | {r.time.step_s:.3f} | {r.time.bottleneck} |")
    return "\n".join(lines)


def explain(result, n: int, hbm: float) -> str:
    """Plan `n`'s step and memory, part by part (n = 0: the config's own layout, --predict)."""
    st, mem, plan = result.time, result.memory, result.plan
    lines = [f"{f'plan {n}' if n else 'layout'}: {plan.layout_label()}, AC {plan.ac_label()}, {plan.options_label()} on {plan.world} ranks",
             f"  step {st.step_s:.3f} s = {st.tokens_per_step:,} tokens; {st.tokens_per_s_per_gpu:,.0f} tokens/s/GPU, "
             f"MFU {st.mfu:.1%}; bottleneck: {st.bottleneck}", "", "  step time, by part:"]
    for k, v in st.parts.items():
        lines.append(f"    {k:<32}{v:>10.4f} s {v / st.step_s:>6.1%}")
    if st.collectives:
        lines += ["", "  collectives per rank per step:"]
        for c in st.collectives:
            lines.append(f"    {c.name:<34}{c.bytes / GiB:>9.3f} GiB over {c.group:>4} ranks, {c.link:<10} "
                         f"{c.seconds:>8.4f} s {_overlap_label(c)}")
    ref = mem.reference
    lines += ["", f"  memory per rank: {_gib(mem.total)} GiB of {_gib(hbm)} GiB "
              f"({'exact estimate' if mem.exact else 'scaled from the estimate of ' + _ref_label(ref)})",
              f"    params + AdamW states      {_gib(mem.persistent)} GiB",
              f"    activations kept           {_gib(mem.activations)} GiB",
              f"    peak phase                 {mem.peak_phase} ({_gib(mem.tensors)} GiB of tensors)",
              f"    GPU terms                  {_gib(mem.device_terms)} GiB (CUDA context, NCCL, EP imbalance, "
              "allocator margin)" if mem.device_terms else "    GPU terms                  none (CPU)"]
    lines += ["", "  run it: NGPU=%d ./run_train.sh --config <base> %s" % (plan.world, " ".join(plan.overrides()))]
    return "\n".join(lines)


def _overlap_label(c) -> str:
    """Where a collective's time goes (step_time.exposed_overlapped)."""
    if not c.overlapped:
        return "exposed"
    return "exposed, after the last microbatch" if c.phase == "end" else f"hidden behind the {c.phase}, up to it"


def _ref_label(est) -> str:
    L = est.layout
    return f"dp_shard {L.dp_shard} x tp {L.tp} x cp {L.cp} x pp {L.pp} (ep {L.ep}), {est.tokens_per_microbatch} tokens"


def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k} = {_toml_value(x)}" for k, x in v.items()) + "}"
    raise TypeError(f"cannot write {v!r} to TOML")


def write_config(path: str, plan: Plan, base_file: str | None, extra: dict[str, dict]) -> None:
    """The base config file with the plan's fields (and `extra`, e.g. seq_len) set."""
    table: dict = {}
    if base_file:
        with open(base_file, "rb") as f:
            table = tomllib.load(f)
    args = plan.overrides()
    for key, value in zip(args[::2], args[1::2]):
        section, name = key[2:].split(".", 1)
        table.setdefault(section, {})[name] = _parse(value)
    for section, values in extra.items():
        table.setdefault(section, {}).update(values)
    out = [f"# written by scripts/plan.py: NGPU={plan.world} ./run_train.sh --config {Path(path).name}"]
    for section, values in table.items():
        out.append(f"\n[{section}]")
        out += [f"{k} = {_toml_value(v)}" for k, v in values.items() if v is not None]
    Path(path).write_text("\n".join(out) + "\n")


def _parse(value: str):
    if value in ("true", "false"):
        return value == "true"
    for cast in (int, float):
        try:
            return cast(value)
        except ValueError:
            pass
    return value
