"""trainer.distributed.exit_process: how every process that ran gloo collectives ends.

A gloo thread frees each finished collective's Work after the caller has resumed, and freeing it
can take the GIL. If that thread is queued on the GIL when the interpreter starts finalizing,
Python 3.11 kills it with pthread_exit, which aborts the process: a finished run reported as a
SIGABRT crash (CI saw it in test_ac_multirank and test_flops). tests/exit_race_worker.py puts
the thread in that spot deterministically."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from tests.helpers import REPO, free_port

ENV = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}


def _race(mode: str) -> tuple[int, str]:
    port = str(free_port())
    ranks = [subprocess.Popen([sys.executable, "-m", "tests.exit_race_worker", str(rank), port, mode], cwd=REPO,
                              env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              start_new_session=True) for rank in (0, 1)]
    try:
        outs = [rank.communicate(timeout=120)[0] for rank in ranks]
    finally:
        for rank in ranks:
            if rank.poll() is None:
                os.killpg(rank.pid, signal.SIGKILL)
    assert ranks[1].returncode == 0, outs[1][-2000:]
    return ranks[0].returncode, outs[0]


@pytest.mark.timeout(300)
def test_a_gloo_thread_waiting_for_the_gil_at_exit_aborts_finalization_but_not_exit_process():
    code, out = _race("sys_exit")
    assert code == -signal.SIGABRT and "terminate called without an active exception" in out, (code, out[-2000:])
    code, out = _race("exit_process")
    assert code == 0, out[-2000:]


EXITS = """
import atexit, concurrent.futures, sys, threading, time
from trainer.distributed import exit_process

idle_pool = concurrent.futures.ThreadPoolExecutor(1)  # its idle worker must not block the exit
idle_pool.submit(lambda: None).result()

atexit.register(lambda: print("atexit ran", flush=False))
def late_writer():
    time.sleep(0.5)
    sys.stdout.write("thread finished")
threading.Thread(target=late_writer).start()
sys.stdout.write("unflushed; ")
exit_process(int(sys.argv[1]))
"""


@pytest.mark.parametrize("code", [0, 3])
def test_exit_process_joins_threads_stops_pools_runs_atexit_flushes_and_keeps_the_code(code):
    proc = subprocess.run([sys.executable, "-c", EXITS, str(code)], cwd=REPO, env=ENV, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == code, proc.stderr
    assert proc.stdout.splitlines() == ["unflushed; thread finishedatexit ran"], proc.stdout
