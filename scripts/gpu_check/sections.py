"""One section in its own process: `python -m gpu_check section NAME --out DIR [--dry]`.

The process is its own group's leader (the driver starts it so); `watch_parent` kills that
group when the driver disappears (SIGKILLed, say), so no section keeps writing to a folder
whose run was stopped.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
from pathlib import Path

from gpu_check.plan import BY_NAME
from gpu_check.rows import Rows


def watch_parent(interval_s: float = 0.5) -> None:
    parent = os.getppid()

    def loop():
        while True:
            time.sleep(interval_s)
            if os.getppid() != parent:
                os.killpg(os.getpgrp(), signal.SIGKILL)

    threading.Thread(target=loop, daemon=True).start()


def run(name: str, rows: Rows, dry: bool, out: Path) -> None:
    """Imports the section's module only now: a missing package fails its own section."""
    import importlib

    section = BY_NAME[name]
    module = importlib.import_module(f"gpu_check.{section.module}")
    if name == "env":
        module.run(rows, dry, out)
    elif section.llama is not None:
        module.run_llama(rows, dry, *section.llama)
    else:
        getattr(module, f"run_{name}")(rows, dry)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m gpu_check section")
    parser.add_argument("name", choices=sorted(BY_NAME))
    parser.add_argument("--out", required=True)
    parser.add_argument("--dry", action="store_true")
    args = parser.parse_args(argv)
    if os.getpgrp() == os.getpid():
        watch_parent()
    rows = Rows(Path(args.out), args.name)
    import logging

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s", stream=sys.stdout)
    run(args.name, rows, args.dry, Path(args.out))
    rows.done()
    return 0
