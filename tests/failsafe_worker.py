"""2-rank gloo checks of the collective timeouts and the async-commit agreement, in one launch.

    python -m torch.distributed.run --nproc-per-node 2 tests/failsafe_worker.py CASES.json OUT_DIR

Each case writes OUT_DIR/<name>.rank<R>.json with what it observed; tests/test_failsafe_multirank.py
asserts on them. Cases: "timeouts" (trainer.distributed on gloo: the train timeout reaches
sub-groups, a save's longer bound lifts it and puts it back), "async_commit" (an async save is
committed at the first step boundary where every rank's write is done, not before, and not
only at the next save; a stop asked of one rank reaches both, on the step's loss all-reduce).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _barrier_after(group, rank: int, sleep_s: float) -> list:
    if rank == 1:
        time.sleep(sleep_s)
    t0 = time.time()
    try:
        dist.barrier(group=group)
        return ["ok", round(time.time() - t0, 2)]
    except Exception as e:  # noqa: BLE001 - the timeout is the observation
        return [type(e).__name__, round(time.time() - t0, 2)]


def timeouts(case: dict, out: Path) -> dict:
    from trainer import distributed as tdist

    rank = dist.get_rank()
    sub = dist.new_group([0, 1])  # like a mesh group: created before the timeout drops
    tdist._timeout_s = 300  # as init_distributed leaves it
    tdist.set_collective_timeout(1)
    seen = {}
    with tdist.collective_timeout(60):  # a save: rank 1 is 3 s late, within the save bound
        seen["inside_save"] = _barrier_after(sub, rank, 3)
    seen["timeout_after_save"] = tdist.current_collective_timeout()
    seen["after_save"] = _barrier_after(sub, rank, 3)  # 3 s late against the 1 s train bound
    tdist.set_collective_timeout(300)  # the next case starts with a generous bound, in step again
    dist.barrier()
    return seen


def async_commit(case: dict, out: Path) -> dict:
    from tests.helpers import TINY
    from trainer.checkpoint import list_checkpoints
    from trainer.config import load_config
    from trainer.train import Trainer

    rank = dist.get_rank()
    cfg = load_config(TINY + ["--training.steps", "2", "--checkpoint.enable", "--checkpoint.async_mode", "async",
                              "--job.dump_folder", str(out / "async")], world_size=2)
    trainer = Trainer(cfg)
    ck = trainer.checkpointer
    seen = {}
    try:
        trainer.step = 2
        ck.save(2)
        while not ck._pending.done.done():  # this rank's write, for real
            time.sleep(0.01)
        real = ck.write_finished
        if rank == 1:
            ck.write_finished = lambda: False  # rank 1 reports its write as still running
        # The flags ride on the step's loss all-reduce (no collective of their own).
        result = trainer.train_step(trainer.next_microbatches())
        ck.step_boundary(result.save_busy, 3)
        dist.barrier()
        seen["after_one_busy_rank"] = [s for s, _ in list_checkpoints(ck.folder)]
        seen["stop_before_signal"] = result.stop
        ck.write_finished = real
        if rank == 1:
            trainer.preemption.requested = lambda: True  # only rank 1 is signalled
        result = trainer.train_step(trainer.next_microbatches())
        ck.step_boundary(result.save_busy, 4)
        dist.barrier()
        seen["after_all_done"] = [s for s, _ in list_checkpoints(ck.folder)]
        seen["pending_left"] = ck.has_pending()
        seen["stop_after_signal"] = result.stop
        result = trainer.train_step(trainer.next_microbatches())  # its flag: no save pending
        ck.save(5)  # started after the flag was taken: not committed on that flag's behalf
        ck.step_boundary(result.save_busy, 5)
        seen["later_save_left_pending"] = ck.has_pending()
    finally:
        trainer.close(destroy_process_group=False)
    return seen


def run_case(case: dict, out: Path) -> None:
    seen = {"timeouts": timeouts, "async_commit": async_commit}[case["name"]](case, out)
    (out / f"{case['name']}.rank{dist.get_rank()}.json").write_text(json.dumps(seen))


def main() -> int:
    from tests.helpers import run_worker_cases

    return run_worker_cases(run_case, "FAILSAFE_WORKER_ONLY", timeout_s=120)


if __name__ == "__main__":
    from trainer.distributed import exit_process
    exit_process(main())
