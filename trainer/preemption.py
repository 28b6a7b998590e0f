"""Graceful preemption: SIGTERM / SIGUSR1 ask the run to stop after the current step.

The handler only sets a flag, so a second signal during the checkpoint save
changes nothing. Ranks may receive the signal at different times, so
`should_stop` agrees across ranks with a MAX all-reduce before anyone acts.

Under `python -m trainer.launch` (the SLURM path) workers start with SIGUSR1
blocked, so that a signal arriving before this handler exists is held instead
of killing the process; installing the handler unblocks it, and a pending one
is delivered right then.
"""

from __future__ import annotations

import json
import os
import signal

import torch
import torch.distributed as dist

PREEMPT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class PreemptionHandler:
    def __init__(self) -> None:
        self.signal_received: int | None = None
        for sig in PREEMPT_SIGNALS:
            signal.signal(sig, self._on_signal)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, set(PREEMPT_SIGNALS))

    def _on_signal(self, signum, frame) -> None:
        if self.signal_received is None:
            self.signal_received = signum

    def should_stop(self, device: torch.device) -> bool:
        flag = torch.tensor([1.0 if self.signal_received is not None else 0.0], device=device)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item() > 0)

    def mark_preempted(self, step: int) -> None:
        """Tells a launcher (e.g. the SLURM script) that the run stopped early and should be requeued."""
        marker = os.environ.get("TITAN_PREEMPT_MARKER")
        if marker and int(os.environ.get("RANK", "0")) == 0:
            tmp = marker + ".tmp"
            with open(tmp, "w") as f:
                json.dump({"step": step, "signal": self.signal_received}, f)
            os.replace(tmp, marker)
