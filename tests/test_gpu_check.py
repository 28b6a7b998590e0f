"""scripts/gpu_check.sh works before any GPU exists: `--dry` runs every section on CPU with
tiny shapes and exits 0; the report turns a timed-out or failed section into a failing row."""

from __future__ import annotations

import json
import os
import sys

import pytest

from tests.helpers import REPO, run_killing_group

sys.path.insert(0, str(REPO / "scripts"))


def test_report_marks_problems_and_fails(tmp_path):
    import gpu_check

    (tmp_path / "llama.json").write_text(json.dumps([{"section": "llama", "config": "AC none", "tokens/s": "10",
                                                      "result": "ok"}]))
    (tmp_path / "mla_flash.json").write_text(json.dumps([{"section": "mla_flash", "config": "x", "result": "ok"}]))
    problems = {"deepseek": "timed out after 80 s", "unpadded_groups": "timed out after 15 s"}
    text, passed = gpu_check.report(tmp_path, tmp_path / "t.md", True, problems)
    assert not passed
    assert "| deepseek | (the rest) |" in text and "FAILED: timed out after 80 s" in text
    assert "diagnostic: timed out after 15 s" in text  # a diagnostic section does not fail the check
    assert "FAILED: no rows" in text  # sections that wrote nothing (empty_groups, chunked_ce)
    assert (tmp_path / "t.md").read_text() == text
    for name in ("empty_groups", "chunked_ce", "deepseek"):
        (tmp_path / f"{name}.json").write_text(json.dumps([{"section": name, "config": "c", "result": "ok"}]))
    assert gpu_check.report(tmp_path, tmp_path / "t.md", True, {"unpadded_groups": "exited with status 1"})[1]


@pytest.mark.slow
@pytest.mark.timeout(3000)
def test_dry_run_exits_0_with_every_section(tmp_path):
    out = tmp_path / "table.md"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "2"}
    proc = run_killing_group(["bash", str(REPO / "scripts" / "gpu_check.sh"), "--dry", "--out", str(out)],
                             cwd=REPO, env=env, timeout=2900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [line.split("|")[1:-1] for line in out.read_text().splitlines()[4:]]
    rows = [[c.strip() for c in r] for r in rows]
    print(out.read_text())
    by_section: dict[str, list[list[str]]] = {}
    for r in rows:
        by_section.setdefault(r[0], []).append(r)
    assert set(by_section) == {"empty_groups", "mla_flash", "chunked_ce", "llama", "deepseek", "unpadded_groups"}
    for section, section_rows in by_section.items():
        assert any(r[-1].startswith("ok") for r in section_rows), (section, section_rows)
    ok = {r[1] for r in by_section["llama"] if r[-1] == "ok"}
    assert "AC none, compile off, float8 off" in ok
    assert any("compile on" in c for c in ok) and any("float8 on" in c for c in ok)
    syncs = [r[6] for r in by_section["llama"] if r[6]]
    assert syncs and syncs[0].endswith("d2h")
