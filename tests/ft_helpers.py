"""Helpers of the fault-tolerance tests: process groups with their output kept line by line, a real
torchft lighthouse, one replica group per launcher, and each rank's final state
(TITAN_TEST_FT_STATE) compared bitwise across groups."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

from tests.helpers import REPO, read_metrics

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}  # lines as they come
STEP_LINE = re.compile(r"step +(\d+) \| loss +([\d.]+)")


class Proc:
    """A process group started in its own session; its output lines are kept with arrival times."""

    def __init__(self, cmd: list[str], env: dict, on_line=None):
        self.popen = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True, start_new_session=True)
        self.lines: list[tuple[float, str]] = []
        self.on_line = on_line
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self):
        for line in self.popen.stdout:
            self.lines.append((time.time(), line))
            if self.on_line is not None:
                self.on_line(line)

    def kill(self):
        try:
            os.killpg(self.popen.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.popen.wait()

    def wait(self, timeout: float) -> int:
        try:
            rc = self.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"timed out after {timeout} s:\n{self.text()[-4000:]}") from None
        self.reader.join(10)
        return rc

    def text(self) -> str:
        return "".join(ln for _, ln in self.lines)

    def wait_for(self, pattern: str, timeout: float) -> re.Match:
        """The first output line matching `pattern`; fails if the process ends or time runs out first."""
        deadline = time.time() + timeout
        while True:
            found = re.search(pattern, self.text())
            if found:
                return found
            assert time.time() < deadline and self.popen.poll() is None, \
                f"no {pattern!r} (rc {self.popen.poll()}):\n{self.text()[-4000:]}"
            time.sleep(0.1)


def start_lighthouse(folder: Path, min_replicas: int) -> tuple[Proc, str]:
    address_file = folder / "lighthouse"
    proc = Proc([sys.executable, "-m", "trainer.fault_tolerance.lighthouse", "--port", "0", "--min-replicas",
                 str(min_replicas), "--address-file", str(address_file)], ENV)
    deadline = time.time() + 60
    while not address_file.exists():
        assert time.time() < deadline and proc.popen.poll() is None, proc.text()
        time.sleep(0.1)
    return proc, address_file.read_text().strip()


def start_group(replica_id: int, nproc: int, args: list[str], env: dict | None = None, on_line=None,
                run_train: bool = False) -> Proc:
    """One replica group: `python -m trainer.launch` (or ./run_train.sh) with `args`."""
    ft = ["--fault_tolerance.enable", "--fault_tolerance.replica_id", str(replica_id)]
    if run_train:
        return Proc(["./run_train.sh", *args, *ft], {**ENV, "NGPU": str(nproc), **(env or {})}, on_line)
    return Proc([sys.executable, "-m", "trainer.launch", "--standalone", "--nnodes", "1", "--nproc-per-node",
                 str(nproc), "-m", "trainer.train", *args, *ft], {**ENV, **(env or {})}, on_line)


def losses(folder: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(folder)}


def assert_groups_bitwise_equal(state: Path, ranks: int) -> list[dict]:
    """Every rank's parameters and buffers (the MoE expert bias included), optimizer state, param
    groups, LR schedule and data position are bitwise equal in replica groups 0 and 1; returns
    group 0's states."""
    import json

    out = []
    for r in range(ranks):
        a, b = (torch.load(f"{state}-replica{g}-rank{r}.pt", weights_only=False) for g in (0, 1))
        assert a["step"] == b["step"], (r, a["step"], b["step"])
        for names, part_a, part_b in zip(a["model_names"], a["model"], b["model"], strict=True):
            # (aux_loss: each rank's share of its last forward's balance loss, for logging only)
            same = [n for n, x, y in zip(names, part_a, part_b, strict=True) if n.endswith("aux_loss") or
                    torch.equal(x, y)]
            assert same == names, (r, sorted(set(names) - set(same))[:5])
        for opt_a, opt_b in zip(a["optimizers"], b["optimizers"], strict=True):
            for x, y in zip(opt_a, opt_b, strict=True):
                assert x.keys() == y.keys() and all(
                    torch.equal(x[k], y[k]) if isinstance(x[k], torch.Tensor) else x[k] == y[k] for k in x), r
        assert a["lr_schedulers"] == b["lr_schedulers"] and a["param_groups"] == b["param_groups"], r
        assert json.loads(a["data"]["loader_state"])["position"] == json.loads(b["data"]["loader_state"])["position"]
        out.append(a)
    return out
