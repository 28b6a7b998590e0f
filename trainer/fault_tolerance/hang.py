"""Hangs: name the rank that stopped responding, in one line, and keep every rank's stack.

Why: a collective that times out tells the waiting rank only that it waited (gloo's
`RuntimeError: ... Timed out`), not for whom. So every rank publishes a heartbeat to the
job's TCP store (a thread, once a second): its pid, host, step and the phase of the step
its main thread is in (`HangWatch.phase`). A rank whose heartbeat went silent was stopped
as a whole process (SIGSTOP, a frozen node, a kernel holding the GIL); one still beating
but behind in steps or in another phase is stuck in its own work.

Detection happens after step 1 (start-up runs under comm.init_timeout_seconds), when a
phase has lasted the collective timeout (`trainer.distributed.current_collective_timeout`,
so a checkpoint save's longer bound counts), whichever comes first of: the watch thread
seeing it (a few seconds before the timeout, `watch_bound`, so that it also beats NCCL's
watchdog), or the collective raising its timeout in the main thread. The first rank to
detect it writes the one line

    hang: rank 1 (pid 1234 on node7) stopped responding at step 9 (no heartbeat for 15.2 s; last seen
    in data at step 9); rank 0 waited for it in all_reduce (token count); stacks in <dump>/hang

into the store (so every rank reports the same culprit), hands it to the launcher agent
(the user-error file of `trainer.errors`, printed once, unprefixed) and exits HANG_EXIT.

Stacks: each rank registers faulthandler on SIGUSR2 into <dump>/hang/rank-N.txt (removed
again when the run ends cleanly). A rank that sees the store's hang key dumps its own
stack; the stack of a rank on the same host that does not beat any more is taken by
sending it SIGUSR2 (and SIGCONT: a stopped process handles the pending signal first, in
faulthandler's C handler, which needs no GIL), before the agent kills it.
"""

from __future__ import annotations

import datetime
import faulthandler
import json
import logging
import os
import signal
import socket
import threading
import time
from pathlib import Path

logger = logging.getLogger("trainer")

HANG_EXIT = 3  # documented in docs/failure_handling.md; the launcher passes it on
BEAT_S = 1.0
STALE_S = 4.0  # a heartbeat older than this (4 missed beats) means the whole process stopped
# The watch names a hang this long before the collective's own timeout (at most 10% of it): on NCCL
# the watchdog tears the process down at the timeout (TORCH_NCCL_ASYNC_ERROR_HANDLING=1), with no
# one line, so the watch must come first. On gloo it only beats the main thread's exception.
LEAD_S = 5.0


def watch_bound(timeout_s: float) -> float:
    """Seconds a phase may last before the watch reports it: the collective timeout minus the lead."""
    return timeout_s - min(LEAD_S, 0.1 * timeout_s)
_PREFIX = "titan_hang/"


def _collective_failure(e: BaseException) -> bool:
    """A collective that gave up waiting (gloo's timeout, a distributed backend error)."""
    text = str(e).lower()
    return "timed out" in text or "timeout" in text or type(e).__name__ in ("DistBackendError", "DistError")


