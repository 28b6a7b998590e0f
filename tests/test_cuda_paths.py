"""CUDA-only code paths, checked on CPU where the decision is made in Python: NCCL's eager
start-up with device_id; the host reads of an EP MoE step (which sync a GPU)."""

from __future__ import annotations

import json
import os
import sys

import torch

from tests.helpers import REPO, free_port, run_killing_group
from trainer import distributed


def test_nccl_starts_eagerly_with_device_id(monkeypatch):
    calls = []
    monkeypatch.setattr(distributed, "_timeout_s", None)  # init_distributed sets it
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: calls.append(("set_device", device)))
    monkeypatch.setattr(distributed.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(distributed.dist, "init_process_group", lambda **kw: calls.append(("init", kw)))
    cuda = torch.device("cuda", 1)
    assert distributed.init_distributed(cuda, 30) == "nccl"
    assert calls[0] == ("set_device", cuda)
    assert calls[1][1]["backend"] == "nccl" and calls[1][1]["device_id"] == cuda  # NCCL bound and started now
    calls.clear()
    assert distributed.init_distributed(torch.device("cpu"), 30) == "gloo"
    assert calls == [("init", {"backend": "gloo", "timeout": calls[0][1]["timeout"]})]  # gloo: no device_id


def test_expert_parallel_reads_the_host_once_per_moe_layer_and_never_in_the_recompute():
    """tests/sync_worker.py: the real EP dispatcher on a one-rank gloo mesh, op AC. The forward
    reads the split sizes once per MoE layer (`.tolist()`); nothing else syncs (before:
    repeat_interleave without output_size, once per layer in the forward and again in the
    recompute). The recompute's `.tolist()` calls are CPU-only: on CUDA the op policy saves
    their device-to-host copy (`is_device_to_host`), so they read nothing."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = run_killing_group([sys.executable, "-m", "tests.sync_worker", str(free_port())], cwd=REPO, env=env,
                             timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    reads = json.loads(proc.stdout.strip().splitlines()[-1])
    assert reads["moe_layers"] == 2
    assert reads["forward"] == {"tolist": 2}, reads
    assert set(reads["backward"]) <= {"tolist"}, reads  # no hidden sync in the recompute or the backward
