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


def _optimizer_state(trainer):
    opt = trainer.optimizers[0]
    return [{k: v.detach().clone() for k, v in opt.state[p].items()} for p in trainer.model_parts[0].parameters()]


@pytest.mark.parametrize("implementation", ["foreach", "fused"])  # fused: the skip is decided on the device
def test_a_nan_step_changes_no_weight_and_training_goes_on(tmp_path, implementation):
    trainer = _trainer(tmp_path, "--training.steps", "5", "--optimizer.implementation", implementation)
    assert trainer.guard.decides_on_device(trainer.optimizers) == (implementation == "fused")
    _poison_grads_at(trainer, {3})
    seen, events = {}, []
    original_step = trainer.train_step
    original_opt_step = trainer.optimizers[0].step
    original_tolist = torch.Tensor.tolist

    def opt_step(*a, **kw):
        events.append("update")
        return original_opt_step(*a, **kw)

    opt_step._wrapped_by_lr_sched = True  # what LambdaLR checks; the wrapper keeps the order
    def tolist(self):
        events.append("read")
        return original_tolist(self)

    def train_step(batches, **kw):
        before = [p.detach().clone() for p in trainer.model_parts[0].parameters()]
        state, epoch = _optimizer_state(trainer), trainer.lr_schedulers[0].last_epoch
        events.clear()
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(torch.Tensor, "tolist", tolist)
            result = original_step(batches, **kw)
        after = list(trainer.model_parts[0].parameters())
        same_state = all(a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
                         for a, b in zip(state, _optimizer_state(trainer)))
        seen[trainer.step] = (result.skipped, all(torch.equal(a, b) for a, b in zip(before, after)),
                              same_state, trainer.lr_schedulers[0].last_epoch == epoch, list(events))
        return result

    trainer.optimizers[0].step = opt_step
    trainer.train_step = train_step
    try:
        losses = trainer.train()
    finally:
        trainer.close()
    assert len(losses) == 5 and all(math.isfinite(v) for v in losses[:2] + losses[3:])
    # Skipped: every weight, moment, step counter and the LR schedule as they were.
    assert seen[3][:4] == ("non-finite gradient norm", True, True, True)
    assert all(seen[s][:4] == (None, False, False, False) for s in (2, 4, 5))  # the others update
    assert trainer.optimizers[0].state[next(trainer.model_parts[0].parameters())]["step"] == 4  # 4 updates
    assert trainer.lr_schedulers[0].last_epoch == 4  # the schedule counts updates
    # One host read per step; fused launches the update first (skipped or not), unfused reads first.
    expect = {"fused": [["update", "read"]] * 5,
              "foreach": [["read", "update"], ["read", "update"], ["read"], ["read", "update"], ["read", "update"]]}
    assert [seen[s][4] for s in range(1, 6)] == expect[implementation]


def test_device_flag_matches_the_host_decision():
    g = StepGuard(5, loss_spike_factor=2.0)
    cases = [(4.0, 1.0), (3.9, 1.0), (3.8, 1.0), (3.9, 1.0), (4.1, 1.0),  # history: mean 3.94
             (8.1, 1.0), (7.0, 1.0), (math.nan, 1.0), (2.0, math.inf), (3.0, 1.0)]
    for step, (loss, norm) in enumerate(cases, start=1):
        for mtp in (2.0, math.nan):
            flag = g.skip_flag(torch.tensor([loss, mtp, 0.0, 0.0, norm], dtype=torch.float64), 2)
            host = g._reason(loss if math.isfinite(mtp) else math.nan, norm) is not None
            assert flag.dtype == torch.float32 and flag.dim() == 0 and bool(flag) == host, (step, loss, mtp)
        g.check(step, loss, norm, log=False)
    assert g.total_skipped == 3


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
