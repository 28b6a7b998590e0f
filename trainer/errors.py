"""How a worker process ends on a bad input, and how the launcher hears about it.

A user error (a bad config value, a missing file, an unreadable checkpoint, a full disk)
is one line that names the field or file and the fix, and exit code 2. A bug is a
traceback and exit code 1. Both rules must survive torchrun, whose stock report turns any
worker failure into a ChildFailedError traceback, and which shows only the ranks in
`--local-ranks-filter`.

So a worker started by `python -m trainer.launch` (which sets TITAN_LAUNCH_AGENT=1) does
not print its one line itself: it writes it into torchelastic's per-worker error file
(TORCHELASTIC_ERROR_FILE) and exits 2; the agent prints the first failing rank's line once,
unprefixed, whatever LOG_RANK shows, and exits 2. A crash is recorded in the same file with
its traceback, so the agent can show it even when that rank's output was filtered out.
Without the agent (plain torchrun, `python -m trainer.train`), rank 0 prints the line.
"""

from __future__ import annotations

import errno
import json
import os
import sys
import time
from typing import Callable

USER_ERROR_EXIT = 2
AGENT_ENV = "TITAN_LAUNCH_AGENT"
USER_ERROR_KEY = "titan_user_error"
HANG_KEY = "titan_hang"  # a rank that stopped responding (trainer/fault_tolerance/hang.py), exit code HANG_EXIT there


def user_error_types() -> tuple[type[BaseException], ...]:
    """Exceptions whose message is a one-line answer for the user, not a bug report."""
    from models.hf_config import HFConfigError
    from trainer.checkpoint_files import CheckpointError
    from configuration.fields import ConfigError
    from trainer.step_guard import TrainingDiverged

    return ConfigError, CheckpointError, HFConfigError, TrainingDiverged


def disk_error_message(e: OSError, what: str) -> str | None:
    """One line for the OS errors a user fixes (full disk, permissions, read-only file system),
    or None for anything else. `what` names the folder or file being written."""
    reasons = {errno.ENOSPC: "no space left on the device", errno.EDQUOT: "disk quota exceeded",
               errno.EACCES: "permission denied", errno.EPERM: "permission denied",
               errno.EROFS: "the file system is read-only"}
    reason = reasons.get(e.errno)
    if reason is None and "No space left" in str(e):
        reason = reasons[errno.ENOSPC]
    return f"{what}: {reason}; free space or point it at a writable folder" if reason else None


def _write_error_file(message: str, *, user_error: bool, callstack: str = "", hang: bool = False) -> None:
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    data = {"message": {"message": message, "extraInfo": {
        "py_callstack": callstack, "timestamp": str(int(time.time())), USER_ERROR_KEY: user_error,
        HANG_KEY: hang}}}
    try:
        with open(path, "w") as f:
            json.dump(data, f)
    except OSError:
        pass  # the error file is a courtesy; the exit code still says what happened


def report_user_error(message: str) -> int:
    """Prints (rank 0) or hands to the launcher agent the one-line `message`; returns the exit code."""
    from configuration.environment import env_flag, global_rank

    message = " ".join(str(message).split("\n"))
    if env_flag(AGENT_ENV) and os.environ.get("TORCHELASTIC_ERROR_FILE"):
        _write_error_file(message, user_error=True)
    elif global_rank() == 0:
        print(message, file=sys.stderr, flush=True)
    return USER_ERROR_EXIT


def report_hang(line: str, *, printer: bool) -> None:
    """A hang's one line (trainer/fault_tolerance/hang.py): to the launcher agent, or printed by `printer`."""
    from configuration.environment import env_flag

    if env_flag(AGENT_ENV) and os.environ.get("TORCHELASTIC_ERROR_FILE"):
        _write_error_file(line, user_error=False, hang=True)
    elif printer:
        print(line, file=sys.stderr, flush=True)


def run_entry_point(main: Callable[[], int]) -> int:
    """Runs a worker's main(): user errors become one line and exit 2; a crash keeps its
    traceback (printed here as usual) and is also recorded for the launcher agent."""
    try:
        return main()
    except Exception as e:  # noqa: BLE001 - sorted into user errors and bugs below
        line = str(e) if isinstance(e, user_error_types()) else None
        if line is None and isinstance(e, OSError):
            line = disk_error_message(e, f"error: {e.filename}" if e.filename else "error: writing output")
        if line is not None:
            return report_user_error(line)
        import traceback

        _write_error_file(f"{type(e).__name__}: {e}", user_error=False, callstack=traceback.format_exc())
        raise


def check_writable_folder(folder: str | os.PathLike, key: str) -> None:
    """Creates `folder` if needed and writes a probe file into it, so that a read-only or full
    output folder fails before step 1 (as a ConfigError naming `key`), not at the first save."""
    from configuration.fields import ConfigError

    probe = os.path.join(folder, f".titan_write_probe.{os.getpid()}")
    try:
        os.makedirs(folder, exist_ok=True)
        with open(probe, "wb") as f:
            f.write(b"0" * 4096)
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        reason = disk_error_message(e, f"config error: {key}: {folder} is not writable")
        raise ConfigError(reason or f"config error: {key}: {folder} is not writable ({e.strerror or e}); "
                          "point it at a writable folder") from None
    finally:
        try:
            os.remove(probe)
        except OSError:
            pass
