"""Checkpoints survive a SIGKILL at every point of a save, and damage is refused, not loaded.

The kills are injected (TITAN_CHECKPOINT_CRASH_AT, read by the checkpoint code; see
trainer/checkpoint_files.py), so each test hits its instant every time. After each kill the
run is restarted as a user would, and its losses must be bitwise equal to an uninterrupted
run's: it resumed from the newest complete checkpoint and lost only the steps after it.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO, TINY, run_in_process, run_killing_group
from trainer.checkpoint import CheckpointError, list_checkpoints
from trainer.checkpoint_files import MANIFEST, TMP

STEPS = 6
COMMON = TINY + ["--training.steps", str(STEPS), "--checkpoint.enable", "--checkpoint.interval", "2"]


def _train(dump: Path, *extra: str, crash_at: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    env.pop("TITAN_CHECKPOINT_CRASH_AT", None)
    if crash_at:
        env["TITAN_CHECKPOINT_CRASH_AT"] = crash_at
    cmd = [sys.executable, "-m", "trainer.train", *COMMON, "--job.dump_folder", str(dump), *extra]
    return run_killing_group(cmd, cwd=REPO, env=env, timeout=300)


def _losses(dump: Path) -> dict[int, float]:
    """Loss per step from metrics.jsonl, which holds each step once even across a crash."""
    records = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in records]
    assert steps == sorted(set(steps)), steps
    return {r["step"]: r["loss"] for r in records}


def _resumed_from(proc: subprocess.CompletedProcess) -> int:
    marker = "starting at step "
    line = next(ln for ln in proc.stdout.splitlines() if marker in ln)
    return int(line.rsplit(marker, 1)[1].split()[0])


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[int, float]:
    dump = tmp_path_factory.mktemp("reference")
    proc = _train(dump)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return _losses(dump)


def _crash_then_resume(dump: Path, crash_at: str, *extra: str) -> int:
    crashed = _train(dump, *extra, crash_at=crash_at)
    assert crashed.returncode == -signal.SIGKILL, (crashed.returncode, crashed.stderr[-3000:])
    resumed = _train(dump)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    return _resumed_from(resumed)


@pytest.mark.slow
@pytest.mark.parametrize("crash_at, extra, resume_step", [
    # inside the background write of step 4 (data written, not its metadata): step 2 is the newest
    ("async_write@4", ["--checkpoint.async_mode", "async"], 2),
    # step 4's write finished everywhere, its commit had not started: not a save yet
    ("after_write@4", ["--checkpoint.async_mode", "async"], 2),
    ("after_write@4", [], 2),
    # the manifest (the commit point) was written, the rename was not: the restart finishes it
    ("before_rename@4", [], 4),
])
def test_kill_during_a_save_resumes_from_the_newest_complete(tmp_path, reference, crash_at, extra, resume_step):
    assert _crash_then_resume(tmp_path, crash_at, *extra) == resume_step
    assert _losses(tmp_path) == reference  # bitwise
    ck = tmp_path / "checkpoint"
    assert [s for s, _ in list_checkpoints(ck)] == [2, 4, 6]
    assert not [p.name for p in ck.iterdir() if not p.name.startswith("step-") or "." in p.name]


@pytest.mark.slow
def test_kill_while_replacing_an_existing_step(tmp_path, reference):
    """step-4 exists; a second run from step 2 saves step 4 again and dies between moving the old
    step-4 aside and moving the new one in. Before: rmtree + rename, and a kill in between left a
    step-4 with only .metadata that the loader took as complete."""
    run_in_process(COMMON + ["--job.dump_folder", str(tmp_path)], stop_after=4)  # saves step 2 and 4
    assert [s for s, _ in list_checkpoints(tmp_path / "checkpoint")] == [2, 4]
    assert _crash_then_resume(tmp_path, "after_aside@4", "--checkpoint.load_step", "2") == 4
    assert _losses(tmp_path) == reference


def _save_tiny(dump: Path, *extra: str) -> Path:
    run_in_process(TINY + ["--training.steps", "2", "--checkpoint.enable", "--checkpoint.interval", "2",
                           "--job.dump_folder", str(dump), *extra])
    return dump / "checkpoint" / "step-2"


def test_flipped_byte_in_a_tensor_is_refused(tmp_path):
    step2 = _save_tiny(tmp_path)
    manifest = json.loads((step2 / MANIFEST).read_text())
    assert set(manifest["files"]) == {".metadata", "__0_0.distcp"} and manifest["kind"] == "full"
    shard = step2 / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01  # one bit, inside a tensor
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"step-2 is damaged: __0_0.distcp differs"):
        run_in_process(TINY + ["--training.steps", "4", "--checkpoint.enable", "--job.dump_folder", str(tmp_path)])
    # verification off: the same bytes load (this is what happened before manifests)
    losses, _ = run_in_process(TINY + ["--training.steps", "4", "--checkpoint.enable", "--checkpoint.verify_on_load",
                                       "false", "--job.dump_folder", str(tmp_path)])
    assert len(losses) == 2


def test_on_corrupt_fallback_sets_damage_aside_and_resumes_exactly(tmp_path, caplog):
    """checkpoint.on_corrupt: step-6 truncated (seen from sizes) and step-4 with one flipped bit
    (seen by its checksum). stop (the default) refuses step-6 in one line, before launch too;
    fallback renames both to step-N.corrupt with one log line each and resumes from step 2,
    and steps 3-6 then equal the uninterrupted run's bitwise."""
    from trainer.checkpoint_config import CheckpointConfig, check_checkpoint_paths

    args = COMMON + ["--job.dump_folder", str(tmp_path)]
    reference, _ = run_in_process(args)  # steps 1..6, saves 2, 4, 6
    ck = tmp_path / "checkpoint"
    shard6, shard4 = ck / "step-6" / "__0_0.distcp", ck / "step-4" / "__0_0.distcp"
    os.truncate(shard6, shard6.stat().st_size // 2)
    data = bytearray(shard4.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard4.write_bytes(bytes(data))

    with pytest.raises(CheckpointError, match=r"step-6 is not a complete checkpoint: __0_0.distcp has \d+ bytes"):
        check_checkpoint_paths(CheckpointConfig(enable=True), str(tmp_path))  # pre-launch: stop
    check_checkpoint_paths(CheckpointConfig(enable=True, on_corrupt="fallback"), str(tmp_path))  # moves nothing
    assert sorted(p.name for p in ck.iterdir()) == ["step-2", "step-4", "step-6"]
    with pytest.raises(CheckpointError, match=r"step-6 is not a complete checkpoint.*on_corrupt"):
        run_in_process(args)
    with pytest.raises(CheckpointError, match="another model"):  # a mismatch is no damage: fallback stops
        run_in_process(args + ["--checkpoint.on_corrupt", "fallback", "--checkpoint.load_step", "2",
                               "--model.flavor", "debug"])

    caplog.set_level(logging.WARNING, logger="trainer")
    losses, trainer = run_in_process(args + ["--checkpoint.on_corrupt", "fallback"])
    assert trainer.step == STEPS and len(losses) == STEPS - 2  # resumed at step 2
    assert losses == reference[2:]  # bitwise: steps 3..6 as if nothing had happened
    moved = [r.getMessage() for r in caplog.records if "on_corrupt = fallback" in r.getMessage()]
    assert len(moved) == 2 and "step-6 is not a complete checkpoint" in moved[0] and "step-6.corrupt" in moved[0]
    assert "step-4 is damaged: __0_0.distcp differs" in moved[1] and "step-4.corrupt" in moved[1]
    assert sorted(p.name for p in ck.iterdir()) == ["step-2", "step-4", "step-4.corrupt", "step-6",
                                                    "step-6.corrupt"]
    assert [s for s, _ in list_checkpoints(ck)] == [2, 4, 6]  # saved again, complete


def test_keep_latest_k_never_deletes_the_last_full_state(tmp_path):
    """last_save_model_only + keep_latest_k 1: the final export must not push out the state a
    resume needs (before: it did, and the resume started again at step 0)."""
    common = TINY + ["--checkpoint.enable", "--checkpoint.interval", "2", "--checkpoint.keep_latest_k", "1",
                     "--checkpoint.last_save_model_only", "--job.dump_folder", str(tmp_path)]
    run_in_process(common + ["--training.steps", "5"])
    assert [s for s, _ in list_checkpoints(tmp_path / "checkpoint")] == [4, 5]
    losses, trainer = run_in_process(common + ["--training.steps", "6"])
    assert len(losses) == 2  # resumed from step 4's full state, not from step 0


def test_preemption_on_a_just_saved_step_does_not_save_again(tmp_path, monkeypatch):
    from trainer.checkpoint import Checkpointer

    writes = []
    original = Checkpointer._write
    monkeypatch.setattr(Checkpointer, "_write", lambda self, state, tmp, step: writes.append(step) or
                        original(self, state, tmp, step))
    run_in_process(TINY + ["--training.steps", "6", "--checkpoint.enable", "--checkpoint.interval", "2",
                           "--job.dump_folder", str(tmp_path)], stop_after=4)
    assert writes == [2, 4]


def test_failed_save_removes_its_partial_tmp_and_names_a_full_disk(tmp_path, monkeypatch):
    """A full disk surfaces from torch's writer as `inline_container.cc: unexpected pos`; the
    error must say "no space left" and leave no step-N.tmp behind."""
    import shutil as sh

    import torch.distributed.checkpoint.filesystem as fs

    def full_disk(*args, **kwargs):
        raise RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 4480 vs 4374")

    monkeypatch.setattr(fs, "_write_item", full_disk)
    usage = sh.disk_usage(tmp_path)
    monkeypatch.setattr(sh, "disk_usage", lambda p: usage._replace(free=4096))
    with pytest.raises(CheckpointError, match="no space left on the device") as e:
        _save_tiny(tmp_path)
    assert "step-2" in str(e.value) and "\n" not in str(e.value)
    assert not list((tmp_path / "checkpoint").glob(f"*{TMP}"))


def test_missing_metadata_is_refused_by_name_not_skipped(tmp_path):
    step2 = _save_tiny(tmp_path)
    run_in_process(TINY + ["--training.steps", "4", "--checkpoint.enable", "--checkpoint.interval", "2",
                           "--job.dump_folder", str(tmp_path)])
    step4 = tmp_path / "checkpoint" / "step-4"
    (step4 / ".metadata").unlink()
    (step4 / MANIFEST).unlink()
    with pytest.raises(CheckpointError, match=r"step-4 is not a complete checkpoint.*load_step N \(complete: \[2\]\)"):
        run_in_process(TINY + ["--training.steps", "6", "--checkpoint.enable", "--job.dump_folder", str(tmp_path)])
    assert step2.is_dir()


def test_dcp_errors_are_one_line_not_a_base_exception(tmp_path):
    """A checkpoint from before manifests, truncated: DCP itself fails, with CheckpointException,
    a BaseException that `except Exception` let through as a traceback."""
    step2 = _save_tiny(tmp_path)
    (step2 / MANIFEST).unlink()
    shard = step2 / "__0_0.distcp"
    os.truncate(shard, shard.stat().st_size // 3)
    with pytest.raises(CheckpointError, match=r"step-2 could not be loaded \(.*\); delete it") as e:
        run_in_process(TINY + ["--training.steps", "4", "--checkpoint.enable", "--job.dump_folder", str(tmp_path)])
    assert "\n" not in str(e.value)


# ---- options that need another one: they work instead of being ignored
def test_initial_load_path_works_without_checkpointing(tmp_path):
    trained = _save_tiny(tmp_path / "a")  # weights after 2 steps, not the seed's
    args = TINY + ["--training.steps", "1", "--checkpoint.initial_load_path", str(trained)]
    loaded, _ = run_in_process(args + ["--job.dump_folder", str(tmp_path / "b")])
    with_ckpt, _ = run_in_process(args + ["--checkpoint.enable", "--job.dump_folder", str(tmp_path / "c")])
    fresh, _ = run_in_process(TINY + ["--training.steps", "1", "--job.dump_folder", str(tmp_path / "d")])
    assert loaded == with_ckpt and loaded != fresh  # before: silently started from fresh weights
    assert not (tmp_path / "b" / "checkpoint").exists() or not list((tmp_path / "b" / "checkpoint").iterdir())


def test_last_save_in_hf_works_without_checkpointing(tmp_path):
    run_in_process(TINY + ["--training.steps", "1", "--checkpoint.last_save_in_hf", "--job.dump_folder",
                           str(tmp_path)])
    hf = tmp_path / "checkpoint" / "step-1-hf"
    assert (hf / "config.json").is_file() and list(hf.glob("*.safetensors"))
    assert [s for s, _ in list_checkpoints(tmp_path / "checkpoint")] == []  # no DCP checkpoint
