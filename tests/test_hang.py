"""Hangs and stragglers (trainer/fault_tolerance/hang.py, trainer/metrics.py's StragglerMonitor), through
./run_train.sh with 2 real gloo ranks on the tiny model.

Before: one of 2 ranks stopped with SIGSTOP gave, after the collective timeout, a gloo
RuntimeError traceback naming no rank, a launcher that took 47 s to exit, and exit code 1."""

from __future__ import annotations

import os
import re
import subprocess
import threading
import time

import pytest

from tests.helpers import REPO, TINY, read_metrics
from trainer.fault_tolerance.hang import HANG_EXIT, HangWatch
from trainer.metrics import MetricsConfig, StragglerMonitor

TIMEOUT_S = 10  # comm.train_timeout_seconds in the hang run


def _run_train(tmp_path, args: list[str], env: dict, timeout: int):
    """./run_train.sh with 2 ranks; returns (returncode, stdout+stderr lines with arrival times)."""
    full_env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "NGPU": "2", "LOG_RANK": "0",
                **env}
    proc = subprocess.Popen(["./run_train.sh", *TINY, "--job.dump_folder", str(tmp_path), *args], cwd=REPO,
                            env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    lines: list[tuple[float, str]] = []
    reader = threading.Thread(target=lambda: lines.extend((time.time(), ln) for ln in proc.stdout), daemon=True)
    reader.start()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        proc.wait()
        reader.join(5)
        raise AssertionError("timed out:\n" + "".join(ln for _, ln in lines)[-4000:])
    reader.join(10)
    return proc.returncode, lines, time.time()


@pytest.fixture(scope="module")
def hang_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hang")
    # One run for both (CI time): rank 1 is slow from the start (a straggler), then stops at step 7 (a hang).
    rc, lines, t_exit = _run_train(tmp, ["--training.steps", "40", "--comm.train_timeout_seconds", str(TIMEOUT_S),
                                         "--metrics.straggler_log_steps", "3"],
                                   {"TITAN_TEST_STOP_RANK": "1@7", "TITAN_TEST_SLOW_RANK": "1:0.3"}, timeout=400)
    return tmp, rc, lines, t_exit


@pytest.mark.timeout(600)
def test_a_stopped_rank_is_named_in_one_line(hang_run):
    tmp, rc, lines, t_exit = hang_run
    out = "".join(ln for _, ln in lines)
    assert rc == HANG_EXIT, out
    assert "Traceback" not in out and "ChildFailedError" not in out, out
    hang = [ln for _, ln in lines if ln.startswith("hang:")]
    assert len(hang) == 1, out
    assert re.match(rf"hang: rank 1 \(pid \d+ on \S+\) stopped responding at step 7 \(no heartbeat for "
                    rf"[\d.]+ s; last seen in .* at step [1-7]\); rank 0 waited for it in all_reduce \(token count\); "
                    rf"stacks in {re.escape(str(tmp))}/hang$", hang[0].strip()), hang[0]
    # Rank 1 stops at the start of step 7, right after rank 0 logged step 6.
    t_stop = next(t for t, ln in lines if re.search(r"step +6 \|", ln))
    assert t_exit - t_stop < TIMEOUT_S + 10, (t_exit - t_stop, out)


@pytest.mark.timeout(600)
def test_every_rank_leaves_its_stack(hang_run):
    tmp, rc, lines, _ = hang_run
    for rank in (0, 1):
        stack = (tmp / "hang" / f"rank-{rank}.txt").read_text()
        assert "File " in stack and "trainer/train.py" in stack, (rank, stack)
    # The stopped rank's stack shows where it stopped (the test hook's SIGSTOP), the waiting one its all-reduce.
    assert "inject_test_faults" in (tmp / "hang" / "rank-1.txt").read_text()
    assert "count_global_tokens" in (tmp / "hang" / "rank-0.txt").read_text()


@pytest.mark.timeout(600)
def test_a_straggler_is_named(hang_run):
    tmp, rc, lines, _ = hang_run
    out = "".join(ln for _, ln in lines)
    warnings = [ln for _, ln in lines if "straggler:" in ln]
    assert len(warnings) == 1 and "straggler: rank 1 took" in warnings[0] and "up to step 5" in warnings[0], out
    records = read_metrics(tmp)
    # Steps 1 and 2 have no figures: step 1 (the warm-up) is not counted, and step 2's all-reduce runs before it ends.
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6], records
    assert all("straggler/slowest_rank" not in rec for rec in records[:2]), records
    for rec in records[2:]:
        assert rec["straggler/slowest_rank"] == 1.0, rec
        assert rec["straggler/slowest_step_s"] >= 0.3 and rec["straggler/lag_s"] > 0.2, rec


