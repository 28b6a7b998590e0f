"""torchrun, with an agent that survives preemption signals and passes them on.

    python -m trainer.launch [torchrun options] -m trainer.train --config X.toml [--section.key value ...]
    python -m trainer.launch --check-config --config X.toml [--section.key value ...]

Why not plain torchrun: under SLURM, `scancel --signal=USR1 JOB` (or `#SBATCH
--signal=USR1@T`) signals every process of the job step, the torchrun agent included.
SIGUSR1's default action kills the agent; srun then sees its task gone and slurmstepd
kills the workers, possibly in the middle of the checkpoint they were asked to write.
On SIGTERM the stock agent shuts the workers down itself (SIGTERM, then SIGKILL 30 s
later) and exits non-zero even when the workers stop cleanly.

Here the agent catches SIGUSR1 and SIGTERM, forwards them to its worker processes (its
direct children, found through /proc) and keeps monitoring them as usual, so it exits
with the workers' status: 0 after a clean preemption checkpoint. The workers'
`trainer.preemption.PreemptionHandler` turns the signal into "save at the end of this
step and exit". A second signal is forwarded too and changes nothing (the handler is a
flag). A SIGTERM that arrives while there are no workers (rendezvous, shutdown)
terminates the agent as before.

Workers are started with SIGUSR1 and SIGTERM blocked; `PreemptionHandler` unblocks them
once its handler is installed, so a signal that lands while a worker is still importing
torch is held and then honoured (save after the step, exit), not fatal. The agent also
blocks both while it spawns the workers and delivers a pending one right after. When the
agent itself stops the workers (one of them failed), it uses SIGKILL: the survivors have
nothing left to save, and with SIGTERM held they would only wait on their dead peer.

A hang: a worker that found a peer stopped responding (trainer/fault_tolerance/hang.py) exits 3 with its
one line in the same error file; the agent prints that line once and exits 3 (HANG_EXIT).

A torchft replica group stopped by a stop signal exits 75 (`trainer.preemption.PREEMPTED_EXIT`,
after the saving group's checkpoint); the agent says so in one line and exits 75.

Failures: a worker that exits 2 has met a user error and recorded its one line
(`trainer.errors`); the agent prints that line once, unprefixed, and exits 2, instead of
torchrun's ChildFailedError report. A crash (any other exit code, or a signal) gets a
short summary naming the rank, plus the worker's traceback when that rank's output was
not shown (`--local-ranks-filter`), and the worker's exit code.

`--check-config` and `--dry-run` (trainer/preflight.py) check a config before any worker
starts.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from pathlib import Path

from trainer.errors import AGENT_ENV, HANG_KEY, USER_ERROR_EXIT, USER_ERROR_KEY
from trainer.preemption import PREEMPTED_EXIT

HANG_EXIT = 3  # trainer.fault_tolerance.hang.HANG_EXIT (not imported: that module imports torch-side code lazily only)

FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
_received: list[int] = []
SPAWN_BLOCKED = set(FORWARDED_SIGNALS)


def child_pids(parent: int | None = None) -> list[int]:
    """Direct children of `parent` (default: this process), from /proc/<pid>/stat."""
    parent = os.getpid() if parent is None else parent
    out = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text()
        except OSError:
            continue
        # pid (comm) state ppid ...; comm may contain spaces and parentheses
        fields = stat.rsplit(")", 1)[1].split()
        if len(fields) >= 2 and int(fields[1]) == parent and fields[0] != "Z":
            out.append(int(entry.name))
    return out


def _log(msg: str) -> None:
    print(f"[trainer.launch pid {os.getpid()}] {msg}", file=sys.stderr, flush=True)


def _forward(signum: int, frame) -> None:
    _received.append(signum)
    name = signal.Signals(signum).name
    children = child_pids()
    if not children and signum == signal.SIGTERM:
        _log(f"{name} with no workers running: exiting")
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        return
    _log(f"{name}: forwarding to workers {children}; waiting for them to save and exit")
    for pid in children:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass


def _install_agent_handlers() -> None:
    from trainer.preemption import ignore_stop_signals_at_exit

    for sig in FORWARDED_SIGNALS:
        signal.signal(sig, _forward)
    ignore_stop_signals_at_exit()  # a late second signal must not kill the agent as it exits

    # torchelastic installs its own SIGTERM handler (shut the workers down, exit non-zero) when it
    # starts the workers (`--signals-to-handle`); put ours back right after. Workers are spawned
    # with SIGUSR1 and SIGTERM blocked (the mask is inherited across fork/exec); the worker's
    # PreemptionHandler unblocks them once installed. The agent's own pending signal, if any, is
    # delivered on unblock and forwarded to the new workers, which hold it until then.
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    from torch.distributed.elastic.multiprocessing import api

    original_start = api.PContext.start
    if getattr(original_start, "_titan_wrapped", False):
        return

    def stop_workers(self, worker_group) -> None:  # a worker failed (or a restart): no survivor saves
        self._shutdown(signal.SIGKILL)

    LocalElasticAgent._stop_workers = stop_workers

    # The mask covers only this thread: a signal the kernel hands to another of the agent's
    # threads still runs torchelastic's handler (installed inside start) in the main thread.
    # While spawning, that handler holds our signals too; they are forwarded right after.
    original_terminate = api._terminate_process_handler
    held: list[int] = []
    spawning = [False]

    def terminate_or_hold(signum: int, frame) -> None:
        if spawning[0] and signum in SPAWN_BLOCKED:
            held.append(signum)
            return
        original_terminate(signum, frame)

    api._terminate_process_handler = terminate_or_hold

    def start(self, *args, **kwargs):
        old = signal.pthread_sigmask(signal.SIG_BLOCK, SPAWN_BLOCKED)
        spawning[0] = True
        try:
            return original_start(self, *args, **kwargs)
        finally:
            if threading.current_thread() is threading.main_thread():
                for sig in FORWARDED_SIGNALS:
                    signal.signal(sig, _forward)
            spawning[0] = False
            signal.pthread_sigmask(signal.SIG_SETMASK, old)
            while held:
                _forward(held.pop(0), None)

    start._titan_wrapped = True  # type: ignore[attr-defined]
    api.PContext.start = start


class _QuietUserErrors(logging.Filter):
    """Drops the agent's log lines about a worker that exited with a user error (its one line
    says everything) and about the survivors it then stops."""

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        return not (f"exitcode: {USER_ERROR_EXIT})" in msg or f"exitcode: {HANG_EXIT})" in msg
                    or f"exitcode: {PREEMPTED_EXIT})" in msg or "closing signal" in msg)


def _shown_local_ranks(argv: list[str]) -> set[int] | None:
    for i, arg in enumerate(argv):
        for flag in ("--local-ranks-filter", "--local_ranks_filter"):
            if arg == flag and i + 1 < len(argv):
                value = argv[i + 1]
            elif arg.startswith(flag + "="):
                value = arg.split("=", 1)[1]
            else:
                continue
            try:
                return {int(r) for r in value.split(",")}
            except ValueError:
                return None
    return None


def _error_info(failure) -> dict:
    """What the worker recorded through trainer.errors (message, py_callstack), or {}."""
    message = failure.error_file_data.get("message") if isinstance(failure.error_file_data, dict) else None
    if isinstance(message, dict) and USER_ERROR_KEY in message.get("extraInfo", {}):
        return {"message": message.get("message", ""), **message["extraInfo"]}
    return {}


def report_failure(err, argv: list[str]) -> int:
    """One user-facing report for a failed worker group; returns the exit code to use."""
    failures = sorted(err.failures.items(), key=lambda kv: (kv[1].timestamp, kv[0]))
    hung = [(r, f) for r, f in failures if f.exitcode == HANG_EXIT and _error_info(f).get(HANG_KEY)]
    if hung:  # one line naming the rank that stopped responding (trainer/fault_tolerance/hang.py); stacks are on disk
        print(_error_info(hung[0][1])["message"], file=sys.stderr, flush=True)
        return HANG_EXIT
    user = [(r, f) for r, f in failures if f.exitcode == USER_ERROR_EXIT]
    if user:
        rank, failure = user[0]
        line = _error_info(failure).get("message")
        if line:  # else the worker printed it itself (an error before it knew about the agent)
            print(line, file=sys.stderr, flush=True)
        return USER_ERROR_EXIT
    rank, failure = failures[0]
    if failure.exitcode == PREEMPTED_EXIT:  # a replica group stopped on a signal, its state saved: not a crash
        _log(f"the workers stopped on a stop signal (exit {PREEMPTED_EXIT}: run again to resume)")
        return PREEMPTED_EXIT
    info = _error_info(failure)
    if failure.exitcode < 0:
        _log(f"rank {rank} was killed by {failure.signal_name()} (out of memory, or killed from outside)")
        return 128 - failure.exitcode
    shown = _shown_local_ranks(argv)
    if info.get("py_callstack") and shown is not None and failure.local_rank not in shown:
        print(info["py_callstack"], file=sys.stderr, end="", flush=True)
    _log(f"rank {rank} crashed with exit code {failure.exitcode}: {info.get('message') or 'see its output above'}")
    return failure.exitcode or 1


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("--check-config", "--dry-run"):
        from trainer.preflight import main as preflight_main

        return preflight_main(argv)
    _install_agent_handlers()
    os.environ[AGENT_ENV] = "1"  # workers hand their one-line errors to report_failure
    os.environ["TITAN_AGENT_PID"] = str(os.getpid())  # and die with this process (preemption.die_with_the_agent)
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    quiet = _QuietUserErrors()
    for name in ("torch.distributed.elastic.multiprocessing.api", "torch.distributed.elastic.agent.server.api"):
        logging.getLogger(name).addFilter(quiet)
    try:
        run(parse_args(argv))  # torchrun's main without its @record report
    except ChildFailedError as e:
        return report_failure(e, argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
