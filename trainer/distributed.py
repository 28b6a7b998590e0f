"""Process-group start-up, device choice and seeding.

One code path everywhere: NCCL on GPUs, gloo on CPU. A single process without
torchrun (or WORLD_SIZE=1) runs without any process group at all.
"""

from __future__ import annotations

import datetime
import os
import random

import numpy as np
import torch
import torch.distributed as dist


def pick_device(preference: str = "auto") -> torch.device:
    if preference == "cuda" or (preference == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            from trainer.configurable import ConfigError
            raise ConfigError("config error: training.device: cuda requested but no GPU is visible; "
                              "use --training.device cpu or auto")
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def init_distributed(device: torch.device, timeout_s: int) -> str | None:
    """Initialises the default process group when WORLD_SIZE > 1; returns the backend."""
    if world_size() == 1:
        return None
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=timeout_s))
    return backend


def set_collective_timeout(timeout_s: int) -> None:
    """Shortens the timeout after start-up so that a hung rank fails the job quickly."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        from torch.distributed.distributed_c10d import _set_pg_timeout
        _set_pg_timeout(datetime.timedelta(seconds=timeout_s))


def set_seed(seed: int, deterministic: bool) -> None:
    """The same seed on every rank, so that dropout masks and any replicated random
    choices agree across ranks."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    if deterministic:
        torch.use_deterministic_algorithms(True, warn_only=False)
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")


def resolve_dtype(name: str, device: torch.device, allow_on_cpu: bool) -> torch.dtype:
    """bf16 where it is fast and supported; fp32 on CPU unless explicitly asked."""
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[name]
    if dtype == torch.bfloat16:
        if device.type == "cpu" and not allow_on_cpu:
            return torch.float32
        if device.type == "cuda" and not torch.cuda.is_bf16_supported():
            return torch.float32
    return dtype


def destroy() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
