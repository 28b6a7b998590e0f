"""torchft replica groups (trainer/fault_tolerance/): real torchft, a real lighthouse, gloo, the tiny
model, each launch under a hard timeout.

- (2 groups x 2 ranks, FSDP 2 inside each, against plain HSDP: tests/test_fault_tolerance_moe.py, with
  DeepSeek V3's MoE; two groups sharing checkpoints, restarts and preemption:
  tests/test_fault_tolerance_recovery.py)
- one of 2 groups is SIGKILLed at step 8 of 30 and restarted: the survivor logs every step, no step
  takes longer than the quorum timeout plus a normal step, the restarted group heals from the
  survivor and both end bitwise equal; up to the kill the curve is the no-failure curve;
- the data slice of an absent group is skipped, no sample is read twice;
- ./run_train.sh starts its own lighthouse, and a restart of every group resumes from disk exactly;
- bad inputs: one line, exit 2.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from tests.ft_helpers import ENV, STEP_LINE, Proc, losses, start_group, start_lighthouse
from tests.helpers import REPO, free_port, read_metrics

# The small debug model; log every step. The LR is flat after warmup (min_lr_factor 1), so the first
# steps of a 30-step run follow the same curve as a 10-step run.
COMMON = ["--config", "llama_debug.toml", "--model.flavor", "debug_small", "--training.seq_len", "64",
          "--metrics.log_freq", "1", "--metrics.enable_tensorboard", "false", "--lr_scheduler.warmup_steps", "2",
          "--lr_scheduler.min_lr_factor", "1.0", "--optimizer.lr", "1e-3", "--training.steps", "10"]
QUORUM_TIMEOUT = 20


@pytest.fixture(scope="module")
def hsdp_losses(tmp_path_factory) -> dict[int, float]:
    """The no-failure reference: one job, HSDP replicate 2 x shard 2 (4 ranks), local batch 2."""
    out = tmp_path_factory.mktemp("hsdp")
    proc = Proc(["./run_train.sh", *COMMON, "--training.local_batch_size", "2",
                 "--parallelism.data_parallel_replicate_degree", "2", "--parallelism.data_parallel_shard_degree",
                 "2", "--job.dump_folder", str(out)], {**ENV, "NGPU": "4"})
    assert proc.wait(400) == 0, proc.text()[-4000:]
    return losses(out)


@pytest.mark.slow
@pytest.mark.multirank
@pytest.mark.timeout(600)
def test_a_killed_group_costs_the_survivor_one_quorum_and_heals_from_it(tmp_path, hsdp_losses):
    lighthouse, address = start_lighthouse(tmp_path, min_replicas=1)
    state = tmp_path / "state"
    args = ["--training.steps", "30", "--training.local_batch_size", "4", "--fault_tolerance.group_count", "2",
            "--fault_tolerance.lighthouse",
            address, "--fault_tolerance.quorum_timeout_seconds", str(QUORUM_TIMEOUT),
            "--fault_tolerance.heal_timeout_seconds", "15", "--job.dump_folder", str(tmp_path / "ft")]
    at_step_8 = threading.Event()
    env = {"TITAN_TEST_FT_STATE": str(state)}
    try:
        # The survivor sleeps 1.5 s per step after the kill, so that the restarted group (a fresh
        # Python + torch start, ~10-20 s on a loaded machine) comes back before step 30.
        survivor = start_group(0, 1, [*COMMON, *args], {**env, "TITAN_TEST_SLOW_RANK": "0:1.5@9"})
        victim = start_group(1, 1, [*COMMON, *args], env, on_line=lambda ln: STEP_LINE.search(ln) and
                             int(STEP_LINE.search(ln).group(1)) == 8 and at_step_8.set())
        assert at_step_8.wait(300), victim.text()[-4000:]
        victim.kill()  # kill -9, the launcher and its worker
        restarted = start_group(1, 1, [*COMMON, *args], env)
        assert survivor.wait(400) == 0, survivor.text()[-4000:]
        assert restarted.wait(200) == 0, restarted.text()[-4000:]
    finally:
        lighthouse.kill()

    # The survivor logged every step once; no step took longer than a quorum timeout plus a normal step.
    survivor_records = read_metrics(tmp_path / "ft" / "replica-0")
    assert [r["step"] for r in survivor_records] == list(range(1, 31))
    times = [t for t, ln in survivor.lines if STEP_LINE.search(ln)]
    gaps = sorted(b - a for a, b in zip(times, times[1:]))
    assert gaps[-1] < QUORUM_TIMEOUT + gaps[len(gaps) // 2], gaps
    # Whether the survivor then trains alone for a while (a step not committed, ft/groups 1) or the
    # restarted group is back before the quorum gives up on the dead one (every step with 2 groups)
    # depends on how fast a fresh Python + torch starts: both are right, and both heal below.
    # Up to the kill the curve is the no-failure (HSDP) one.
    for r in survivor_records[:8]:
        assert r["loss"] == pytest.approx(hsdp_losses[r["step"]], rel=0, abs=1e-5), r["step"]
    # The restarted group healed from the survivor at a step boundary and trained with it to the end.
    healed = re.search(r"healed from a live peer at step (\d+)", restarted.text())
    assert healed, restarted.text()[-4000:]
    heal_step = int(healed.group(1))
    assert 8 <= heal_step < 30
    assert [r["step"] for r in read_metrics(tmp_path / "ft" / "replica-1")][-(30 - heal_step):] == \
        list(range(heal_step + 1, 31))
    assert survivor_records[-1]["ft/groups"] == 2.0
    # Bitwise the same parameters, optimizer state, schedule and data position on both groups.
    a, b = (torch.load(f"{state}-replica{g}-rank0.pt", weights_only=False) for g in (0, 1))
    assert a["step"] == b["step"] == 30
    assert all(torch.equal(x, y) for x, y in zip(a["model"][0], b["model"][0], strict=True))
    for x, y in zip(a["optimizers"][0], b["optimizers"][0], strict=True):
        assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)
    assert a["lr_schedulers"] == b["lr_schedulers"] and a["param_groups"] == b["param_groups"]
    position = [json.loads(s["data"]["loader_state"])["position"] for s in (a, b)]
    assert position[0] == position[1] and position[0]["sample"] == 30 * 8


def test_an_absent_groups_slice_is_skipped_never_read_twice():
    """Group g's dp rank r reads slice g * dp + r of every global batch; a group that is away reads
    nothing and, healed, takes the live group's (global) position: its missed slices are skipped."""
    from trainer.config import load_config
    from trainer.data import build_dataloader
    from trainer.data.tokenizer import build_tokenizer
    from trainer.fault_tolerance.config import data_slice
    from trainer.model_args import tokenizer_path

    cfg = load_config(COMMON + ["--training.local_batch_size", "2", "--fault_tolerance.enable",
                               "--fault_tolerance.group_count", "2"])
    path = tokenizer_path(cfg, str(REPO / "assets" / "tokenizer" / "tokenizer.model"))

    def loader(group):
        cfg.fault_tolerance.replica_id = group
        rank, world = data_slice(cfg.fault_tolerance, 0, 1)
        return build_dataloader(cfg.data, tokenizer=build_tokenizer(path), tokenizer_path=path, seq_len=64,
                                local_batch_size=2, dp_rank=rank, dp_world_size=world, seed=cfg.training.seed)

    def take(dl, n):  # the input rows of the next n steps
        return [batch[0] for _, batch in zip(range(n), iter(dl))]

    rows_full = [take(loader(g), 6) for g in (0, 1)]  # no failure: both groups read steps 1-6
    live, away = loader(0), loader(1)
    read = take(live, 4) + take(away, 2)  # group 1 reads steps 1-2, then is away for steps 3-4
    away.load_state_dict(live.state_dict())  # healed at the boundary after step 4: the live group's position
    read += take(live, 2) + take(away, 2)  # steps 5-6, both
    seen = [tuple(row.tolist()) for batch in read for row in batch]
    assert len(seen) == len(set(seen)), "a sample was read twice"
    expected = rows_full[0][:4] + rows_full[1][:2] + rows_full[0][4:] + rows_full[1][4:]
    assert all(torch.equal(a, b) for a, b in zip(read, expected, strict=True))
    skipped = {tuple(row.tolist()) for batch in rows_full[1][2:4] for row in batch}
    assert not skipped & set(seen)


