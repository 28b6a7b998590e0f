"""CUDA-only code paths, checked on CPU where the decision is made in Python: NCCL's eager
start-up with device_id."""

from __future__ import annotations

import torch

from trainer import distributed


def test_nccl_starts_eagerly_with_device_id(monkeypatch):
    calls = []
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
