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


def test_plan_budgets_sit_under_the_deadline_with_headroom(capsys):
    """Every section's budget is the sum of its named cold-start costs; the core budgets add up
    to at least HEADROOM_S less than the deadline (they were 475 s against 470 s); `--list`
    prints each budget with its basis, and the sum."""
    from gpu_check import driver
    from gpu_check.plan import COSTS, CORE_BUDGET_S, DEADLINE_S, HEADROOM_S, PLAN

    for s in PLAN:
        assert s.parts and all(c in COSTS and n > 0 for n, c in s.parts), s.name
        assert s.budget_s >= sum(n * COSTS[c][0] for n, c in s.parts), s.name
    assert CORE_BUDGET_S == sum(s.budget_s for s in PLAN if s.core)
    assert CORE_BUDGET_S + HEADROOM_S <= DEADLINE_S, (CORE_BUDGET_S, HEADROOM_S, DEADLINE_S)
    assert driver.main(["--list"]) == 0
    listed = capsys.readouterr().out
    for s in PLAN:
        assert f"{s.name:28s} {s.budget_s:4d} s" in listed and s.basis() in listed, s.name
    assert f"core budgets: {CORE_BUDGET_S} s of the {DEADLINE_S} s deadline" in listed


def test_timeouts_take_what_earlier_sections_left_and_keep_later_budgets():
    """A section may use the time earlier ones left, up to STRETCH x its budget, while every
    core section after it keeps its budget; a core section starts with half its budget free,
    an extra only with all of it."""
    from gpu_check.driver import Driver
    from gpu_check.plan import BY_NAME, STRETCH, start_timeout

    compile_op, extra = BY_NAME["llama_compile_op"], BY_NAME["llama_eager_full"]
    b = compile_op.budget_s
    assert start_timeout(compile_op, 1000) == (STRETCH * b, "")  # ahead of schedule: stretched, capped
    assert start_timeout(compile_op, 1000, reserved_s=1000 - b - 7)[0] == b + 7  # only what later ones spare
    assert start_timeout(compile_op, 100 + b / 2, reserved_s=100)[0] == b / 2  # half its budget: still starts
    assert start_timeout(compile_op, 100 + b / 2 - 1, reserved_s=100)[0] is None
    assert start_timeout(extra, extra.budget_s - 1)[0] is None  # an extra needs its whole budget
    assert start_timeout(extra, extra.budget_s)[0] == extra.budget_s
    names = ["env", "llama_compile_op", "llama_eager_full", "ep_mesh"]
    d = Driver.__new__(Driver)
    d.names, d.scale = names, 1
    assert d.reserved_after(0) == compile_op.budget_s + BY_NAME["ep_mesh"].budget_s  # extras reserve nothing
    assert d.reserved_after(3) == 0


def _numbers(loss, grad_norm, params, *, group="llama", reference=False, precision="bf16", label="eager, AC none",
             run="4 layers"):
    steps = {"1": params, "5": params}
    return {"group": group, "reference": reference, "label": label, "precision": precision,
            "runs": {run: {"loss": [loss] * 5, "grad_norm": [grad_norm] * 5, "params": steps}}}


