"""What the torch-side sections share: the device, random draws on it, TF32 for fp32
references, flavors, host-sync counting, a one-rank process group, and a failed row's
one-line reason."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import time
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402


def device(dry: bool) -> torch.device:
    if dry:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise SystemExit("gpu_check: no CUDA device; run with --dry on a CPU")
    torch.cuda.set_device(0)
    return torch.device("cuda", 0)


def generator(dev: torch.device, seed: int = 0) -> torch.Generator:
    """A generator on `dev`: tensors are drawn where they are used (a CPU draw and a copy of
    ~10^8 values costs seconds)."""
    return torch.Generator(device=dev).manual_seed(seed)


def randn(*shape, dev: torch.device, gen: torch.Generator, dtype=torch.float32, scale: float = 1.0) -> torch.Tensor:
    """`scale` x N(0, 1) drawn on `dev` in fp32, then cast (the same values for every dtype)."""
    x = torch.randn(*shape, device=dev, generator=gen)
    return (x * scale if scale != 1.0 else x).to(dtype)


@contextlib.contextmanager
def tf32():
    """fp32 matmuls in TF32 (`torch.set_float32_matmul_precision("high")`: cuBLAS's TF32, set
    through the one API that torch 2.9+ does not mix up with its newer `fp32_precision`
    switches) for fp32 references: ~7x IEEE fp32's speed on an H200, and 2^-11 relative,
    far inside the bf16 tolerances they check."""
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def timed(fn, dev: torch.device) -> float:
    """Seconds `fn()` takes, synchronised at both ends (queued GPU work neither before nor after)."""
    sync(dev)
    t0 = time.perf_counter()
    fn()
    sync(dev)
    return time.perf_counter() - t0


def register_flavor(model: str, base: str, name: str, **overrides) -> str:
    from models import get_model_spec

    flavors = get_model_spec(model).flavors
    flavors[name] = dataclasses.replace(flavors[base], **overrides)
    return name


def reason(e: BaseException) -> str:
    """One line: the exception type and its first line, short."""
    first = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
    return f"{type(e).__name__}: {first}"


class _ItemCounter(torch.utils._python_dispatch.TorchDispatchMode):
    """CPU stand-in for the sync debug mode: counts `aten::_local_scalar_dense` (what `.item()`
    and a data-dependent `if` run). Only what runs eagerly is seen."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.count += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def count_syncs(dev: torch.device, compiled: bool = False):
    """Yields a dict whose "n" is, afterwards, the host syncs of the block: on CUDA every
    synchronizing call that `torch.cuda.set_sync_debug_mode("warn")` reports (syncs inside
    kernels, e.g. repeat_interleave without output_size, included: the profiler's
    `_local_scalar_dense` misses those); on CPU the `_local_scalar_dense` calls, eager code
    only (a dispatch mode would turn compiled frames off)."""
    box = {"n": 0, "how": "sync debug" if dev.type == "cuda" else "item, CPU"}
    if dev.type != "cuda" and compiled:
        box.update(n="n/a", how="CPU + compile")
        yield box
    elif dev.type == "cuda":
        sync(dev)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                yield box
            finally:
                torch.cuda.set_sync_debug_mode(0)
                box["n"] = sum("synchroniz" in str(w.message) for w in caught)
    else:
        counter = _ItemCounter()
        with counter:
            yield box
        box["n"] = counter.count


@contextlib.contextmanager
def one_rank_group(dev: torch.device):
    """The default process group on a world of one (NCCL on CUDA, bound to the device, as the
    trainer needs; gloo on CPU), destroyed on the way out (an NCCL group left to the
    interpreter's exit can hang it or warn); yields the backend."""
    import torch.distributed as dist

    backend = "nccl" if dev.type == "cuda" else "gloo"
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    kwargs = {"device_id": dev} if dev.type == "cuda" else {}
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, **kwargs)
    try:
        yield backend
    finally:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        dist.destroy_process_group()


def gib(n_bytes: float) -> str:
    return f"{n_bytes / 2**30:.2f}"
