"""Golden loss curves: each case of tests/golden_cases.py, rerun, reproduces its committed curve.

One rank: each case runs through ./run_train.sh (fp32, CPU, OMP_NUM_THREADS=1) and must
match tests/golden/<case>.json within GOLDEN_RTOL (1e-6 relative for loss and val loss, 1e-5
for the grad norm: tests/golden_cases.py says why) at every step, so any change that
moves the numbers (init, data order, the loss, the LR schedule, the router, the optimizer)
fails here, naming the first step that diverged and both values.

Layouts: each case also runs under the 2-rank layouts its entry names (FSDP 2, TP 2, PP 2,
CP 2, EP 2), from a seed checkpoint of its own one-rank init, for the golden's first
LAYOUT_STEPS steps (same LR schedule: the run stops early), within LAYOUT_RTOL (1e-5). So a
layout that drifts from the committed curve fails too, not only one that drifts from a
fresh one-rank run. All layout runs share one torchrun launch.

A legitimate change rewrites the curves: `python scripts/update_golden.py --reason "..."`.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.golden_cases import (CASES, GOLDEN_RTOL, LAYOUT_RTOL, LAYOUT_STEPS, LAYOUTS, RUN_ENV, case_args,
                                curves_from_metrics, first_divergence, golden_path, load_golden, run_case)
from tests.helpers import run_in_process, torchrun

PAIRS = [(c, layout) for c in CASES for layout in c.layouts]


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    """Every case through ./run_train.sh, two at a time (one thread each): name -> curves."""
    root = tmp_path_factory.mktemp("golden")
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {c.name: pool.submit(run_case, c, root / c.name) for c in CASES}
        return {name: f.result() for name, f in futures.items()}


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    """Seed checkpoints of each case's init, then every (case, layout) in one 2-rank launch."""
    root = tmp_path_factory.mktemp("golden_layouts")
    seeds = {}
    for c in [c for c in CASES if c.layouts]:
        run_in_process([*case_args(c, root / "seed" / c.name), "--checkpoint.enable",
                        "--checkpoint.create_seed_checkpoint"])
        seeds[c.name] = root / "seed" / c.name / "checkpoint" / "step-0"
    cases = [{"name": f"{c.name}-{layout}", "stop_after": LAYOUT_STEPS,
              "args": [*case_args(c, root / f"{c.name}-{layout}"), *LAYOUTS[layout],
                       "--checkpoint.initial_load_path", str(seeds[c.name])]} for c, layout in PAIRS]
    (root / "cases.json").write_text(json.dumps(cases))
    torchrun(2, [str(root / "cases.json"), str(root / "out")], module="tests.golden_worker", timeout=900,
             env=RUN_ENV)
    return {case["name"]: curves_from_metrics(root / case["name"]) for case in cases}


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_one_rank_reproduces_golden(one_rank, case):
    golden = load_golden(case.name)
    assert golden["curves"]["loss"] and sorted(golden["curves"]["loss"]) == list(range(1, 21))
    if "--validation.enable" in case.args:
        assert golden["curves"].get("val/loss"), "validation on, but the golden has no val/loss"
    msg = first_divergence(case.name, one_rank[case.name], golden["curves"], GOLDEN_RTOL)
    assert msg is None, msg + f" [golden from commit {golden['commit']}, torch {golden['torch']}]"


@pytest.mark.multirank
@pytest.mark.parametrize("case,layout", PAIRS, ids=[f"{c.name}-{lay}" for c, lay in PAIRS])
def test_layout_matches_golden(layouts, case, layout):
    got = layouts[f"{case.name}-{layout}"]
    assert sorted(got["loss"]) == list(range(1, LAYOUT_STEPS + 1))
    msg = first_divergence(f"{case.name} under {layout}", got, load_golden(case.name)["curves"], LAYOUT_RTOL,
                           steps=LAYOUT_STEPS)
    assert msg is None, msg


def test_every_layout_runs_and_every_case_has_a_golden():
    assert {lay for _, lay in PAIRS} == set(LAYOUTS)
    for c in CASES:
        rec = json.loads(golden_path(c.name).read_text())
        assert rec["reason"] and rec["commit"] and rec["torch"] and rec["env"] == RUN_ENV, c.name


def test_first_divergence_names_the_step_and_both_values():
    ref = {"loss": {1: 5.0, 2: 5.12347, 3: 5.0}, "grad_norm": {1: 1.0, 2: 1.0, 3: 1.0}, "val/loss": {3: 4.0}}
    got = {"loss": {1: 5.0, 2: 5.123456, 3: 9.0}, "grad_norm": {1: 1.0, 2: 1.0, 3: 1.0}, "val/loss": {3: 4.0}}
    assert first_divergence("x", got, ref, 1e-6) == "x: step 2 loss 5.123456 != golden 5.123470 (rel 2.7e-06 > 1e-06)"
    assert first_divergence("x", got, ref, 1e-6, steps=1) is None
    got["loss"] = dict(ref["loss"])
    assert first_divergence("x", got, ref, 0.0) is None
    got["loss"][1] = float("nan")
    assert "step 1 loss nan" in first_divergence("x", got, ref, 1e-6)
    del got["val/loss"]
    assert "val/loss missing" in first_divergence("x", got, ref, 1e-6)
    # Per-metric tolerances: a grad norm 2e-6 off passes at 1e-5, a loss 2e-6 off does not.
    got = {"loss": {1: 5.0}, "grad_norm": {1: 1.000002}}
    ref = {"loss": {1: 5.0}, "grad_norm": {1: 1.0}}
    assert first_divergence("x", got, ref, {"loss": 1e-6, "grad_norm": 1e-5}) is None
    assert "grad_norm" in first_divergence("x", got, ref, 1e-6)
    got["loss"][1] = 5.00001
    assert first_divergence("x", got, ref, {"loss": 1e-6, "grad_norm": 1e-5}).startswith("x: step 1 loss")


def test_update_golden_refuses_without_a_reason(capsys):
    import importlib.util

    spec = importlib.util.spec_from_file_location("update_golden", Path(__file__).parent.parent / "scripts" /
                                                  "update_golden.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.main([]) == 2 and mod.main(["--reason", "  "]) == 2
    assert '--reason "..." is required' in capsys.readouterr().err