@pytest.mark.slow
@pytest.mark.multirank
@pytest.mark.timeout(600)
def test_run_train_starts_a_lighthouse_and_all_groups_resume_from_disk(tmp_path):
    """One group on this machine: run_train.sh starts torchft's lighthouse; killed after step 4, a
    rerun resumes from the step-3 checkpoint (written by the group of replica rank 0) exactly."""
    args = [*COMMON, "--training.steps", "6", "--training.local_batch_size", "2", "--fault_tolerance.enable",
            "--checkpoint.enable", "--checkpoint.interval", "3", "--job.dump_folder", str(tmp_path)]
    env = {**ENV, "NGPU": "1", "TMPDIR": str(tmp_path)}
    first = Proc(["./run_train.sh", *args], {**env, "TITAN_CHECKPOINT_CRASH_AT": "step_end@4"})
    assert first.wait(300) != 0
    assert "lighthouse: serving at" in first.text()
    before = losses(tmp_path / "replica-0")
    assert (tmp_path / "checkpoint" / "step-3").is_dir()
    second = Proc(["./run_train.sh", *args], env)
    assert second.wait(300) == 0, second.text()[-4000:]
    assert "starting at step 3" in second.text()
    after = losses(tmp_path / "replica-0")
    assert sorted(after) == list(range(1, 7)) and after[4] == before[4]
    # The lighthouse left with the run (its address file lives under TMPDIR = tmp_path).
    deadline = time.time() + 10
    while subprocess.run(["pgrep", "-f", f"lighthouse.*{tmp_path}"], capture_output=True).returncode == 0:
        assert time.time() < deadline, "the lighthouse outlived run_train.sh"
        time.sleep(0.5)