def test_numbers_flag_rows_beyond_tolerance_against_their_reference(tmp_path):
    """`numbers.judge` holds each trainer row's losses, grad norms and per-parameter grad norms
    against its group's reference: within the bf16 tolerance is ok, beyond it MISMATCH (a
    row's loss, total norm, one parameter, a missing parameter, a non-finite value); float8
    rows get float8's tolerance; a group whose reference did not finish is not compared;
    and the report fails on a MISMATCH."""
    from gpu_check import numbers, report
    from gpu_check.rows import write_json

    p = {"layers.0.attention.wq.weight": 0.5, "layers.0.feed_forward.w1.weight": 0.4, "output.weight": 2.0}
    near = {k: v * (1 + 1e-3) for k, v in p.items()}
    rows = [
        {"section": "llama_eager_none", "config": "ref", "result": "ok: x", "numbers": _numbers(11.9, 2.1, p, reference=True)},
        {"section": "a", "config": "close", "result": "ok: a", "numbers": _numbers(11.9 * (1 + 1e-4), 2.1 * 1.001, near)},
        {"section": "b", "config": "loss", "result": "ok: b", "numbers": _numbers(11.9 * 1.01, 2.1, p)},
        {"section": "c", "config": "norm", "result": "ok: c", "numbers": _numbers(11.9, 2.1 * 1.05, p)},
        {"section": "d", "config": "one param", "result": "ok: d",
         "numbers": _numbers(11.9, 2.1, {**p, "layers.0.attention.wq.weight": 0.5 * 1.2})},
        {"section": "e", "config": "missing", "result": "ok: e",
         "numbers": _numbers(11.9, 2.1, {k: v for k, v in p.items() if k != "output.weight"})},
        {"section": "f", "config": "nan", "result": "ok: f", "numbers": _numbers(float("nan"), 2.1, p)},
        {"section": "g", "config": "float8", "result": "ok: g",
         "numbers": _numbers(11.9 * 1.01, 2.1 * 1.05, {**p, "output.weight": 2.0 * 1.2}, precision="float8")},
        {"section": "h", "config": "other depth", "result": "ok: h", "numbers": _numbers(1.0, 1.0, p, run="2 layers")},
        {"section": "i", "config": "no reference", "result": "ok: i", "numbers": _numbers(11.9, 2.1, p, group="fsdp")},
        {"section": "j", "config": "failed", "result": "FAILED during build: X"},
    ]
    got = {r["config"]: r for r in numbers.judge(rows)}
    assert got["ref"]["result"] == "ok: x; numbers: the reference of its group (llama)"
    assert got["ref"][numbers.COLUMN] == "11.9000 / 2.1000"
    assert got["close"]["result"].startswith("ok: a; numbers as eager, AC none (bf16 tolerance), steps 1, 5 at 4 "
                                             "layers: loss rel 1.0e-04, grad norm rel 1.0e-03, worst parameter rel")
    assert got["loss"]["result"].startswith("MISMATCH vs eager, AC none: 4 layers, step 1: loss 12.019 vs 11.9")
    assert got["norm"]["result"].startswith("MISMATCH vs eager, AC none: 4 layers, step 1: grad norm")
    assert "layers.0.attention.wq.weight's grad norm 0.6 vs 0.5 (rel 2.0e-01 > 0.05)" in got["one param"]["result"]
    assert got["missing"]["result"].startswith("MISMATCH") and "the parameters differ (output.weight)" in \
        got["missing"]["result"]
    assert got["nan"]["result"].startswith("MISMATCH: loss nan at step 1, 4 layers; ok: f")
    assert got["float8"]["result"].startswith("ok: g; numbers as eager, AC none (float8 tolerance)")
    assert "no depth and step in common" in got["other depth"]["result"]
    assert "not compared: the group's reference (fsdp) did not finish" in got["no reference"]["result"]
    assert got["failed"]["result"] == "FAILED during build: X"
    # The table: a MISMATCH fails the check; the same rows without the bad ones pass.
    for keep, ok in ((["ref", "close", "loss"], False), (["ref", "close", "float8", "no reference"], True)):
        folder = tmp_path / "_".join(keep)
        for r in rows:
            if r["config"] in keep:
                write_json(folder / "rows" / f"{r['section']}.json", [r])
        text, passed = report.render(folder)
        assert passed is ok and numbers.COLUMN in text, keep


