"""Graceful preemption: SIGTERM / SIGUSR1 ask the run to stop after the current step.

The handler only sets a flag, so a second signal during the checkpoint save
changes nothing. Ranks may receive the signal at different times, so the flag is
agreed across ranks before anyone acts: it rides in the all-reduce that every step
runs anyway for its loss (`Trainer.reduce_loss_and_flags`, summed: > 0 iff some rank
was asked), next to the checkpointer's "my async write is still running" flag. No
collective and no host sync of its own.

Under `python -m trainer.launch` (the SLURM path) workers start with SIGUSR1 and
SIGTERM blocked, so that a signal arriving before this handler exists is held instead
of killing the process; installing the handler unblocks them, and a pending one is
delivered right then (and honoured after the first step). There, too, a worker dies with
its agent (`die_with_the_agent`).

At exit the stop signals are ignored (`ignore_stop_signals_at_exit`): Python's finalization
puts the default action back on every signal it handled, so a second SIGUSR1 arriving while a
preempted rank tears down (after its checkpoint and marker) killed it, and SLURM saw exit 138
instead of a clean stop to requeue.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import sys

from configuration.environment import env_value, global_rank

PREEMPT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
# A torchft replica group stopped by a stop signal exits with this code (EX_TEMPFAIL: "try again"),
# after the saving group's checkpoint, so that scripts/ft_trainer.slurm tells it from a group that
# finished: the script requeues the job when the whole job was told to stop, and restarts the group
# alone otherwise. Without fault tolerance a stopped run exits 0 and leaves TITAN_PREEMPT_MARKER,
# which scripts/multinode_trainer.slurm reads.
PREEMPTED_EXIT = 75


def die_with_the_agent() -> None:
    """Under trainer.launch: SIGKILL this worker when its agent dies. torchelastic starts
    workers in their own session, so a SIGKILLed agent (OOM killer, a test's timeout, srun
    giving up) used to leave them training, orphaned, holding the GPU."""
    agent = env_value("TITAN_AGENT_PID")
    if not agent or not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != int(agent):  # the agent died before prctl: nobody will send the signal
        os.kill(os.getpid(), signal.SIGKILL)


def _ignore_stop_signals() -> None:
    for sig in PREEMPT_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)  # finalization keeps SIG_IGN; it resets Python handlers to SIG_DFL


def ignore_stop_signals_at_exit() -> None:
    """Once the interpreter starts exiting, a stop signal has nothing left to stop."""
    atexit.unregister(_ignore_stop_signals)
    atexit.register(_ignore_stop_signals)


class PreemptionHandler:
    def __init__(self) -> None:
        self.signal_received: int | None = None
        self.stopped_at: int | None = None  # the step the run stopped after, on a stop signal
        for sig in PREEMPT_SIGNALS:
            signal.signal(sig, self._on_signal)
        ignore_stop_signals_at_exit()
        signal.pthread_sigmask(signal.SIG_UNBLOCK, set(PREEMPT_SIGNALS))
        die_with_the_agent()

    def _on_signal(self, signum, frame) -> None:
        if self.signal_received is None:
            self.signal_received = signum

    def requested(self) -> bool:
        """A stop was asked of this rank (tests replace this to stop at a given step)."""
        return self.signal_received is not None

    def mark_preempted(self, step: int) -> None:
        """Tells a launcher (e.g. the SLURM script) that the run stopped early and should be requeued."""
        self.stopped_at = step
        marker = env_value("TITAN_PREEMPT_MARKER")
        if marker and global_rank() == 0:
            tmp = marker + ".tmp"
            with open(tmp, "w") as f:
                json.dump({"step": step, "signal": self.signal_received}, f)
            os.replace(tmp, marker)
