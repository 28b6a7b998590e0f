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

Workers are started with SIGUSR1 blocked; `PreemptionHandler` unblocks it once its
handler is installed, so a SIGUSR1 that lands while a worker is still importing torch
is held, not fatal. The agent also blocks SIGUSR1 while it spawns the workers and
delivers a pending one right after.

`--check-config` loads and validates the trainer config exactly as `trainer.train`
does, without torch.distributed: on error it prints the one-line `config error: ...`
to stderr and exits 2. The SLURM script runs it once before `srun`, so a typo fails
the job in seconds instead of after a rendezvous timeout.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from pathlib import Path

FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
_received: list[int] = []


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
    for sig in FORWARDED_SIGNALS:
        signal.signal(sig, _forward)

    # torchelastic installs its own SIGTERM handler (shut the workers down, exit non-zero) when it
    # starts the workers (`--signals-to-handle`); put ours back right after. Workers are spawned
    # with SIGUSR1 blocked (the mask is inherited across fork/exec); the worker's PreemptionHandler
    # unblocks it once installed. The agent's own pending SIGUSR1, if any, is delivered on unblock.
    from torch.distributed.elastic.multiprocessing import api

    original_start = api.PContext.start
    if getattr(original_start, "_titan_wrapped", False):
        return

    def start(self, *args, **kwargs):
        old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
        try:
            return original_start(self, *args, **kwargs)
        finally:
            if threading.current_thread() is threading.main_thread():
                for sig in FORWARDED_SIGNALS:
                    signal.signal(sig, _forward)
            signal.pthread_sigmask(signal.SIG_SETMASK, old)

    start._titan_wrapped = True  # type: ignore[attr-defined]
    api.PContext.start = start


def check_config(argv: list[str]) -> int:
    from trainer.config import main_guard
    from trainer.configurable import env_value
    from trainer.model_args import model_label

    # The launcher knows the world size: the layout is checked against it too (same code as the workers).
    world = int(env_value("TITAN_CHECK_WORLD_SIZE", "0")) or None
    cfg = main_guard(argv, world_size=world)  # prints `config error: ...` and exits 2 on a bad config
    print(f"config ok: {cfg.job.config_file or '(defaults)'} model={model_label(cfg)} "
          f"steps={cfg.training.steps} dump_folder={cfg.job.dump_folder} "
          f"checkpoint={'on' if cfg.checkpoint.enable else 'off'}", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "--check-config":
        return check_config(argv[1:])
    _install_agent_handlers()
    from torch.distributed.run import main as torchrun_main

    torchrun_main(argv)  # raises ChildFailedError (exit 1) when a worker fails
    return 0


if __name__ == "__main__":
    sys.exit(main())
