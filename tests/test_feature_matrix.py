"""The pairwise feature matrix: {FSDP, TP, PP, CP, EP} x AC {none, full, op, budget} x {AdamW,
Muon} x float8 {off, on} x compile {off, on} x {Llama 3, DeepSeek V3, Qwen3-MoE} x {odd, even}
layers. Every pair of values of two factors is in at least one row that must equal one rank
(tests/feature_matrix.py builds the covering design; `test_the_rows_cover_every_pair` checks
that property itself), and every row either equals one rank or is refused with one line:

- equal: 2 gloo ranks (every trained row in one torchrun launch of tests/parallel_worker.py)
  against one rank in this process (no AC, eager, same model, optimizer and float8; compiled
  for a compiled float8 row: fm.compiled_reference says why), fp32, from
  the same layout-independent init, on the same global batches in the same microbatches: 2
  microbatches per step (gradient accumulation; PP adds its own), 3 steps, clipping active.
  Losses of every step, the last step's gradients (max over tensors of max|d| / max|ref|) and
  the params after it (by norm) within 1e-5. MoE rows train with uneven expert loads (checked on
  their references: the busiest expert gets over 1.1x the mean in every step).
- float8 rows: losses within 1e-5; gradients and params within a tenth of float8's own effect
  (||row - one rank float8|| <= 0.1 ||one rank float8 - one rank fp32||, over all tensors).
  1e-5 is out of reach: tensorwise scales are not powers of 2, so a last-bit change of the
  element that sets a tensor's amax (TP's partial sums, Muon's sharded orthogonalisation, EP's
  expert sums) moves every rounding boundary of that tensor. Measured on correct runs: TP 2
  differs from one rank by 2.6e-3 (max-rel) in gradients after one step on one microbatch's
  data and 8e-7 on another's; the ratio above stays <= 0.014 (TP, EP x Muon), while a change of
  scale granularity (CP's per-rank scales, before float8.reduce_scales_over) gave 0.84.
- refused: the pre-launch check run_train.sh runs (`python -m trainer.launch --check-config`,
  here in-process, NGPU=2) returns 2 and prints exactly the one line, no traceback.

docs/feature_matrix.md lists every row and its outcome; `test_the_docs_list_every_row` keeps it
true. Run with `-s` for the measured differences.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
import torch

import tests.feature_matrix as fm
from tests.helpers import REPO, read_metrics, run_in_process
from tests.parallel_worker import clean_name
from tests.test_parallel_layouts import compare_to_reference, loss_rel, max_rel, norm_rel, print_report, \
    run_layout_cases

TOL = 1e-5
FLOAT8_RATIO = 0.1
ROWS = fm.matrix()
TRAINED = [(name, row, kind, text) for name, row, kind, text in ROWS if kind != "refused"]
REFUSED_ROWS = [(name, row, line) for name, row, kind, line in ROWS if kind == "refused"]
REPORT: list[str] = []


@pytest.fixture(scope="module", autouse=True)
def _matrix_flavors():
    """The matrix flavors exist for this module's tests only (see tests/feature_matrix.py)."""
    with fm.flavors_registered():
        yield


def every_pair(factors: dict) -> set:
    return {fm.pair(a, b) for f, g in itertools.combinations(factors, 2)
            for a, b in itertools.product([(f, v) for v in factors[f]], [(g, v) for v in factors[g]])}


def test_the_rows_cover_every_pair():
    """The covering-design property, for the matrix and for other factor sets: every pair is in
    a trained row except the excluded ones, which are in none; each refused row holds exactly
    one refused pair; the design is deterministic."""
    isolated = {fm.pair(*p) for p in [*fm.REFUSED, *fm.KNOWN_FAILURES]}
    covered = set().union(*(fm.pairs_of(row) for _, row, kind, _ in ROWS if kind == "equal"))
    assert covered == every_pair(fm.FACTORS) - isolated
    assert all(fm.pairs_of(dict(key)) <= covered for key in fm.FIXED)  # each trained with its fix
    keys = [*fm.REFUSED, *fm.FIXED, *fm.KNOWN_FAILURES]
    assert sorted([k for k in keys if fm.holds(row, k)] for _, row, kind, _ in ROWS if kind != "equal") == \
        sorted([k] for k in keys)  # one row per excluded key, holding no other
    assert fm.matrix() == ROWS
    assert 20 <= sum(kind == "equal" for _, _, kind, _ in ROWS) <= 24  # the 5 x 4 pairs of the largest factors
    for seed in range(3):
        factors = {"a": ("0", "1", "2"), "b": ("0", "1"), "c": ("0", "1", "2", "3"), "d": ("0", "1")}
        excluded = {fm.pair(("a", "2"), ("c", "3"))}
        rows = fm.all_pairs(factors, excluded, seed=seed)
        assert set().union(*map(fm.pairs_of, rows)) == every_pair(factors) - excluded
        assert rows == fm.all_pairs(factors, excluded, seed=seed)


