"""Rewrites the golden loss curves in tests/golden/ (the cases of tests/golden_cases.py).

    python scripts/update_golden.py --reason "data: validation split leaves a gap"          # every case
    python scripts/update_golden.py --case llama_debug_none --reason "init: ..."            # one case

A golden curve changes only as a reviewed decision: the script refuses to run without
`--reason`, and records the reason, the git commit, the torch version and the CPU's kernel
capability in each file next to the curves (so a reviewer sees why, and a mismatch on
another machine can be told from a regression). Each case runs through ./run_train.sh with
tests/golden_cases.RUN_ENV, exactly as tests/test_golden.py reruns it.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.golden_cases import (BY_NAME, CASES, RUN_ENV, case_args, first_divergence,  # noqa: E402
                                git_commit, golden_path, load_golden, run_case)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--case", action="append", choices=sorted(BY_NAME), help="case to rewrite (repeatable; default: all)")
    p.add_argument("--reason", help="why the curves move (required; recorded in the files)")
    a = p.parse_args(argv)
    if not a.reason or not a.reason.strip():
        print('update_golden.py: --reason "..." is required: say why the golden curves change', file=sys.stderr)
        return 2
    import torch

    cases = [BY_NAME[n] for n in a.case] if a.case else CASES
    with tempfile.TemporaryDirectory(prefix="golden-") as tmp:
        for case in cases:
            t0 = time.perf_counter()
            curves = run_case(case, Path(tmp) / case.name)
            old = load_golden(case.name) if golden_path(case.name).is_file() else None
            change = "new" if old is None else (first_divergence(case.name, curves, old["curves"], 0.0) or "unchanged")
            rec = {"case": case.name, "reason": a.reason.strip(), "commit": git_commit(), "torch": torch.__version__,
                   "cpu_capability": torch.backends.cpu.get_cpu_capability(), "env": RUN_ENV,
                   "command": "./run_train.sh " + " ".join(case_args(case, "<tmp>")),
                   "curves": {m: {str(s): v for s, v in sorted(c.items())} for m, c in curves.items()}}
            golden_path(case.name).parent.mkdir(parents=True, exist_ok=True)
            golden_path(case.name).write_text(json.dumps(rec, indent=1) + "\n")
            print(f"{case.name}: {time.perf_counter() - t0:.1f} s, {len(curves['loss'])} steps, "
                  f"final loss {curves['loss'][max(curves['loss'])]:.6f}; vs previous: {change}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
