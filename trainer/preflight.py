"""Checks that run before any worker starts: `python -m trainer.launch --check-config | --dry-run`.

    python -m trainer.launch --check-config [--shell] --config X.toml [--section.key value ...]
    python -m trainer.launch --dry-run --config X.toml [--section.key value ...]

Why here and not only in the workers: a bad value found by a worker costs a torchrun launch
(10-15 s, minutes under SLURM) and, without care, a launcher report around the one line
that matters. The checks are the same functions the workers run (config load, layout,
tokenizer, device, folders, initial weights), so each field is still validated in one
place; the workers repeat them because a SLURM job or a plain torchrun may not come here.

The world size to check the layout against: TITAN_CHECK_WORLD_SIZE when the launcher
knows it (run_train.sh passes NGPU/NPROC, the SLURM script nodes x processes); for a dry
run without one, the smallest world the config implies (every degree as given,
dp_shard = -1 as the fewest ranks expert parallelism can borrow). A dry run prints the
layout it checked, so `--dry-run` of a 512-GPU config works on a laptop.

`--shell` (for run_train.sh) prints `NPROC=<n>`, `HAS_CUDA=<0|1>` and `FT_LIGHTHOUSE=<min replicas, 0 = none>`
on stdout, so the
script needs no other Python start-up: NPROC defaults to the local GPU count, or 1.
"""

from __future__ import annotations

import sys

from configuration.fields import ConfigError
from trainer.layout import describe_layout, implied_world_size, layout_for


def check_runtime(cfg) -> None:
    """What a worker would find wrong before step 1, cheaply: device, tokenizer, token folders
    made with another tokenizer, writable output folders, initial weights."""
    from trainer import distributed as tdist
    from trainer.checkpoint_config import check_checkpoint_paths
    from trainer.config import DEFAULT_TOKENIZER
    from trainer.data.loader import check_token_folders
    from trainer.data.tokenizer import build_tokenizer
    from trainer.errors import check_writable_folder
    from trainer.model_args import check_tokenizer_fits, model_label, tokenizer_path

    tdist.pick_device(cfg.training.device)
    tok_path = tokenizer_path(cfg, DEFAULT_TOKENIZER)
    tokenizer = build_tokenizer(tok_path)
    check_tokenizer_fits(tokenizer, cfg.model_args, model_label(cfg))
    specs = cfg.data.source_specs() + (cfg.validation.specs(cfg.data) if cfg.validation.enable else [])
    check_token_folders(specs, tokenizer=tokenizer, tokenizer_path=tok_path)
    check_writable_folder(cfg.job.dump_folder, "job.dump_folder")
    check_checkpoint_paths(cfg.checkpoint, cfg.job.dump_folder)


def _world_from_env() -> int | None:
    from configuration.environment import env_value

    raw = env_value("TITAN_CHECK_WORLD_SIZE").strip()
    if not raw:
        return None
    if not raw.isdigit() or int(raw) < 1:
        raise ConfigError(f"config error: NGPU/NPROC: expected a positive integer number of processes, got {raw!r}")
    return int(raw)


def check_config(argv: list[str], shell: bool) -> int:
    import torch

    from trainer.config import load_config

    has_cuda = torch.cuda.is_available()
    world = _world_from_env()
    if shell and world is None:
        world = torch.cuda.device_count() if has_cuda else 1
    cfg = load_config(argv, world_size=world)
    if world is not None:
        layout_for(cfg, world)
    check_runtime(cfg)
    ft = cfg.fault_tolerance
    if ft.enable and ft.lighthouse:  # before any worker starts: one line naming the address, not a hang
        from trainer.fault_tolerance.lighthouse import check_reachable

        check_reachable(ft.lighthouse, ft.connect_timeout_seconds)
    if shell:
        # One group on this machine with no lighthouse given: run_train.sh starts one (its quorum size).
        ft = cfg.fault_tolerance
        start_lighthouse = ft.min_replicas if ft.enable and ft.lighthouse is None else 0
        print(f"NPROC={world}\nHAS_CUDA={int(has_cuda)}\nFT_LIGHTHOUSE={start_lighthouse}", flush=True)
    else:
        from trainer.model_args import model_label

        print(f"config ok: {cfg.job.config_file or '(defaults)'} model={model_label(cfg)} "
              f"steps={cfg.training.steps} dump_folder={cfg.job.dump_folder} "
              f"checkpoint={'on' if cfg.checkpoint.enable else 'off'}", flush=True)
    return 0


def dry_run(argv: list[str]) -> int:
    from trainer.config import load_config, print_model_summary

    cfg = load_config(argv + ["--job.dry_run", "true"])
    world = _world_from_env()
    source = "from NGPU/NPROC"
    if world is None:
        world, source = implied_world_size(cfg.parallelism), "implied by the config; NGPU=N checks another"
    dims = layout_for(cfg, world)
    print_model_summary(cfg)
    print(describe_layout(dims, source), flush=True)
    from planner.dry_run import dry_run_lines  # planner imports trainer: imported here, not at module load

    for line in dry_run_lines(argv, cfg, world):
        print(line, flush=True)
    return 0


def main(argv: list[str]) -> int:
    """`--check-config [--shell] ARGS` or `--dry-run ARGS`; a bad input is one line and exit 2."""
    from trainer.config import main_guard
    from trainer.errors import report_user_error, user_error_types

    mode, rest = argv[0], argv[1:]
    shell = bool(rest) and rest[0] == "--shell"
    rest = rest[1:] if shell else rest
    if any(a in ("-h", "--help") for a in rest):
        main_guard(rest)  # prints the field docs and exits 0
    try:
        return dry_run(rest) if mode == "--dry-run" else check_config(rest, shell)
    except user_error_types() as e:
        return report_user_error(str(e))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
