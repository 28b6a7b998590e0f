"""Process-group start-up, device choice and seeding.

One code path everywhere: NCCL on GPUs, gloo on CPU. A single process without
torchrun (or WORLD_SIZE=1) runs without any process group at all.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import os
import random
import sys
import threading
from typing import NoReturn

import numpy as np
import torch
import torch.distributed as dist


def pick_device(preference: str = "auto") -> torch.device:
    if preference == "cuda" or (preference == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            from configuration.fields import ConfigError
            raise ConfigError("config error: training.device: cuda requested but no GPU is visible; "
                              "use --training.device cpu or auto")
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def init_distributed(device: torch.device, timeout_s: int, cpu_collectives: bool = False) -> str | None:
    """Initialises the default process group when WORLD_SIZE > 1; returns the backend.

    `cpu_collectives` (fsdp_cpu_offload on a GPU): the sharded parameters, gradients and
    optimizer states live in host memory, and what reads them across ranks (gradient
    clipping's norm, Muon's assembly, a checkpoint's gather) runs collectives on CPU tensors,
    which NCCL cannot. Every group then carries gloo for CPU tensors beside NCCL."""
    global _timeout_s
    if world_size() == 1:
        return None
    backend = "gloo"
    if device.type == "cuda":
        backend = "cuda:nccl,cpu:gloo" if cpu_collectives else "nccl"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        # device_id on CUDA: NCCL creates the default communicator now (eagerly, bound to this
        # GPU) instead of at the first collective, so an init failure shows here, and the mesh's
        # sub-groups are split from it (ncclCommSplit) rather than each bootstrapped anew.
        kwargs = {"device_id": device} if device.type == "cuda" else {}
        dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=timeout_s), **kwargs)
    _timeout_s = timeout_s
    return backend


# Collective timeouts. Start-up (rendezvous, first compile, first collectives) gets
# comm.init_timeout_seconds; after step 1 every group drops to comm.train_timeout_seconds,
# so that a rank that stopped is found in seconds, not after the start-up bound (on gloo as
# on NCCL: mesh sub-groups included, since a dead peer is first waited for in an FSDP or TP
# collective, not on the default group). Checkpoint saves run under a longer bound
# (`collective_timeout`): 8B's synchronous save writes ~12 GB per rank, longer than 120 s
# on many file systems, while the other ranks wait in DCP's barrier.
_timeout_s: int | None = None
_exempt: list = []  # groups with their own timeout (the async checkpoint group)


def exempt_from_train_timeout(group) -> None:
    _exempt.append(group)


def _groups() -> list:
    from torch.distributed.distributed_c10d import _rank_not_in_group, _world

    return [pg for pg in list(_world.pg_map) if not _rank_not_in_group(pg) and not any(pg is e for e in _exempt)]


def set_collective_timeout(timeout_s: int) -> None:
    """Sets the timeout of every process group this rank is in (gloo and NCCL)."""
    global _timeout_s
    if not dist.is_initialized():
        return
    from torch.distributed.distributed_c10d import _set_pg_timeout

    for group in _groups():
        _set_pg_timeout(datetime.timedelta(seconds=timeout_s), group)
    _timeout_s = timeout_s


def current_collective_timeout() -> int | None:
    return _timeout_s


@contextlib.contextmanager
def collective_timeout(timeout_s: int):
    """Raises every group's timeout to at least `timeout_s` inside the block (checkpoint saves),
    then puts the previous one back."""
    previous = _timeout_s
    if not dist.is_initialized() or previous is None or previous >= timeout_s:
        yield
        return
    set_collective_timeout(timeout_s)
    try:
        yield
    finally:
        set_collective_timeout(previous)


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


def destroy() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def exit_process(code: int) -> NoReturn:
    """Ends a process that ran collectives: joins its threads, runs the atexit handlers, flushes,
    and leaves with os._exit instead of the interpreter's finalization.

    Why: a gloo worker thread frees each finished collective's Work after the caller has resumed.
    When that Work holds the last reference to a tensor whose Python object was dropped, freeing
    it takes the GIL. If the main thread is in Py_Finalize by then, Python 3.11 ends the worker
    with pthread_exit, whose unwinding crosses a noexcept destructor: std::terminate, SIGABRT,
    and a finished run reported as a crash (about 1 launch in 10 on a loaded 2-core machine).
    destroy_process_group() does not stop those threads (FSDP's mesh info keeps the group alive),
    so the only safe exit is one that never starts finalizing."""
    threading._shutdown()  # what finalization does first: stop thread pools, join non-daemon threads
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)
