"""Two torchft replica groups sharing one checkpoint folder, through ./run_train.sh: saves in progress,
whole-job restarts and preemption (real torchft, a real lighthouse, gloo, hard timeouts).

One scenario, three runs of the tiny model, 1 rank per group, checkpoints every 4 steps:

1. Group 1 starts alone and trains (group 0 is away); at step 4 it is held inside its save, after
   writing and before the commit. Group 0 starts meanwhile: its start-up repairs only its own
   leftovers, so group 1's save in progress survives; its quorum waits out the save (longer than
   the quorum timeout: a group that is alive but busy holds the quorum) instead of crashing. Then
   the save commits, group 0 heals from group 1, and both are killed after step 6.
2. A whole-job restart: both groups resume from step-4, which group 1 saved while group 0 was away.
   Group 0 takes its data position from group 1's slice (a global batch index): every step's data
   position equals the first run's, so no sample is read twice; the losses repeat bitwise.
3. SIGUSR1 to both groups: each stops after its step, only the saving group writes the checkpoint,
   and both exit 75 (the requeue code, trainer/preemption.py), not 0.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time

import pytest

from tests.ft_helpers import start_group, start_lighthouse
from tests.helpers import read_metrics
from trainer.checkpoint_files import is_complete, list_checkpoints
from trainer.preemption import PREEMPTED_EXIT

ARGS = ["--config", "llama_debug.toml", "--model.flavor", "debug_small", "--training.seq_len", "64",
        "--training.local_batch_size", "2", "--metrics.log_freq", "1", "--metrics.enable_tensorboard", "false",
        "--lr_scheduler.warmup_steps", "2", "--training.steps", "9", "--checkpoint.enable",
        "--checkpoint.interval", "4", "--fault_tolerance.group_count", "2",
        "--fault_tolerance.quorum_timeout_seconds", "3", "--fault_tolerance.heal_timeout_seconds", "10"]


def _positions(folder) -> dict[int, tuple]:
    """Each logged step's data position: the samples drawn from every source so far (global)."""
    return {r["step"]: tuple(v for k, v in sorted(r.items()) if k.startswith("data/tokens/"))
            for r in read_metrics(folder)}


@pytest.mark.slow
@pytest.mark.multirank
@pytest.mark.timeout(600)
def test_two_groups_share_saves_restarts_and_preemption(tmp_path):
    lighthouse, address = start_lighthouse(tmp_path, min_replicas=1)
    args = [*ARGS, "--fault_tolerance.lighthouse", address, "--job.dump_folder", str(tmp_path / "run")]
    folder = tmp_path / "run" / "checkpoint"
    hold = tmp_path / "hold"
    procs = []
    try:
        # ---- 1. a save in progress while the other group starts ----
        killed_at_6 = {"TITAN_CHECKPOINT_CRASH_AT": "step_end@6"}
        saver = start_group(1, 1, args, {**killed_at_6, "TITAN_CHECKPOINT_HOLD_AT": f"after_write@4={hold}"},
                            run_train=True)
        procs.append(saver)
        deadline = time.time() + 240
        while not hold.exists():
            assert time.time() < deadline and saver.popen.poll() is None, saver.text()[-4000:]
            time.sleep(0.1)
        assert [p.name for p in folder.iterdir() if p.name.startswith("step-4")] == ["step-4.replica-1.tmp"]
        joiner = start_group(0, 1, args, killed_at_6, run_train=True)
        procs.append(joiner)
        joiner.wait_for(r"no quorum at step 1 after", 240)  # started (repairs done), waiting: not crashed
        assert (folder / "step-4.replica-1.tmp").is_dir()
        hold.unlink()  # the save goes on
        assert saver.wait(240) != 0 and joiner.wait(240) != 0  # both killed at the end of step 6
        assert re.search(r"healed from a live peer at step 4", joiner.text()), joiner.text()[-4000:]
        assert [s for s, _ in list_checkpoints(folder)] == [4] and is_complete(folder / "step-4")
        first = {g: _positions(tmp_path / "run" / f"replica-{g}") for g in (0, 1)}
        first_loss = {g: {r["step"]: r["loss"] for r in read_metrics(tmp_path / "run" / f"replica-{g}")}
                      for g in (0, 1)}
        assert sorted(first[1]) == [1, 2, 3, 4, 5, 6] and sorted(first[0]) == [5, 6]

        # ---- 2. a whole-job restart, then 3. a stop signal to every group ----
        at_6 = {0: False, 1: False}

        def watch(g):
            def on_line(line):
                if re.search(r"step +6 \|", line):
                    at_6[g] = True
            return on_line

        slow = {"TITAN_TEST_SLOW_RANK": "0:0.5@6"}  # time for the signal to land before the last step
        groups = [start_group(g, 1, args, slow, on_line=watch(g), run_train=True) for g in (0, 1)]
        procs += groups
        deadline = time.time() + 240
        while not all(at_6.values()):
            assert time.time() < deadline and all(p.popen.poll() is None for p in groups), groups[0].text()[-3000:]
            time.sleep(0.05)
        for p in groups:
            os.kill(p.popen.pid, signal.SIGUSR1)  # run_train.sh execs the launcher: it forwards the signal
        codes = [p.wait(240) for p in groups]
    finally:
        for p in [lighthouse, *procs]:
            p.kill()

    texts = [p.text() for p in groups]
    assert codes == [PREEMPTED_EXIT] * 2, [t[-3000:] for t in texts]
    assert all("starting at step 4" in t for t in texts), [t[-3000:] for t in texts]
    # Group 0 resumed at group 1's data position: every step's position is the first run's.
    for g in (0, 1):
        again = _positions(tmp_path / "run" / f"replica-{g}")
        assert again[5] == first[1][5] and again[6] == first[1][6], (g, again, first[1])
        losses = {r["step"]: r["loss"] for r in read_metrics(tmp_path / "run" / f"replica-{g}")}
        assert losses[5] == first_loss[1][5] and losses[6] == first_loss[1][6], g
    # Only the saving group wrote the stop checkpoint; the others stopped without one.
    saved = {g: [int(s) for s in re.findall(r"preemption signal received: saving a checkpoint at step (\d+)", t)]
             for g, t in enumerate(texts)}
    stopped = {g: [int(s) for s in re.findall(r"preemption signal received: stopping at step (\d+)", t)]
               for g, t in enumerate(texts)}
    assert sorted(len(saved[g]) + len(stopped[g]) for g in (0, 1)) == [1, 1], (saved, stopped)
    assert saved[0] or saved[1], (saved, stopped)
    newest = max(s for ss in saved.values() for s in ss)
    assert [s for s, _ in list_checkpoints(folder)][-1] == newest and is_complete(folder / f"step-{newest}")
    manifest = json.loads((folder / f"step-{newest}" / "manifest.json").read_text())
    assert manifest["step"] == newest and manifest["kind"] == "full"
    assert not [p.name for p in folder.iterdir() if p.name.endswith(".tmp")]
