"""End to end: `./run_train.sh` with no config arguments trains the debug model and the loss falls."""

import os

import pytest

from tests.helpers import REPO, read_metrics, run_killing_group


@pytest.mark.slow
@pytest.mark.timeout(2000)  # a bound against hangs: 300 steps on a loaded 2-core machine took >14 min
def test_run_train_sh_debug_model_learns(tmp_path):
    dump = tmp_path / "run"
    env = {**os.environ, "LOG_RANK": "0"}
    env.pop("OMP_NUM_THREADS", None)  # let run_train.sh use both cores, as a user's run would
    proc = run_killing_group(["./run_train.sh", "--job.dump_folder", str(dump), "--metrics.log_freq", "10"],
                             cwd=REPO, env=env, timeout=1900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = read_metrics(dump)
    steps = [r["step"] for r in records]
    assert steps[0] == 1 and steps[-1] == 300
    first, last = records[0]["loss"], records[-1]["loss"]
    # The headline promise: at least 3 nats in 300 steps on the offline corpus.
    assert first - last >= 3.0, (first, last)
    assert all(r["tokens_per_s"] > 0 and r["memory/peak_rss_gib"] > 0 for r in records)
    events = list((dump / "tb").glob("events.out.tfevents.*"))
    assert events and events[0].stat().st_size > 0
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(dump / "tb"))
    acc.Reload()
    tb_loss = acc.Scalars("train/loss")
    assert [e.step for e in tb_loss] == steps
    assert tb_loss[-1].value == pytest.approx(last, rel=1e-6)
