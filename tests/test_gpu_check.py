"""scripts/gpu_check.sh works before any GPU exists: `--dry` runs the sections on CPU with tiny
shapes; the results folder holds every finished section's rows, the env report and a table
even when the run is killed midway; the report marks cut-off, timed-out and skipped rows."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.helpers import REPO

sys.path.insert(0, str(REPO / "scripts"))


def _env():
    return {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}


def test_plan_fits_8_minutes_and_the_deadline_skips():
    from gpu_check.plan import BY_NAME, CORE_TIMEOUT_S, DEADLINE_S, start_timeout

    assert CORE_TIMEOUT_S < 480 and DEADLINE_S < 480
    assert start_timeout(BY_NAME["llama_compile_op"], 40)[0] == 40  # core: capped to what is left
    assert start_timeout(BY_NAME["llama_compile_op"], 30)[0] is None  # under half its timeout: skipped
    assert start_timeout(BY_NAME["llama_eager_full"], 20)[0] is None  # an extra needs its whole timeout


def test_report_marks_cut_off_failed_and_skipped(tmp_path):
    from gpu_check import report
    from gpu_check.rows import write_json

    write_json(tmp_path / "rows" / "llama_compile_op.json",
               [{"section": "llama_compile_op", "config": "AC op", "result": "running", "phase": "compile"}])
    write_json(tmp_path / "rows" / "mla_flash.json",
               [{"section": "mla_flash", "config": "x", "result": "running", "phase": "flash"}])
    write_json(tmp_path / "rows" / "env.json", [{"section": "env", "config": "torch", "result": "ok: 2"}])
    write_json(tmp_path / "status.json", {"deadline_s": 470, "sections": {
        "env": {"state": "exit", "rc": 0}, "llama_compile_op": {"state": "timeout", "timeout_s": 70},
        "mla_flash": {"state": "timeout", "timeout_s": 10}, "ep_mesh": {"state": "skipped", "why": "skipped: 3 s"}}})
    text, passed = report.render(tmp_path)
    assert "cut off: timed out after 70 s during compile: not counted" in text  # a bench row: not a failure
    assert "FAILED: timed out after 10 s during flash" in text  # a check that times out is a hang
    assert "skipped: 3 s" in text and "ok: 2" in text
    assert not passed and (tmp_path / "gpu_check.md").read_text() == text


@pytest.mark.timeout(600)
def test_dry_run_killed_midway_keeps_finished_sections(tmp_path):
    """The run is SIGKILLed while its third section runs: the two finished sections' rows, the
    env report and a table are in the folder, and nothing writes to it afterwards."""
    out = tmp_path / "gpu"
    proc = subprocess.Popen(["bash", str(REPO / "scripts" / "gpu_check.sh"), "--dry", "--out", str(out),
                             "--only", "env,mla_flash,grouped_mm"], cwd=REPO, env=_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 500
        while time.monotonic() < deadline:
            status = json.loads((out / "status.json").read_text()) if (out / "status.json").exists() else {}
            if status.get("sections", {}).get("grouped_mm", {}).get("state") == "running":
                break
            assert proc.poll() is None, "gpu_check.sh ended before its third section"
            time.sleep(0.5)
        else:
            raise AssertionError("the third section never started")
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    time.sleep(2)  # the running section sees its driver gone and kills its own group
    snapshot = {p: p.stat().st_mtime_ns for p in out.rglob("*")}
    time.sleep(2)
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*")} == snapshot, "something still writes to the folder"
    table = (out / "gpu_check.md").read_text()
    env_rows = json.loads((out / "rows" / "env.json").read_text())
    assert any(r["config"] == "trivial torch.compile" for r in env_rows)
    assert "torch" in json.loads((out / "env.json").read_text()) and (out / "env.md").exists()
    assert "| env | device |" in table and "| mla_flash |" in table and "flash applies" in table
    assert "| grouped_mm |" in table  # marked running: the driver was killed before it could say more


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_whole_dry_run_leaves_a_complete_table_and_passes(tmp_path):
    """`scripts/gpu_check.sh --dry --out DIR` as a whole: every section of the plan has its row
    (the --dry plan runs one section per code path and lists the others as skipped, naming
    the section that runs their code), the env report is there, and no row FAILED or
    MISMATCHed (exit 0): the sections' Python runs before any GPU does."""
    from gpu_check.plan import PLAN

    out = tmp_path / "gpu"
    proc = subprocess.run(["bash", str(REPO / "scripts" / "gpu_check.sh"), "--dry", "--out", str(out)], cwd=REPO,
                          env=_env(), capture_output=True, text=True, timeout=850)
    table = (out / "gpu_check.md").read_text()
    assert proc.returncode == 0, table
    status = json.loads((out / "status.json").read_text())
    assert "finished_at" in status and list(status["sections"]) == [s.name for s in PLAN]
    for s in PLAN:
        state = status["sections"][s.name]
        assert f"| {s.name} |" in table, s.name
        if s.dry_as:
            assert state["state"] == "skipped" and s.dry_as in state["why"], (s.name, state)
        else:
            assert state == {**state, "state": "exit", "rc": 0}, (s.name, state)
            assert json.loads((out / "rows" / f"{s.name}.json").read_text()), s.name
    assert "FAILED" not in table and "MISMATCH" not in table
    env = json.loads((out / "env.json").read_text())
    assert "torch" in env and (out / "env.md").read_text().strip()
