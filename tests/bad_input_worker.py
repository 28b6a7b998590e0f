"""Runs many bad-input cases' pre-launch check in one Python process, each as `./run_train.sh`
runs it (`python -m trainer.launch --check-config --shell ARGS`, or `--dry-run ARGS`, with
`--config llama_debug.toml` when ARGS name none and TITAN_CHECK_WORLD_SIZE from NGPU),
with file descriptors 1 and 2 captured per case. One Python start-up instead of one per case
(tests/test_bad_inputs.py still sends a few of them, and every case the shell or a worker
finds, through the real `./run_train.sh`).

    python -m tests.bad_input_worker CASES.json    # [{"argv": [...], "ngpu": "1"}, ...]

Prints a JSON list of {"rc", "stdout", "stderr"}, one per case, as its last line.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _exit_code(e: SystemExit) -> int:
    if e.code is None or isinstance(e.code, int):
        return e.code or 0
    print(e.code, file=sys.stderr)  # what the interpreter does with a SystemExit("message")
    return 1


def run_case(argv: list[str], ngpu: str) -> dict:
    from trainer.launch import main as launch_main

    if not any(a.split("=")[0] in ("--config", "--job.config_file") for a in argv):
        argv = ["--config", "llama_debug.toml", *argv]
    dry = any(a in ("--dry-run", "--dry_run", "--job.dry_run", "--job.dry_run=true", "--dry-run=true") for a in argv)
    os.environ["TITAN_CHECK_WORLD_SIZE"] = ngpu
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        sys.stdout.flush()
        sys.stderr.flush()
        saved = os.dup(1), os.dup(2)
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        try:
            try:
                rc = launch_main(["--dry-run", *argv] if dry else ["--check-config", "--shell", *argv])
            except SystemExit as e:
                rc = _exit_code(e)
            except BaseException:  # noqa: BLE001 - what the interpreter would print: a traceback, exit 1
                traceback.print_exc()
                rc = 1
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])
        out.seek(0)
        err.seek(0)
        return {"rc": rc, "stdout": out.read().decode(errors="replace"), "stderr": err.read().decode(errors="replace")}


def main(path: str) -> None:
    results = [run_case(case["argv"], case["ngpu"]) for case in json.loads(Path(path).read_text())]
    print(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1])
