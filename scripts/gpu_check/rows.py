"""A section's rows, written to `<out>/rows/<section>.json` as they happen (no torch import).

Each write replaces the file atomically, so a section killed at any point leaves every row
it finished. A row in progress carries `"result": "running"` and the phase it is in; the
report turns a row left running by a timeout into "cut off during <phase>: not counted".
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from gpu_check.numbers import COLUMN as NUMBERS_COLUMN

ANCHOR_COLUMN = "TorchTitan, 8 x H100 500 W"
COLUMNS = ("section", "config", "tokens/s (32L)", "MFU %", ANCHOR_COLUMN, "MFU causal %", "alloc GiB", "reserved GiB",
           "estimator GiB", "syncs/step", NUMBERS_COLUMN, "result")


def write_json(path: Path, data) -> None:
    """Writes `data` to `path` atomically (a reader never sees half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


class Rows:
    """The rows of one section; `emit` and `progress` rewrite its file."""

    def __init__(self, out: Path | None, section: str):
        self.path = None if out is None else Path(out) / "rows" / f"{section}.json"
        self.section = section
        self.rows: list[dict] = []
        self._running: dict | None = None
        self._t0 = time.monotonic()

    def _flush(self) -> None:
        if self.path is not None:
            write_json(self.path, self.rows + ([self._running] if self._running else []))

    def progress(self, config: str, phase: str) -> None:
        """Marks `config` as running `phase` (e.g. "compile + warm-up, 2 layers")."""
        self._running = {"section": self.section, "config": config, "result": "running",
                         "phase": phase, "elapsed_s": round(time.monotonic() - self._t0, 1)}
        self._flush()

    @property
    def phase(self) -> str:
        """The phase of the running row ("" when none)."""
        return self._running["phase"] if self._running else ""

    def emit(self, row: dict) -> dict:
        """Records a finished row (and ends the running one)."""
        row = {"section": self.section, **row}
        self.rows.append(row)
        self._running = None
        print(json.dumps(row), flush=True)
        self._flush()
        return row

    def done(self) -> None:
        """Called when the section ran to its end: a section that emitted nothing says so."""
        if not self.rows:
            self.emit({"config": "", "result": "FAILED: the section emitted no row"})
        self._flush()
