"""The memory estimator's context-parallel term against a real 2-rank CP step on this CPU:
saved activation bytes per rank within 5% (both methods; AC none and op)."""

from __future__ import annotations

import pytest

from tests.test_memory_estimate import DEBUG
from trainer.memory import ValidationCase, format_validation, validate_cases

pytestmark = [pytest.mark.multirank, pytest.mark.slow]


@pytest.mark.timeout(900)
def test_cp_estimate_matches_measured_saved_bytes(tmp_path):
    cases = [ValidationCase(f"cp2-{method}-{mode}", DEBUG + [
        "--activation_checkpoint.mode", mode, "--parallelism.context_parallel_degree", "2",
        "--parallelism.context_parallel_method", method], nproc=2)
        for method, mode in (("allgather", "none"), ("alltoall", "op"))]
    rows = validate_cases(cases, str(tmp_path), timeout=600)
    text = format_validation(rows)
    print(text)
    for r in rows:
        assert abs(r["saved_err"]) <= 0.05, text
