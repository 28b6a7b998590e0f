"""The process's rank and the environment knobs the code reads.

Stdlib only, like `configuration.fields`, so that every package (trainer, parallelisms,
planner, scripts) may import it without pulling in torch or the training loop.
"""

from __future__ import annotations

def global_rank() -> int:
    """This process's global rank: the default process group's when one exists, else
    torchrun's RANK, else 0. (torch is not imported here: it is read only if loaded.)"""
    import os
    import sys

    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


# Every environment variable the code reads, with what it does. Config belongs in TOML;
# these are for diagnostics, launchers and tests. The README's config reference lists them
# (scripts/config_reference.py), and tests/test_layering.py checks that the code reads no other.
ENV_KNOBS: dict[str, str] = {
    "AC_TRACE": "1 logs each distinct op's activation-checkpointing verdict once (SAVE/RECOMPUTE/ALTERNATE), and "
                "the set mode=budget chose per kind of block (BUDGET), rank 0.",
    "TITAN_CHECK_WORLD_SIZE": "set by run_train.sh / the SLURM script for `trainer.launch --check-config` and "
                              "`--dry-run`: the layout is checked against this world size before torchrun starts "
                              "(a dry run without it uses the smallest world the config implies).",
    "TITAN_CHECKPOINT_CRASH_AT": "test hook: <point>[@<step>] SIGKILLs the process at that point of a checkpoint "
                                 "save (async_write, after_write, before_rename, after_aside) or at the end of a step (step_end).",
    "TITAN_CHECKPOINT_HOLD_AT": "test hook: <point>@<step>=<file> makes the saving process create <file> at that "
                                "point of a checkpoint save and wait there until the file is deleted (a save in "
                                "progress, for tests/test_fault_tolerance_recovery.py).",
    "TITAN_AGENT_PID": "set by trainer.launch for its workers: the agent's pid; a worker dies with it.",
    "TITAN_LAUNCH_AGENT": "set by trainer.launch for its workers: a worker's one-line error goes to the agent, "
                          "which prints it once, instead of to the worker's own stderr.",
    "TITAN_DATA_CACHE": "folder for tokenized-corpus caches (default ~/.cache/titanlite).",
    "TITAN_PREEMPT_MARKER": "test hook: rank 0 writes the preempted step to this file.",
    "TITAN_TEST_STOP_RANK": "test hook: <rank>@<step> makes that rank SIGSTOP itself at the start of that step "
                            "(a hang, trainer/fault_tolerance/hang.py).",
    "TITAN_TEST_FT_STATE": "test hook: each fault-tolerant rank saves its final parameters, optimizer state and "
                           "step to <value>-replica<id>-rank<r>.pt at the end of the run (tests/test_fault_tolerance.py).",
    "TITAN_TEST_SLOW_RANK": "test hook: <rank>:<seconds>[@<step>] makes that rank sleep that long in every step (from that "
                            "step on): a straggler.",
    "TITAN_TOKENIZE_KILL": "test hook: <point>[:<n>] SIGKILLs scripts/tokenize_data.py at the n-th pass of that "
                           "point (see trainer/data/pretokenize.py).",
    "TITAN_DRY_RUN_PLAN": "0 turns off the planner's lines in `--dry-run` (the predicted speed and memory of the "
                          "config's layout, and a faster layout that fits); the test suite sets it.",
    "TITAN_PLAN_GPU": "the GPU the dry run's planner lines predict for: a name from scripts/plan.py's table "
                      "(default h100-sxm) or a hardware TOML file.",
    "TITAN_PLANNER_CALIBRATION": "where `scripts/plan.py --calibrate` stores the measured cpu-gloo entry "
                                 "(default ~/.cache/titanlite/cpu-gloo.toml).",
    "NGPU / NPROC, LOG_RANK, CONFIG_FILE, TORCHRUN": "run_train.sh: processes, ranks shown, default config, launcher.",
}


def env_value(name: str, default: str = "") -> str:
    """The value of a documented knob (a KeyError for one missing from ENV_KNOBS)."""
    import os

    if name not in ENV_KNOBS:
        raise KeyError(f"{name} is not a documented environment knob (add it to ENV_KNOBS)")
    return os.environ.get(name, default)


def env_flag(name: str) -> bool:
    """A documented knob read as a boolean: unset, '', 0, false, no, off -> False."""
    return env_value(name, "0").strip().lower() not in ("", "0", "false", "no", "off")
