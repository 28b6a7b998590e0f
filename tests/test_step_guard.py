"""The non-finite guard: a NaN/inf step (or a loss spike) is skipped, not applied; too many in
a row stop the run with one line."""

from __future__ import annotations

import math

import pytest
import torch

from tests.helpers import TINY
from trainer.step_guard import StepGuard, TrainingDiverged


def test_guard_decisions():
    g = StepGuard(3)
    assert g.check(1, 2.0, 1.0) is None
    assert g.check(2, math.nan, 1.0) == "non-finite loss"
    assert g.check(3, 2.0, math.inf) == "non-finite gradient norm"
    assert g.check(4, 2.0, 1.0) is None and g.consecutive == 0  # a good step resets the count
    g.check(5, math.nan, math.nan)
    g.check(6, math.nan, math.nan)
    with pytest.raises(TrainingDiverged, match=r"stopped at step 7: 3 steps in a row .*max_skipped_steps = 3"):
        g.check(7, math.nan, math.nan)
    assert g.total_skipped == 5
    assert StepGuard(0).check(1, math.nan, math.nan) is None  # 0 = off


def test_loss_spikes_are_skipped_only_when_asked():
    g = StepGuard(5, loss_spike_factor=2.0)
    for step, loss in enumerate([4.0, 3.9, 3.8, 3.9, 4.1], start=1):
        assert g.check(step, loss, 1.0) is None
    assert g.check(6, 8.1, 1.0).startswith("loss spike (> 2 x the running mean 3.94")
    assert g.check(7, 7.0, 1.0) is None  # under 2 x 3.94: applied
    assert StepGuard(5).check(99, 1e9, 1.0) is None  # spikes off by default


def _trainer(tmp_path, *extra):
    from trainer.config import load_config
    from trainer.train import Trainer

    return Trainer(load_config(TINY + ["--job.dump_folder", str(tmp_path), *extra]))


def _poison_grads_at(trainer, steps: set[int]):
    original = trainer.forward_backward

    def forward_backward(batches):
        loss = original(batches)
        if trainer.step in steps:
            next(trainer.model_parts[0].parameters()).grad.view(-1)[0] = float("nan")
        return loss

    trainer.forward_backward = forward_backward


def test_a_nan_step_changes_no_weight_and_training_goes_on(tmp_path):
    trainer = _trainer(tmp_path, "--training.steps", "5")
    _poison_grads_at(trainer, {3})
    seen = {}
    original_step = trainer.train_step

    def train_step(batches, **kw):
        before = [p.detach().clone() for p in trainer.model_parts[0].parameters()]
        result = original_step(batches, **kw)
        after = list(trainer.model_parts[0].parameters())
        seen[trainer.step] = (result.skipped, all(torch.equal(a, b) for a, b in zip(before, after)))
        return result

    trainer.train_step = train_step
    try:
        losses = trainer.train()
    finally:
        trainer.close()
    assert len(losses) == 5
    assert seen[3] == ("non-finite gradient norm", True)  # skipped: every weight as it was
    assert all(seen[s] == (None, False) for s in (1, 2, 4, 5))  # the others update the weights
    assert trainer.optimizers[0].state[next(trainer.model_parts[0].parameters())]["step"] == 4  # 4 updates
    assert trainer.lr_schedulers[0].last_epoch == 4  # the schedule counts updates


def test_nan_weights_stop_the_run_with_one_line(tmp_path):
    trainer = _trainer(tmp_path, "--training.steps", "10")
    with torch.no_grad():
        next(trainer.model_parts[0].parameters()).fill_(float("nan"))
    try:
        with pytest.raises(TrainingDiverged) as e:
            trainer.train()
    finally:
        trainer.close()
    msg = str(e.value)
    assert msg.startswith("training error: stopped at step 3: 3 steps in a row skipped") and "\n" not in msg
    assert "non-finite loss" in msg and "optimizer.lr" in msg
