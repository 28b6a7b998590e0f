"""Runs the sections of the plan, each in its own process group under its own timeout, and
rewrites `<out>/gpu_check.md` after every one (no torch import).

    python -m gpu_check [--dry] [--out DIR] [--only a,b] [--deadline-s S] [--list]

Each section starts with the time its own budget and what earlier sections left unused allow,
keeping the budgets of the core sections still to run (`plan.start_timeout`); the plan, each
budget with its basis and their sum are the first lines of the log (and `--list`).

Everything lands in DIR as it happens: rows/<section>.json (each section's rows), env.json and
env.md (the env section's report), gpu_check.log (every section's output), status.json (what
ran, how it ended) and gpu_check.md (the table). SIGTERM/SIGINT stop the running section,
mark it and write the table; a SIGKILL of this process is seen by the section itself, which
then kills its own group (`sections.watch_parent`), so nothing keeps writing after it.
Exit status: 0 when no row FAILED or MISMATCHed, 1 otherwise, 2 for a bad argument.
"""

from __future__ import annotations

import argparse
import datetime
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from gpu_check import report
from gpu_check.plan import BY_NAME, DEADLINE_S, DRY_SCALE, PLAN, plan_lines, start_timeout
from gpu_check.rows import write_json

# Files of a previous run in the same folder: removed first, so the table never mixes runs.
_RESULT_FILES = ("status.json", "env.json", "env.md", "gpu_check.log", report.TABLE)


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


class Driver:
    def __init__(self, out: Path, names: list[str], dry: bool, deadline_s: float, dry_plan: bool = False):
        self.out, self.names, self.dry, self.deadline_s = out, names, dry, deadline_s
        self.dry_plan = dry_plan  # --dry without --only: sections with `dry_as` are listed, not run
        self.scale = DRY_SCALE if dry else 1
        self.t0 = time.monotonic()
        self.child: subprocess.Popen | None = None
        self.current: str | None = None
        self.status = {"dry": dry, "deadline_s": deadline_s, "started_at": _now(), "elapsed_s": 0.0,
                       "sections": {n: {"state": "pending"} for n in names}}
        out.mkdir(parents=True, exist_ok=True)
        for name in _RESULT_FILES:
            (out / name).unlink(missing_ok=True)
        for old in (out / "rows").glob("*.json"):
            old.unlink()
        self.log = open(out / "gpu_check.log", "a", buffering=1)

    def save(self) -> bool:
        self.status["elapsed_s"] = round(time.monotonic() - self.t0, 1)
        write_json(self.out / "status.json", self.status)
        return report.render(self.out)[1]

    def say(self, line: str) -> None:
        print(line, file=sys.stderr, flush=True)
        self.log.write(line + "\n")

    def _tee(self, stream) -> None:
        for line in iter(stream.readline, ""):
            sys.stderr.write(line)
            self.log.write(line)
        stream.close()

    def run_section(self, name: str, timeout_s: float) -> dict:
        cmd = [sys.executable, "-m", "gpu_check", "section", name, "--out", str(self.out)] + (["--dry"] if self.dry else [])
        self.say(f"== {name} (budget {BY_NAME[name].budget_s * self.scale} s, timeout {timeout_s:.0f} s, {_now()})")
        t0 = time.monotonic()
        self.child = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                      start_new_session=True)  # its own group: a timeout kills its workers too
        tee = threading.Thread(target=self._tee, args=(self.child.stdout,), daemon=True)
        tee.start()
        try:
            rc = self.child.wait(timeout=timeout_s)
            state = {"state": "exit", "rc": rc}
        except subprocess.TimeoutExpired:
            self.kill_child()
            state = {"state": "timeout"}
        tee.join(timeout=5)
        self.child = None
        return {**state, "timeout_s": round(timeout_s, 1), "budget_s": BY_NAME[name].budget_s * self.scale,
                "wall_s": round(time.monotonic() - t0, 1)}

    def kill_child(self) -> None:
        if self.child is not None and self.child.poll() is None:
            try:
                os.killpg(self.child.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.child.wait()

    def on_signal(self, signum, _frame) -> None:
        self.kill_child()
        if self.current is not None:
            self.status["sections"][self.current] = {"state": "killed",
                                                     "wall_s": round(time.monotonic() - self.t0, 1)}
        self.status["stopped"] = f"signal {signal.Signals(signum).name} at {_now()}"
        self.say(f"gpu_check: stopped by {signal.Signals(signum).name}; table in {self.out / report.TABLE}")
        self.save()
        os._exit(128 + signum)

    def reserved_after(self, i: int) -> float:
        """The budgets of the core sections that run after the i-th (they keep them whole)."""
        return sum(BY_NAME[n].budget_s * self.scale for n in self.names[i + 1:] if BY_NAME[n].core)

    def run(self) -> int:
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, self.on_signal)
        self.save()
        scale = f" (x{self.scale} with --dry)" if self.scale != 1 else ""
        self.say(f"== plan: budgets in seconds on a GPU{scale}, deadline {self.deadline_s:.0f} s")
        for line in plan_lines():
            self.say(line)
        for i, name in enumerate(self.names):
            left = self.deadline_s - (time.monotonic() - self.t0)
            timeout_s, why = start_timeout(BY_NAME[name], left, self.reserved_after(i), self.scale)
            if self.dry_plan and BY_NAME[name].dry_as:
                timeout_s, why = None, f"skipped: not in the --dry plan (its code runs in {BY_NAME[name].dry_as}, " \
                                       f"other flags); --dry --only {name} runs it"
            if timeout_s is None:
                self.status["sections"][name] = {"state": "skipped", "why": why}
                self.say(f"== {name}: {why}")
            else:
                self.current = name
                self.status["sections"][name] = {"state": "running", "timeout_s": round(timeout_s, 1),
                                                 "budget_s": BY_NAME[name].budget_s * self.scale}
                self.save()
                self.status["sections"][name] = self.run_section(name, timeout_s)
                self.current = None
            self.save()
        self.status["finished_at"] = _now()
        ok = self.save()
        text = (self.out / report.TABLE).read_text()
        print(text, end="")
        self.say(f"table written to {self.out / report.TABLE}")
        return 0 if ok else 1


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="scripts/gpu_check.sh", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry", action="store_true", help="CPU, tiny shapes, one section per code path (what the "
                        "test suite runs; --only runs any section)")
    parser.add_argument("--out", default="out/gpu_check", help="the results folder (default out/gpu_check)")
    parser.add_argument("--only", default="", help="comma-separated sections to run, in plan order")
    parser.add_argument("--deadline-s", type=float, default=None,
                        help=f"stop starting sections after this (default {DEADLINE_S} s; x{DRY_SCALE} with --dry)")
    parser.add_argument("--list", action="store_true", help="print the plan (each section's budget, its basis, "
                        "the sum) and exit")
    args = parser.parse_args(argv)
    if args.list:
        print("\n".join(plan_lines()))
        return 0
    names = [s.name for s in PLAN]
    if args.only:
        wanted = [n.strip() for n in args.only.split(",") if n.strip()]
        unknown = [n for n in wanted if n not in BY_NAME]
        if unknown:
            print(f"gpu_check.sh: --only: unknown section(s) {', '.join(unknown)}; see --list", file=sys.stderr)
            return 2
        names = [n for n in names if n in wanted]
    deadline = args.deadline_s if args.deadline_s is not None else DEADLINE_S * (DRY_SCALE if args.dry else 1)
    return Driver(Path(args.out).resolve(), names, args.dry, deadline, dry_plan=args.dry and not args.only).run()