@pytest.mark.parametrize("args, expected", [
    (["--fault_tolerance.enable", "--fault_tolerance.min_replicas", "3", "--fault_tolerance.group_count", "2"],
     "config error: fault_tolerance.min_replicas: 3 exceeds fault_tolerance.group_count 2"),
    (["--fault_tolerance.enable", "--parallelism.data_parallel_replicate_degree", "2"],
     "config error: parallelism.data_parallel_replicate_degree: 2 with fault_tolerance.enable"),
    (["--fault_tolerance.lighthouse", "nohost"], "config error: fault_tolerance.lighthouse: expected host:port"),
    # a rank waiting heal_timeout for another group must not look hung to its own group
    (["--fault_tolerance.enable", "--comm.train_timeout_seconds", "60"],
     "config error: fault_tolerance.heal_timeout_seconds: 60 is not below the hang watch's bound of 55 s"),
])
def test_bad_fault_tolerance_config_is_one_line(args, expected):
    from trainer.config import load_config
    from configuration.fields import ConfigError

    with pytest.raises(ConfigError) as e:
        load_config(COMMON[:2] + args)
    assert str(e.value).startswith(expected) and "\n" not in str(e.value)


def test_fault_tolerance_without_torchft_names_the_pip_command(monkeypatch):
    import importlib.util

    from trainer.config import load_config
    from configuration.fields import ConfigError

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchft" else real(name, *a))
    with pytest.raises(ConfigError, match=r"fault_tolerance.enable: torchft is not installed; pip install "
                                          r"'torchft==0.2.0'"):
        load_config(["--fault_tolerance.enable"])


