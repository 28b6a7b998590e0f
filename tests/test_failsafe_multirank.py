"""Two gloo ranks: collective timeouts (train bound on every group, a longer one around saves)
and the step-boundary agreement that commits async saves. One torchrun launch for both."""

from __future__ import annotations

import json
import os
import sys

import pytest

from tests.helpers import REPO, free_port, run_killing_group


@pytest.fixture(scope="module")
def observed(tmp_path_factory):
    out = tmp_path_factory.mktemp("failsafe")
    cases = out / "cases.json"
    cases.write_text(json.dumps([{"name": "timeouts"}, {"name": "async_commit"}]))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "tests/failsafe_worker.py",
           str(cases), str(out)]
    proc = run_killing_group(cmd, cwd=REPO, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return {p.stem: json.loads(p.read_text()) for p in out.glob("*.rank*.json")}


@pytest.mark.multirank
def test_train_timeout_applies_on_gloo_and_saves_run_outside_it(observed):
    """Before: set_collective_timeout was NCCL-only, so on gloo a late rank was waited for
    until the start-up bound (300 s by default)."""
    seen = observed["timeouts.rank0"]
    assert seen["inside_save"][0] == "ok" and seen["inside_save"][1] >= 2.5  # waited the 3 s out
    assert seen["timeout_after_save"] == 1  # the train bound is back after the save
    assert seen["after_save"][0] == "RuntimeError" and seen["after_save"][1] < 2.5  # found after ~1 s


@pytest.mark.multirank
def test_async_save_commits_when_every_rank_has_written(observed):
    for rank in (0, 1):
        seen = observed[f"async_commit.rank{rank}"]
        assert seen["after_one_busy_rank"] == []  # rank 1 still writing: nobody commits
        assert seen["after_all_done"] == [2]  # committed at the next boundary, no further save needed
        assert seen["pending_left"] is False
        assert seen["stop_before_signal"] is False and seen["stop_after_signal"] is True  # rank 1's signal
        assert seen["later_save_left_pending"] is True
