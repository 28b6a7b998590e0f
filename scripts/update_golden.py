"""Rewrites the golden loss curves in tests/golden/ (the cases of tests/golden_cases.py) and their tolerances.

    python scripts/update_golden.py --reason "data: validation split leaves a gap"          # every case
    python scripts/update_golden.py --case llama_debug_none --reason "init: ..."            # one case
    python scripts/update_golden.py --keep-curves --reason "tolerance: ..."                 # re-measure only

A golden curve changes only as a reviewed decision: the script refuses to run without
`--reason`, and records the reason, the git commit, the torch version and the CPU's kernel
capability in each file next to the curves (so a reviewer sees why, and a mismatch on
another machine can be told from a regression). Each case runs through ./run_train.sh with
tests/golden_cases.RUN_ENV, exactly as tests/test_golden.py reruns it.

Then every case runs again in each of golden_cases.ENVIRONMENTS (this CPU as other CPUs: ATen's
AVX2 and scalar kernels, MKL's AVX2 GEMMs), and the file records the largest relative spread
from the curves per metric and step, the tolerance derived from it
(`golden_cases.tolerance_from_spread`) and this command, which the test then applies.
`--keep-curves` re-measures the spread of the committed curves without rewriting them, and refuses
when this machine's own run no longer passes the check the test applies (a regression must not widen
the tolerance that would catch it).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.golden_cases import (BASE_RTOL, BY_NAME, CASES, ENVIRONMENTS, MAX_RTOL, RUN_ENV,  # noqa: E402
                                SPREAD_MARGIN, case_args, first_divergence, git_commit, golden_path, golden_rtol, load_golden,
                                relative_spread, run_case, tolerance_from_spread)


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform
    return platform.processor() or "unknown"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--case", action="append", choices=sorted(BY_NAME), help="case to rewrite (repeatable; default: all)")
    p.add_argument("--reason", help="why the curves move (required; recorded in the files)")
    p.add_argument("--keep-curves", action="store_true",
                   help="keep the committed curves; only re-measure their spread across ENVIRONMENTS and tolerance")
    p.add_argument("--workers", type=int, default=2, help="runs at a time (one thread each)")
    a = p.parse_args(argv)
    if not a.reason or not a.reason.strip():
        print('update_golden.py: --reason "..." is required: say why the golden curves change', file=sys.stderr)
        return 2
    import torch

    command = "python scripts/update_golden.py " + shlex.join(argv if argv is not None else sys.argv[1:])
    cases = [BY_NAME[n] for n in a.case] if a.case else CASES
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="golden-") as tmp, ThreadPoolExecutor(max_workers=a.workers) as pool:
        root = Path(tmp)
        runs = {(c.name, env): pool.submit(run_case, c, root / env / c.name, extra_env=ENVIRONMENTS[env])
                for c in cases for env in ENVIRONMENTS}
        for case in cases:
            got = {env: runs[(case.name, env)].result() for env in ENVIRONMENTS}
            old = load_golden(case.name) if golden_path(case.name).is_file() else None
            if a.keep_curves:
                if old is None:
                    print(f"update_golden.py: {case.name} has no golden to keep; run without --keep-curves",
                          file=sys.stderr)
                    return 2
                # Re-measuring must not widen a tolerance to hide a regression: this machine's own run
                # still has to pass the check the test applies before its spread is taken.
                drift = first_divergence(case.name, got["native"], old["curves"], golden_rtol(old))
                if drift:
                    print(f"update_golden.py: --keep-curves: the code no longer reproduces {case.name} ({drift}); "
                          "rewrite the curves (without --keep-curves) if the change is intended", file=sys.stderr)
                    return 1
                rec, curves = old, old["curves"]
                rec.pop("tolerance", None)
                change = "curves kept"
            else:
                curves = got["native"]
                change = "new" if old is None else (first_divergence(case.name, curves, old["curves"], 0.0)
                                                    or "unchanged")
                rec = {"case": case.name, "reason": a.reason.strip(), "commit": git_commit(),
                       "torch": torch.__version__, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
                       "env": RUN_ENV, "command": "./run_train.sh " + " ".join(case_args(case, "<tmp>"))}
            spread = relative_spread(list(got.values()), curves)
            rtol = tolerance_from_spread(spread)
            rec["tolerance"] = {
                "reason": a.reason.strip(), "command": command, "commit": git_commit(), "cpu": cpu_model(),
                "environments": ENVIRONMENTS, "margin": SPREAD_MARGIN, "base": BASE_RTOL,
                "spread": {m: {str(s): v for s, v in sorted(c.items())} for m, c in spread.items()},
                "rtol": {m: {str(s): v for s, v in sorted(c.items())} for m, c in rtol.items()},
            }
            rec["curves"] = {m: {str(s): v for s, v in sorted(c.items())} for m, c in curves.items()}
            golden_path(case.name).parent.mkdir(parents=True, exist_ok=True)
            golden_path(case.name).write_text(json.dumps(rec, indent=1) + "\n")
            worst = ", ".join(f"{m} {max(c.values()):.1e} (step {max(c, key=c.get)}) -> rtol {max(rtol[m].values()):.0e}"
                              for m, c in spread.items())
            print(f"{case.name}: {len(curves['loss'])} steps, final loss {curves['loss'][max(curves['loss'])]:.6f}; "
                  f"vs previous: {change}; spread across {len(ENVIRONMENTS)} environments: {worst}", flush=True)
            if any(v > MAX_RTOL for c in rtol.values() for v in c.values()):
                print(f"update_golden.py: {case.name}: a tolerance above {MAX_RTOL:.0e}: too chaotic for a golden "
                      "curve (fewer steps, a smaller LR?)", file=sys.stderr)
                return 1
    print(f"{len(cases)} cases x {len(ENVIRONMENTS)} environments in {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