def test_torchtitan_anchors_are_reproduced_by_the_8b_flops_per_token():
    """TorchTitan's 8B figures (5,762 / 6,667 / 8,532 tokens/s per H100) are 33.7 / 39.0 / 50.0%
    MFU at our FLOPs per token for Llama 3 8B at seq 8192 (57.91 GFLOP: 6 x 7.50 B non-embedding
    params + 12 x 32 x 32 x 128 x 8192) and 989 TFLOP/s; the rows' MFU uses the same figure."""
    from gpu_check.bench import TORCHTITAN, anchor
    from models import get_model_spec
    from parallelisms.apply import build_model

    spec = get_model_spec("llama3")
    args = spec.flavors["8B"]
    flops = spec.summary_fn(build_model(spec, args), args, 8192)["flops_per_token"]
    assert flops == 6 * (8_030_261_248 - 128256 * 4096) + 12 * 32 * 32 * 128 * 8192 == 57_914_449_920
    got = {key: anchor(key, flops) for key in TORCHTITAN}
    assert got == {(False, False, "op"): "5,762 tok/s = 33.7% (FSDP)",
                   (True, False, "op"): "6,667 tok/s = 39.0% (FSDP + compile)",
                   (True, True, "op"): "8,532 tok/s = 50.0% (FSDP + compile + Float8)"}
    assert anchor((False, False, "none"), flops) == ""


def test_trainer_rows_record_the_numbers_judge_compares(tmp_path):
    """bench.measure records every step's loss and pre-clip grad norm and, at NUMBERS_STEPS,
    each parameter's pre-clip grad norm under its model name (clipping is undone: their
    squares add up to the total); rows built from them pass against the reference for AC op
    (the same numbers) and read MISMATCH for another seed."""
    import math

    from gpu_check import numbers
    from gpu_check.bench import measure, numbers_entry, trainer_args
    from gpu_check.common import device
    from gpu_check.plan import NUMBERS_STEPS
    from gpu_check.rows import Rows

    dev = device(True)

    def run(mode: str, seed: int):
        extra = ["--activation_checkpoint.mode", mode, "--training.seed", str(seed), "--training.max_norm", "0.2"]
        m = measure(trainer_args(True, "llama3", 2, str(tmp_path / f"{mode}{seed}"), extra), dev, Rows(None, "t"),
                    "c", "2 layers", estimate=False)
        return {"section": f"{mode}{seed}", "config": f"{mode}{seed}", "result": "ok: x",
                "numbers": numbers_entry("llama", "none", {"2 layers": m["run"]}, reference=(mode, seed) == ("none", 0),
                                         float8=False)}, m

    ref, m = run("none", 0)
    run_ = m["run"]
    assert len(run_["loss"]) == len(run_["grad_norm"]) == 5 and sorted(run_["params"]) == [str(s) for s in NUMBERS_STEPS]
    for step, norms in run_["params"].items():
        assert "layers.0.attention.wq.weight" in norms and not any("_checkpoint" in n or "_orig_mod" in n for n in norms)
        total = run_["grad_norm"][int(step) - 1]
        assert total > 0.2  # clipped: the norms were divided back
        assert math.isclose(math.sqrt(sum(v * v for v in norms.values())), total, rel_tol=1e-4), (step, total)
    same, _ = run("op", 0)
    other, _ = run("none", 1)
    got = {r["config"]: r["result"] for r in numbers.judge([ref, same, other])}
    assert got["op0"].startswith("ok: x; numbers as none (bf16 tolerance), steps 1, 5 at 2 layers"), got["op0"]
    assert got["none1"].startswith("MISMATCH vs none: 2 layers, step 1: loss"), got["none1"]


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
    # The log starts with the plan: each section's budget with its basis, and their sum.
    log = (out / "gpu_check.log").read_text()
    assert all(f"{s.name:28s} {s.budget_s:4d} s" in log for s in PLAN) and "core budgets:" in log
    # The trainer rows' numbers were compared with their references, on real steps.
    rows = {r["section"]: r for name in ("llama_eager_op", "llama_compile_op")
            for r in json.loads((out / "rows" / f"{name}.json").read_text())}
    for name, r in rows.items():
        assert "numbers as eager, AC none (bf16 tolerance), steps 1, 5 at 2 layers, 4 layers" in table, name
        assert r["numbers"]["runs"]["4 layers"]["params"]["5"], name
    assert "found_inf 1 left params and moments bitwise: True; found_inf 0 equals plain fused AdamW bitwise: True" \
        in table
    assert "direct recompute 2; numbers as FSDP2 fp32, AC none" in table