def test_straggler_monitor_needs_several_slow_log_steps_in_a_row(caplog):
    mon = StragglerMonitor(MetricsConfig(straggler_factor=2.0, straggler_log_steps=2), rank=0, world_size=4, log=True)
    with caplog.at_level("WARNING", logger="trainer"):
        rec = mon.observe([0.1, 0.1, 0.5, 0.1], step=10)
        assert rec == {"straggler/slowest_rank": 2.0, "straggler/slowest_step_s": 0.5,
                       "straggler/median_step_s": 0.1, "straggler/lag_s": 0.4}
        mon.observe([0.1, 0.1, 0.1, 0.1], step=20)  # the streak breaks
        mon.observe([0.1, 0.1, 0.5, 0.1], step=30)
        assert not caplog.records
        mon.observe([0.1, 0.1, 0.5, 0.19], step=40)  # 0.19 is within 2x the (low) median 0.1
        assert [r.getMessage() for r in caplog.records] == [
            "straggler: rank 2 took 0.500 s per step against the median 0.100 s (5.0x > metrics.straggler_factor 2) "
            "for 2 log steps in a row, up to step 40"]


def test_culprit_is_the_silent_rank_else_the_one_behind():
    watch = HangWatch("/nonexistent", rank=0, world_size=3, timeout_s=lambda: 10)
    watch.step, watch.phase_name = 7, "all_reduce (loss)"
    now = 1000.0
    beat = {"host": "n1", "step": 7, "phase": "all_reduce (loss)", "phase_t0": now - 10, "t": now - 0.5}
    line, stopped = watch.culprit_line({0: {**beat, "pid": 10}, 1: {**beat, "pid": 11, "t": now - 12.0},
                                        2: {**beat, "pid": 12}}, now)
    assert stopped == [1]
    assert line == ("hang: rank 1 (pid 11 on n1) stopped responding at step 7 (no heartbeat for 12.0 s; last seen "
                    "in all_reduce (loss) at step 7); rank 0 waited for it in all_reduce (loss)")
    line, stopped = watch.culprit_line({0: {**beat, "pid": 10}, 1: {**beat, "pid": 11},
                                        2: {**beat, "pid": 12, "step": 6, "phase": "forward/backward"}}, now)
    assert stopped == [] and line.startswith("hang: rank 2 (pid 12 on n1) stopped responding at step 6 in "
                                             "forward/backward for 10.0 s (its process is alive)"), line


@pytest.mark.timeout(60)
def test_the_watch_names_a_hang_before_the_collective_times_out():
    """The watch reports a phase `watch_bound` seconds old, a lead before the collective's own timeout:
    on NCCL the watchdog ends the process at the timeout with no line (TORCH_NCCL_ASYNC_ERROR_HANDLING=1,
    scripts/ft_trainer.slurm), so the one-line report must come first. A phase 8.5 s into a 10 s
    timeout is reported at the watch's next beat (9.5 s), not at 10.5 s."""
    from trainer.fault_tolerance.hang import watch_bound

    assert (watch_bound(600), watch_bound(10)) == (595, 9)  # 5 s lead, at most 10% of the timeout

    class Store:
        def set(self, *_):
            pass

        def check(self, _):
            return False

    watch = HangWatch("/nonexistent", rank=0, world_size=2, timeout_s=lambda: TIMEOUT_S)
    watch._store = Store()
    reported: list[float] = []
    watch._report = lambda error=None: (reported.append(time.time() - watch.phase_t0), watch._stop.set())
    watch.phase_t0 = time.time() - (TIMEOUT_S - 1.5)
    thread = threading.Thread(target=watch._run, daemon=True)
    thread.start()
    thread.join(30)
    assert reported and watch_bound(TIMEOUT_S) <= reported[0] < TIMEOUT_S, reported
