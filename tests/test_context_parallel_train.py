"""Context parallel training equals one rank: losses, last-step gradients, post-step params.

Same protocol as tests/test_parallel_layouts.py (seed checkpoint, fp32, gloo, 4 steps,
constant LR 1e-4, clipping active at max_norm 0.3, global batch 4, tolerance 1e-5
relative); layouts run as cases of one torchrun launch per world size
(tests/parallel_worker.py). CP ranks share a batch and each trains on its two chunks
of every sequence, so global batch composition is the same as one rank's.

Resharding: the cp2 run saves at step 2; the step-2 checkpoint is resumed at fsdp 2
(same 2-rank launch, a later case), at cp 4 (4-rank launch) and at cp 1 (one process,
here); steps 3-4 must continue the straight cp2 run within 1e-6 and the data position
must carry over (a restarted loader would change the step-3 loss by ~1e-2).

Run with `-s` to see the table of measured differences.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.test_parallel_layouts import PP2, STEPS, _common, compare_to_reference, loss_rel, print_report, \
    reference_run, run_layout_cases, sched, write_seed_checkpoints

pytestmark = [pytest.mark.multirank]

RESUME_TOL = 1e-6


def cp(degree: int, method: str = "allgather") -> list[str]:
    return ["--parallelism.context_parallel_degree", str(degree), "--parallelism.context_parallel_method", method]


LB = "--training.local_batch_size"
ODD_SEQ = ["--training.seq_len", "56"]  # 2 * cp 4 * 7: an odd number of tokens per chunk

# name -> (world size, reference key, extra args). local_batch_size x dp = 4 everywhere.
LAYOUTS: dict[str, tuple[int, str, list[str]]] = {
    # 2 ranks
    "cp2_allgather": (2, "debug_small", [LB, "4", *cp(2), "--checkpoint.interval", "2"]),
    "cp2_alltoall": (2, "debug_small", [LB, "4", *cp(2, "alltoall")]),
    "cp2_accum2": (2, "debug_small", [LB, "2", *cp(2)]),
    "cp2_ac_op": (2, "debug_small", [LB, "4", *cp(2), "--activation_checkpoint.mode", "op"]),
    "cp2_ac_full_alltoall": (2, "debug_small", [LB, "4", *cp(2, "alltoall"), "--activation_checkpoint.mode",
                                                "full"]),
    "cp2_deepseek_allgather": (2, "ds_debug", [LB, "4", *cp(2)]),
    "cp2_ep2_deepseek": (2, "ds_debug", [LB, "4", *cp(2, "alltoall"), "--parallelism.expert_parallel_degree", "2"]),
    # 4 ranks
    "cp4_allgather": (4, "debug_small", [LB, "4", *cp(4)]),
    "cp4_alltoall": (4, "debug_small", [LB, "4", *cp(4, "alltoall")]),
    "cp4_odd_seq56": (4, "debug_small_seq56", [LB, "4", *cp(4), *ODD_SEQ]),
    "cp2_fsdp2": (4, "debug_small", [LB, "2", *cp(2)]),
    "cp2_tp2_sp": (4, "debug_small", [LB, "4", *cp(2), "--parallelism.tensor_parallel_degree", "2"]),
    "cp2_pp2": (4, "debug_small", [LB, "4", *cp(2), *PP2, *sched("1F1B")]),
    "cp2_fsdp2_ep4_deepseek": (4, "ds_debug", [LB, "2", *cp(2), "--parallelism.expert_parallel_degree", "4"]),
}

# name -> (world size, extra args of the new layout): resume cp2_allgather's step-2 checkpoint.
RESUMES: dict[str, tuple[int, list[str]]] = {
    "dcp_cp2_to_fsdp2": (2, [LB, "2"]),
    "dcp_cp2_to_cp4": (4, [LB, "4", *cp(4, "alltoall")]),
    "dcp_cp2_to_cp1": (1, [LB, "4"]),
}

# Reference key -> (flavor key of tests.test_parallel_layouts.MODELS, extra args).
REFERENCES = {"debug_small": ("debug_small", []), "ds_debug": ("ds_debug", []),
              "debug_small_seq56": ("debug_small", ODD_SEQ)}

REPORT: list[str] = []


def _args(root: Path, name: str, ref_key: str) -> list[str]:
    flavor, extra = REFERENCES[ref_key]
    return _common(root, name, flavor) + extra


@pytest.fixture(scope="module")
def refs(tmp_path_factory):
    root = tmp_path_factory.mktemp("cp_layouts")
    write_seed_checkpoints(root, ("debug_small", "ds_debug"))
    refs = {key: reference_run(_args(root, f"ref_{key}", key) + [LB, "4"]) for key in REFERENCES}
    yield root, refs
    print_report(REPORT)


def _launch(root: Path, world: int) -> dict:
    cases = [{"name": n, "args": _args(root, n, key) + extra} for n, (w, key, extra) in LAYOUTS.items() if w == world]
    src = root / "ck" / "cp2_allgather" / "step-2"
    cases += [{"name": n, "args": _args(root, n, "debug_small") + extra, "dump_loaded": True,
               "copy": [str(src), str(root / "ck" / n / "step-2")]} for n, (w, extra) in RESUMES.items() if w == world]
    return run_layout_cases(root, world, cases, timeout=600)


def _resume_in_one_process(root: Path, name: str) -> dict:
    shutil.copytree(root / "ck" / "cp2_allgather" / "step-2", root / "ck" / name / "step-2")
    return reference_run(_args(root, name, "debug_small") + RESUMES[name][1])


@pytest.fixture(scope="module")
def suite(refs):
    """Every layout (2- then 4-rank launch), then the one-process resume of the cp2 checkpoint."""
    root, ref = refs
    results = {**_launch(root, 2), **_launch(root, 4)}
    return ref, {**results, "dcp_cp2_to_cp1": _resume_in_one_process(root, "dcp_cp2_to_cp1")}


@pytest.mark.slow
@pytest.mark.timeout(1500)
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_cp_layout_matches_one_rank(name, suite):
    refs, results = suite
    world, key, _ = LAYOUTS[name]
    compare_to_reference(name, world, results[name], refs[key], REPORT)


@pytest.mark.slow
@pytest.mark.timeout(1500)
@pytest.mark.parametrize("name", list(RESUMES))
def test_cp_checkpoint_resumes_on_other_layouts(name, suite):
    refs, results = suite
    got, straight = results[name], results["cp2_allgather"]
    assert len(got["losses"]) == STEPS - 2
    dl_straight = loss_rel(got["losses"], straight["losses"][2:])
    ref = {**refs["debug_small"], "losses": refs["debug_small"]["losses"][2:]}
    compare_to_reference(name, RESUMES[name][0], got, ref, REPORT, f"(vs the straight cp2 run: {dl_straight:.1e})")
    assert dl_straight <= RESUME_TOL, (name, got["losses"], straight["losses"])