class HangWatch:
    """One per rank. The loop marks its phases (`with watch.phase("all_reduce"):`) and calls
    `arm()` after step 1; a collective's exception goes to `on_exception`."""

    def __init__(self, dump_folder: str | os.PathLike, rank: int, world_size: int, timeout_s):
        self.rank, self.world = rank, world_size
        self.folder = Path(dump_folder) / "hang"
        self.timeout_s = timeout_s  # a callable: the current collective timeout, in seconds
        self.pid, self.host = os.getpid(), socket.gethostname()
        self.step, self.phase_name, self.phase_t0 = 0, "start-up", time.time()
        self.armed = False
        self._lock = threading.Lock()
        self._reported = False
        self._stop = threading.Event()
        self._file = None
        self._store = None
        self._thread: threading.Thread | None = None

    # ---- the main thread's side ----
    def arm(self) -> None:
        """After step 1: open the stack file, connect to the store, start the heartbeat."""
        if self.armed or self.world <= 1:
            return
        self.folder.mkdir(parents=True, exist_ok=True)
        self._file = open(self.folder / f"rank-{self.rank}.txt", "w")
        faulthandler.register(signal.SIGUSR2, file=self._file, all_threads=True, chain=False)
        import torch.distributed as dist

        self._store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                                    timeout=datetime.timedelta(seconds=30), wait_for_workers=False)
        self._beat()
        self.armed = True
        self._thread = threading.Thread(target=self._run, name="titan-hang-watch", daemon=True)
        self._thread.start()

    def set_step(self, step: int) -> None:
        self.step = step

    def at(self, name: str) -> None:
        """The main thread enters `name` (a part of the loop outside any `phase` block)."""
        self._halt_if_reported()
        self.phase_name, self.phase_t0 = name, time.time()

    def _halt_if_reported(self) -> None:
        """The watch thread is reporting a hang and will end the process: the main thread goes no
        further. (Taking a stopped peer's stack resumes it, which can let the collective this rank
        waited in complete; it must not then train on while the report is written.)"""
        if self._reported and threading.current_thread() is threading.main_thread():
            while True:
                time.sleep(1)

    class _Phase:
        def __init__(self, watch: "HangWatch", name: str):
            self.watch, self.name = watch, name

        def __enter__(self):
            w = self.watch
            w._halt_if_reported()
            self.prev = (w.phase_name, w.phase_t0)
            w.phase_name, w.phase_t0 = self.name, time.time()

        def __exit__(self, exc_type, *exc):
            if exc_type is None:  # an exception keeps the phase it left, for the report
                w = self.watch
                w.phase_name, w.phase_t0 = self.prev[0], time.time()
            return False

    def phase(self, name: str) -> "HangWatch._Phase":
        return HangWatch._Phase(self, name)

    def on_exception(self, e: BaseException) -> None:
        """A collective raised in the main thread: if it timed out waiting, report the hang
        (never returns); anything else is not ours and the caller re-raises it."""
        if not self.armed:
            return
        declared = False
        try:
            declared = self._store.check([f"{_PREFIX}line"])  # a peer already named the hang
        except Exception:  # noqa: BLE001 - no store: judge by the exception alone
            pass
        if declared or _collective_failure(e):
            self._report(e)

    def close(self) -> None:
        """A clean end: stop the thread, drop the (empty) stack file."""
        if not self.armed:
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        faulthandler.unregister(signal.SIGUSR2)
        self._file.close()
        path = self.folder / f"rank-{self.rank}.txt"
        if path.exists() and path.stat().st_size == 0:
            path.unlink()
        try:
            self.folder.rmdir()  # only when empty (no other rank's stack left in it)
        except OSError:
            pass
        self.armed = False

    # ---- the watch thread ----
    def _beat(self) -> None:
        self._store.set(f"{_PREFIX}beat/{self.rank}", json.dumps(
            {"pid": self.pid, "host": self.host, "step": self.step, "phase": self.phase_name,
             "phase_t0": self.phase_t0, "t": time.time()}))

    def _run(self) -> None:
        while not self._stop.wait(BEAT_S):
            try:
                self._beat()
                if self._store.check([f"{_PREFIX}line"]):
                    self._report()
                elapsed = time.time() - self.phase_t0
                if elapsed >= watch_bound(self.timeout_s()):
                    self._report()
            except Exception:  # noqa: BLE001 - the store went away: the job is ending anyway
                if self._stop.is_set():
                    return
                time.sleep(BEAT_S)

    # ---- the report ----
    def _beats(self) -> dict[int, dict]:
        keys = [f"{_PREFIX}beat/{r}" for r in range(self.world)]
        out = {}
        for r, key in enumerate(keys):
            if self._store.check([key]):
                out[r] = json.loads(self._store.get(key))
        return out

    def culprit_line(self, beats: dict[int, dict], now: float) -> tuple[str, list[int]]:
        """The one line, and the ranks whose stacks need taking from outside (stopped ones)."""
        # Collectives run in lockstep: the step this rank waits in is the one the culprit did not finish.
        # (Its own heartbeat, once a second, may be a step or two older.)
        where = f"rank {self.rank} waited for it in {self.phase_name}"
        stale = sorted((now - b["t"], r) for r, b in beats.items() if now - b["t"] > STALE_S and r != self.rank)
        missing = [r for r in range(self.world) if r not in beats]
        if stale:
            age, r = stale[-1]
            b = beats[r]
            who = f"rank {r} (pid {b['pid']} on {b['host']}) stopped responding at step {self.step} " \
                  f"(no heartbeat for {age:.1f} s; last seen in {b['phase']} at step {b['step']})"
            others = [s for _, s in stale[:-1]]
            if others:
                who += f"; also silent: ranks {', '.join(map(str, others))}"
            return f"hang: {who}; {where}", [s for _, s in stale]
        if missing:
            return f"hang: ranks {', '.join(map(str, missing))} stopped responding at step {self.step} " \
                   f"(never sent a heartbeat); {where}", []
        # Every rank beats: the one behind (an earlier step, or another phase than most) is stuck in its own work.
        phases: dict[tuple, list[int]] = {}
        for r, b in beats.items():
            phases.setdefault((b["step"], b["phase"]), []).append(r)
        if len(phases) > 1:
            (step, ph), ranks = min(phases.items(), key=lambda kv: (kv[0][0], len(kv[1])))
            b = beats[ranks[0]]
            return (f"hang: rank {ranks[0]} (pid {b['pid']} on {b['host']}) stopped responding at step {step} in {ph} "
                    f"for {now - b['phase_t0']:.1f} s (its process is alive); {where}"), []
        return f"hang: every rank waits in {self.phase_name} at step {self.step} (no rank is behind: a collective " \
               "that not every rank issued?)", []

    def _report(self, error: BaseException | None = None) -> None:
        with self._lock:
            if self._reported:
                while True:  # the other thread is reporting and will exit the process
                    time.sleep(1)
            self._reported = True
        line, stopped = None, []
        try:
            now = time.time()
            beats = self._beats()
            mine, stopped = self.culprit_line(beats, now)
            mine += f"; stacks in {self.folder}"
            # The first rank to detect it names the culprit for everyone.
            line = self._store.compare_set(f"{_PREFIX}line", "", mine).decode()
            line = line or mine
            for r in stopped:
                b = beats[r]
                if b["host"] == self.host:
                    _signal_stack(b["pid"])
        except Exception as e:  # noqa: BLE001 - the store is gone: still name what we can
            line = line or f"hang: rank {self.rank} waited in {self.phase_name} at step {self.step} " \
                           f"(the job's store did not answer: {e})"
        if error is not None:  # the main thread's stack has unwound: keep where the collective gave up
            import traceback

            self._file.write("The collective that gave up (main thread):\n"
                             + "".join(traceback.format_exception(error)) + "\nNow:\n")
            self._file.flush()
        faulthandler.dump_traceback(file=self._file, all_threads=True)
        self._file.flush()
        from trainer.errors import report_hang

        # Under the launcher the agent prints the line once; without it, the first live rank does.
        report_hang(line, printer=self.rank == min((r for r in range(self.world) if r not in stopped), default=0))
        time.sleep(1.0)  # let a signalled peer write its stack before the agent kills it
        logging.shutdown()
        os._exit(HANG_EXIT)


def _signal_stack(pid: int) -> None:
    """Asks a same-host rank for its stack: SIGUSR2 first (held while stopped), then SIGCONT."""
    for sig in (signal.SIGUSR2, signal.SIGCONT):
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            return


def inject_test_faults(rank: int, step: int) -> None:
    """Test hooks (ENV_KNOBS): TITAN_TEST_STOP_RANK=<rank>@<step> SIGSTOPs that rank at the start
    of that step; TITAN_TEST_SLOW_RANK=<rank>:<seconds>[@<first step>] sleeps that long in that rank's
    every step (from that step on)."""
    from configuration.environment import env_value

    stop = env_value("TITAN_TEST_STOP_RANK")
    if stop and stop == f"{rank}@{step}":
        os.kill(os.getpid(), signal.SIGSTOP)
    slow = env_value("TITAN_TEST_SLOW_RANK")
    if slow and slow.split(":")[0] == str(rank):
        seconds, _, first = slow.split(":")[1].partition("@")
        if step >= int(first or 0):
            time.sleep(float(seconds))