def test_an_unreachable_lighthouse_is_one_line_within_the_timeout(capsys):
    """The check run_train.sh (and the SLURM script) run before any worker starts; each worker's
    ReplicaGroups runs the same one before it talks to the lighthouse."""
    from trainer.launch import main

    address = f"127.0.0.1:{free_port()}"
    t0 = time.time()
    rc = main(["--check-config", *COMMON, "--fault_tolerance.enable", "--fault_tolerance.lighthouse", address,
               "--fault_tolerance.connect_timeout_seconds", "2"])
    elapsed = time.time() - t0
    err = capsys.readouterr().err
    assert rc == 2
    assert err == (f"config error: fault_tolerance.lighthouse: nothing answers at {address} (Connection refused) "
                   "within 2 s; start the lighthouse (python -m trainer.fault_tolerance.lighthouse) or fix the "
                   "address\n"), err
    assert 2 <= elapsed < 2 + 10, elapsed


@pytest.mark.timeout(120)
def test_the_lighthouse_exits_with_its_launcher_even_while_the_launcher_awaits_reaping(tmp_path):
    """run_train.sh's shape under a caller that reads the output to EOF before it reaps (Python's
    communicate, CI's log capture): the shell starts the lighthouse with --parent-pid $$, then execs
    the launcher. When the launcher exits it stays a zombie until its caller reaps it, which the
    caller does only after the lighthouse closes the pipes it inherited; a zombie must count as gone."""
    address = tmp_path / "address"
    script = (f"{sys.executable} -m trainer.fault_tolerance.lighthouse --port 0 --address-file {address} "
              f"--parent-pid $$ & for _ in $(seq 300); do [ -s {address} ] && break; sleep 0.1; done; exec sleep 1")
    with subprocess.Popen(["bash", "-c", script], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, start_new_session=True) as proc:
        try:
            out, _ = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            raise AssertionError("the lighthouse outlived its exited launcher and held the pipes open")
    assert proc.returncode == 0 and "lighthouse: serving at" in out, out


def test_a_starting_group_repairs_only_its_own_checkpoint_leftovers(tmp_path):
    """Replica groups share the checkpoint folder: a group's start finishes or removes only the temporary
    folders it wrote itself (another group may be writing its save right now); without fault
    tolerance the one writer repairs everything."""
    from trainer.checkpoint_files import MANIFEST, recover

    for name in ("step-4.replica-1.tmp", "step-8.replica-0.tmp", "step-2.replica-0.old", "step-6.tmp"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__0_0.distcp").write_bytes(b"x")
    (tmp_path / "step-8.replica-0.tmp" / ".metadata").write_bytes(b"m")
    (tmp_path / "step-8.replica-0.tmp" / MANIFEST).write_text(json.dumps(
        {"format": 1, "step": 8, "kind": "full", "files": {"__0_0.distcp": {"size": 1, "crc32": [0]}}}))
    notes = recover(tmp_path, "replica-0")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-2", "step-4.replica-1.tmp", "step-6.tmp", "step-8"]
    assert len(notes) == 2, notes
    recover(tmp_path)  # one writer (no fault tolerance): every leftover is its own
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-2", "step-8"]


def test_a_checkpoint_purged_while_a_group_reads_it_is_read_again_from_the_newest(tmp_path, monkeypatch, caplog):
    """A restarting group reads the newest checkpoint while the live group commits a newer one and
    purges the old one (keep_latest_k): the group reads the newest instead of stopping on a
    'damaged' checkpoint (exit 2, which the SLURM script does not restart)."""
    import shutil

    import trainer.checkpoint_files as files
    from tests.helpers import TINY, run_in_process

    _, trainer = run_in_process([*TINY, "--training.steps", "4", "--checkpoint.enable", "--checkpoint.interval",
                                 "4", "--job.dump_folder", str(tmp_path)])
    folder = tmp_path / "checkpoint"
    real = files.verify_files

    def live_group_saves_and_purges(path, manifest, names):
        if path.name == "step-4":  # meanwhile: the live group commits step-6, then purges step-4
            shutil.copytree(path, folder / "step-6")
            shutil.rmtree(path)
        return real(path, manifest, names)

    monkeypatch.setattr(files, "verify_files", live_group_saves_and_purges)
    trainer.checkpointer.writer = "replica-1"
    with caplog.at_level("WARNING", logger="trainer"):
        assert trainer.checkpointer.load() == 4  # step-6 holds step 4's state here
    assert "step-4 was replaced by a newer save of another replica group" in caplog.text
