"""A rank whose gloo thread waits for the GIL when the interpreter starts finalizing.

`python -m tests.exit_race_worker RANK PORT MODE`, two ranks. Rank 0 starts an all-reduce, drops
its tensor (the gloo Work now holds the last reference, so freeing it takes the GIL) and keeps
the GIL in a busy loop while rank 1 joins the all-reduce: rank 0's gloo thread is then queued
on the GIL when rank 0 exits. MODE is how it exits: `sys_exit` (the interpreter's finalization,
which hands the GIL to that thread and so kills it with pthread_exit: SIGABRT) or
`exit_process` (trainer.distributed.exit_process)."""

from __future__ import annotations

import sys
import time

import torch
import torch.distributed as dist

from trainer.distributed import exit_process


class _SleepsWhenFreed:
    def __del__(self) -> None:
        time.sleep(0.5)  # releases the GIL after finalization has begun


def _hold_the_gil(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:  # pure bytecode: never releases the GIL
        pass


def main(rank: int, port: int, mode: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    if rank == 1:
        time.sleep(1.0)
        dist.all_reduce(torch.ones(8))
        exit_process(0)
    work = dist.all_reduce(torch.ones(8), async_op=True)
    del work
    sys.setswitchinterval(100.0)  # the waiting gloo thread never asks this one to yield
    _hold_the_gil(3.0)
    global _freed_at_finalization  # module globals are freed after finalization has begun
    _freed_at_finalization = _SleepsWhenFreed()
    if mode == "exit_process":
        exit_process(0)
    sys.exit(0)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