def test_the_docs_list_every_row():
    text = (REPO / "docs" / "feature_matrix.md").read_text()
    for make in (fm.markdown_table, fm.pairs_table):
        assert make() in text, f"docs/feature_matrix.md is stale: paste tests.feature_matrix.{make.__name__}()"
    assert "docs/feature_matrix.md" in (REPO / "README.md").read_text()


def _reference(args: list[str], folder: Path) -> dict:
    losses, trainer = run_in_process([*args, "--job.dump_folder", str(folder)])
    torch._dynamo.reset()  # a fresh compile cache for the next reference (as tests/parallel_worker.py)
    part = trainer.model_parts[0]
    named = [(clean_name(n), p) for n, p in part.named_parameters()]  # without compile's wrapper names
    return {"losses": losses, "params": {n: p.detach().clone() for n, p in named},
            "grads": {n: p.grad.detach().clone() for n, p in named}, "metrics": read_metrics(folder)}


def float8_ratio(got: dict, ref8: dict, ref32: dict) -> float:
    """||got - ref8|| / ||ref8 - ref32|| over all tensors of the dicts."""
    assert got.keys() == ref8.keys() == ref32.keys()
    num = sum(((got[k].float() - ref8[k].float()) ** 2).sum() for k in ref8)
    den = sum(((ref8[k].float() - ref32[k].float()) ** 2).sum() for k in ref8)
    return (num / den).sqrt().item()


@pytest.fixture(scope="module")
def matrix_runs(tmp_path_factory):
    """One-rank references (one thread, as the ranks: the CPU kernels then sum in the same
    order), then every trained row in one 2-rank launch."""
    root = tmp_path_factory.mktemp("matrix")
    refs: dict = {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for _, row, _, _ in TRAINED:
            key = fm.reference_key(row)
            if key in refs:
                continue
            refs[key] = _reference(fm.reference_args(row), root / ("ref_" + "_".join(map(str, key))))
            if row["float8"] == "on":
                refs[key]["fp32"] = _reference(fm.fp32_reference_args(row), root / ("fp32_" + "_".join(map(str, key))))
    finally:
        torch.set_num_threads(threads)
    cases = [{"name": name, "import": "tests.feature_matrix_flavors",
              "args": [*fm.row_args(row), "--job.dump_folder", str(root / "runs" / name)]}
             for name, row, _, _ in TRAINED]
    results = run_layout_cases(root, 2, cases, timeout=900)
    yield refs, results
    print_report(REPORT)


@pytest.mark.multirank
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("name", [pytest.param(name, marks=[pytest.mark.xfail(strict=True, reason=text)]
                                               if kind == "xfail" else []) for name, _, kind, text in TRAINED])
def test_row_equals_one_rank(name, matrix_runs):
    refs, results = matrix_runs
    row = next(r for n, r, _, _ in TRAINED if n == name)
    ref = refs[fm.reference_key(row)]
    if row["model"] != "llama3":  # uneven expert loads in every step
        loads = [m["moe/max_over_mean"] for m in ref["metrics"]]
        assert len(loads) == len(ref["losses"]) and min(loads) > 1.1, loads
    got = results[name]
    if row["float8"] == "off":
        compare_to_reference(name, 2, got, ref, REPORT)
        return
    dl = loss_rel(got["losses"], ref["losses"])
    dg, dp = (float8_ratio(got[k], ref[k], ref["fp32"][k]) for k in ("grads", "params"))
    REPORT.append(f"{name:<30} {2:>5}  {dl:9.2e}  float8: grad ratio {dg:.3f}, param ratio {dp:.3f} "
                  f"(max-rel {max_rel(got['grads'], ref['grads']):.1e}, {norm_rel(got['params'], ref['params']):.1e})")
    assert dl <= TOL, (got["losses"], ref["losses"])
    assert dg <= FLOAT8_RATIO and dp <= FLOAT8_RATIO, (dg, dp)


@pytest.mark.parametrize("name", [name for name, _, _ in REFUSED_ROWS])
def test_row_is_refused_with_one_line(name, tmp_path, monkeypatch, capsys):
    """What run_train.sh runs before any worker starts, in this process (the matrix flavors are
    registered here): exit code 2 and exactly the one line on stderr."""
    from trainer.preflight import main as preflight

    _, row, line = next(r for r in REFUSED_ROWS if r[0] == name)
    monkeypatch.setenv("TITAN_CHECK_WORLD_SIZE", "2")
    assert preflight(["--check-config", *fm.row_args(row, fixes=False), "--job.dump_folder", str(tmp_path / "run")]) \
        == 2
    out, err = capsys.readouterr()
    assert err.splitlines() == [line] and out == "", err
