#!/usr/bin/env python
"""Per-rank training memory of a config, estimated without allocating anything: one rank of the
model is assembled by the trainer's own path (parallelisms/apply.py) on fake tensors under a
fake process group, and its blocks and head are run on fake tensors (trainer/memory/).

  python scripts/estimate_memory.py --config llama8b.toml
  python scripts/estimate_memory.py --config llama70b.toml --ngpu 64 --activation_checkpoint.mode op
  python scripts/estimate_memory.py --config llama8b.toml --table      # AC none/full/op x chunked CE off/on
  python scripts/estimate_memory.py --validate                         # estimate vs a real step on this CPU

Options (everything else is a trainer override, `--section.key value`):
  --ngpu N / --world-size N  ranks to lay the config out on (default: the smallest multiple of
                             --gpus-per-node that its parallel degrees fit)
  --gpus-per-node N          default 8
  --device cuda|cpu          where the run would happen (cpu: fp32 unless mixed_precision_on_cpu); default cuda
  --json                     print the estimate as JSON
  --table                    the AC mode x chunked CE table for the config
  --cp-table                 context parallel degree (1/2/4/8, as the world allows) x AC none/full/op
  --validate                 debug models on this CPU: Llama under each AC mode with chunked CE off and
                             on, 2-rank FSDP, TP 2 (Llama, DeepSeek, Qwen3 dense and MoE), EP 2
                             (DeepSeek, Qwen3 MoE), Qwen3 (tied) on one rank and CP 2; estimated saved
                             activation bytes and peak vs measured
  --quick                    with --validate: none/op only, one FSDP and one TP case
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from configuration.fields import ConfigError  # noqa: E402

_VALUE_FLAGS = {"--ngpu": "world", "--world-size": "world", "--world_size": "world", "--gpus-per-node": "gpn",
                "--gpus_per_node": "gpn", "--device": "device"}
_BOOL_FLAGS = {"--json": "json", "--table": "table", "--cp-table": "cp_table", "--validate": "validate",
               "--quick": "quick", "--help": "help", "-h": "help"}


def parse(argv: list[str]) -> tuple[dict, list[str]]:
    opts = {"world": None, "gpn": 8, "device": "cuda", "json": False, "table": False, "cp_table": False,
            "validate": False,
            "quick": False, "help": False}
    rest: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        key, _, inline = arg.partition("=")
        if key in _VALUE_FLAGS:
            if inline:
                value = inline
            else:
                if i + 1 >= len(argv):
                    raise ConfigError(f"config error: {key} needs a value")
                value = argv[i + 1]
                i += 1
            name = _VALUE_FLAGS[key]
            opts[name] = value if name == "device" else int(value)
        elif arg in _BOOL_FLAGS:
            opts[_BOOL_FLAGS[arg]] = True
        else:
            rest.append(arg)
        i += 1
    if opts["device"] not in ("cuda", "cpu"):
        raise ConfigError(f"config error: --device: {opts['device']!r} is not one of cuda, cpu")
    return opts, rest


def config_name(rest: list[str]) -> str:
    for i, a in enumerate(rest):
        if a in ("--config", "--job.config_file") and i + 1 < len(rest):
            return Path(rest[i + 1]).name
        if a.startswith(("--config=", "--job.config_file=")):
            return Path(a.split("=", 1)[1]).name
    return ""


def table(rest: list[str], opts: dict) -> str:
    from trainer.config import load_config
    from trainer.memory import GiB, estimate_memory

    rows = []
    first = None
    for mode in ("none", "full", "op"):
        for chunked in (False, True):
            cfg = load_config(rest + ["--activation_checkpoint.mode", mode, "--loss.chunked_ce", str(chunked).lower()])
            est = estimate_memory(cfg, opts["world"], device=opts["device"], gpus_per_node=opts["gpn"],
                                  config_name=config_name(rest))
            first = first or est
            rows.append((mode, chunked, est))
    L = first.layout
    out = [f"{first.model} ({first.config}), per rank: world {first.world_size} = dp_shard {L.dp_shard} x cp {L.cp} x tp {L.tp} x "
           f"pp {L.pp}, {first.tokens_per_microbatch} tokens per microbatch, compute {first.compute_dtype}, "
           f"ce_chunk_size {load_config(rest).loss.ce_chunk_size}; GiB",
           "",
           "| AC | chunked CE | params | grads | AdamW states | FSDP buffers | activations/block | activations "
           "(all blocks) | logits/loss peak | peak phase | total (peak) |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for mode, chunked, e in rows:
        per_block = ", ".join(f"{v / GiB:.3f}" for v in e.activations_per_block.values())
        phase = max(e.phases, key=e.phases.get)
        out.append(f"| {mode} | {'on' if chunked else 'off'} | {e.params / GiB:.2f} | {e.grads / GiB:.2f} | "
                   f"{e.optimizer / GiB:.2f} | {e.fsdp_buffers / GiB:.2f} | {per_block} | {e.activations / GiB:.2f} | "
                   f"{e.loss_peak / GiB:.2f} | {phase} | {e.total / GiB:.2f} |")
    return "\n".join(out)


def cp_table(rest: list[str], opts: dict) -> str:
    """Context parallel degree x AC mode for the config, on its world size (dp_shard takes the rest)."""
    from trainer.config import load_config
    from trainer.memory import GiB, estimate_memory

    out, head = [], None
    for cp in (1, 2, 4, 8):
        for mode in ("none", "full", "op"):
            try:
                cfg = load_config(rest + ["--parallelism.context_parallel_degree", str(cp),
                                          "--parallelism.data_parallel_shard_degree", "-1",
                                          "--activation_checkpoint.mode", mode])
                e = estimate_memory(cfg, opts["world"], device=opts["device"], gpus_per_node=opts["gpn"],
                                    config_name=config_name(rest))
            except ConfigError as err:
                out.append(f"| {cp} | {mode} | {err} |")
                continue
            if head is None:
                head = (f"{e.model} ({e.config}), per rank on {e.world_size} ranks, seq_len {cfg.training.seq_len}, "
                        f"{cfg.parallelism.context_parallel_method}, compute {e.compute_dtype}, chunked CE "
                        f"{'on' if e.chunked_ce else 'off'}; GiB")
            per_block = ", ".join(f"{v / GiB:.3f}" for v in e.activations_per_block.values())
            L = e.layout
            out.append(f"| {cp} | {mode} | {L.dp_shard} | {e.tokens_per_microbatch} | {per_block} | "
                       f"{e.activations / GiB:.2f} | {e.loss_peak / GiB:.2f} | {e.block_backward / GiB:.2f} | "
                       f"{(e.params + e.grads + e.optimizer) / GiB:.2f} | {max(e.phases, key=e.phases.get)} | "
                       f"{e.total / GiB:.2f} |")
    return "\n".join([head or "", "", "| cp | AC | dp_shard | tokens/rank | activations/block | activations (all "
                      "blocks) | logits/loss peak | block backward | params+grads+AdamW | peak phase | total (peak) |",
                      "|---|---|---|---|---|---|---|---|---|---|---|", *out])


def validate(quick: bool) -> str:
    from trainer.memory import ValidationCase, format_validation, validate_cases

    common = ["--data.type", "synthetic", "--metrics.enable_tensorboard", "false", "--loss.ce_chunk_size", "128"]
    base = ["--config", "llama_debug.toml", *common]
    deepseek = ["--config", "deepseek_debug.toml", *common]
    qwen3 = ["--config", "qwen3_debug.toml", *common]
    qwen3_moe = ["--config", "qwen3_moe_debug.toml", *common]
    tp2 = ["--parallelism.tensor_parallel_degree", "2"]
    modes = ("none", "op") if quick else ("none", "full", "selective", "op")
    cases = []
    for mode in modes:
        for chunked in (False, True):
            cases.append(ValidationCase(f"{mode}{'-chunked' if chunked else ''}",
                                        base + ["--activation_checkpoint.mode", mode, "--loss.chunked_ce",
                                                str(chunked).lower()]))
    fsdp = [("full", False), ("op", True)] if not quick else [("op", True)]
    for mode, chunked in fsdp:
        cases.append(ValidationCase(f"fsdp2-{mode}{'-chunked' if chunked else ''}",
                                    base + ["--activation_checkpoint.mode", mode, "--loss.chunked_ce",
                                            str(chunked).lower()], nproc=2))
    cases.append(ValidationCase("llama-tp2-op", base + tp2 + ["--activation_checkpoint.mode", "op"], nproc=2))
    if not quick:
        cases += [ValidationCase("deepseek-tp2", deepseek + tp2, nproc=2),
                  ValidationCase("deepseek-ep2", deepseek + ["--parallelism.expert_parallel_degree", "2"], nproc=2),
                  ValidationCase("qwen3-op", qwen3 + ["--activation_checkpoint.mode", "op"]),
                  ValidationCase("qwen3-tp2-op", qwen3 + tp2 + ["--activation_checkpoint.mode", "op"], nproc=2),
                  ValidationCase("qwen3-moe-tp2", qwen3_moe + tp2, nproc=2),
                  ValidationCase("qwen3-moe-ep2", qwen3_moe + ["--parallelism.expert_parallel_degree", "2"],
                                 nproc=2),
                  ValidationCase("llama-cp2", base + ["--parallelism.context_parallel_degree", "2"], nproc=2)]
    with tempfile.TemporaryDirectory() as d:
        rows = validate_cases(cases, d, timeout=600)
    bad = [r["case"] for r in rows if abs(r["saved_err"]) > 0.05 or abs(r["peak_err"]) > 0.15]
    text = ("debug models (seq 256 x local batch 4 = 1024 tokens, vocab 2048), fp32 on CPU, ce_chunk_size 128.\n"
            "saved = activation bytes kept for backward in one step (AC module's counter: saved-tensor hooks + SAC "
            "cache);\nstep peak = peak RSS growth of a step above params + optimizer states (VmHWM after "
            "clear_refs, fresh process, fixed glibc mmap threshold); total = params + optimizer states + step peak.\n\n"
            + format_validation(rows))
    text += "\n\n" + ("all within bounds (saved +-5%, step peak +-15%)" if not bad else f"OUT OF BOUNDS: {bad}")
    return text


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        opts, rest = parse(argv)
        if opts["help"]:
            print(__doc__)
            return 0
        if opts["validate"]:
            print(validate(opts["quick"]))
            return 0
        if not config_name(rest):
            raise ConfigError("config error: --config: pass a TOML config (e.g. --config llama8b.toml)")
        if opts["table"]:
            print(table(rest, opts))
            return 0
        if opts["cp_table"]:
            print(cp_table(rest, opts))
            return 0
        from trainer.config import load_config
        from trainer.memory import estimate_memory, format_estimate

        cfg = load_config(rest)
        est = estimate_memory(cfg, opts["world"], device=opts["device"], gpus_per_node=opts["gpn"],
                              config_name=config_name(rest))
        print(json.dumps(est.to_dict(), indent=1, default=str) if opts["json"] else format_estimate(est))
        return 0
    except ConfigError as e:
        print(str(e), file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
