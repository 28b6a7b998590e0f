"""LR schedule shapes."""

import pytest
import torch

from configuration.fields import ConfigError
from trainer.optim import LRSchedulerConfig, build_lr_scheduler, lr_factor


def factors(total, **kw):
    cfg = LRSchedulerConfig(**kw)
    return [lr_factor(s, total, cfg) for s in range(total)]


def test_warmup_is_linear_then_linear_decay_to_min():
    f = factors(20, warmup_steps=4, decay_type="linear", min_lr_factor=0.1)
    assert f[:4] == pytest.approx([1 / 5, 2 / 5, 3 / 5, 4 / 5])
    decay = f[4:]
    assert all(a > b for a, b in zip(decay, decay[1:]))
    assert decay[-1] == pytest.approx(0.1)
    diffs = [a - b for a, b in zip(decay, decay[1:])]
    assert max(diffs) - min(diffs) < 1e-12  # straight line


def test_cosine_is_slow_fast_slow():
    f = factors(104, warmup_steps=4, decay_type="cosine", min_lr_factor=0.0)[4:]
    diffs = [a - b for a, b in zip(f, f[1:])]
    assert f[-1] == pytest.approx(0.0, abs=1e-12)
    assert diffs[0] < diffs[len(diffs) // 2] > diffs[-1]


def test_wsd_holds_then_decays_over_the_last_fraction():
    f = factors(100, warmup_steps=10, decay_type="wsd", decay_ratio=0.2, min_lr_factor=0.0)
    assert f[10:80] == [1.0] * 70
    assert all(a > b for a, b in zip(f[80:], f[81:]))
    assert f[-1] == pytest.approx(0.0)


def test_scheduler_drives_optimizer_lr_and_rejects_overlong_phases():
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.AdamW([p], lr=2.0)
    sched = build_lr_scheduler(opt, 10, LRSchedulerConfig(warmup_steps=2))
    assert opt.param_groups[0]["lr"] == pytest.approx(2.0 / 3)
    opt.step()
    sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(2.0 * 2 / 3)
    with pytest.raises(ConfigError, match="lr_scheduler.decay_ratio"):
        build_lr_scheduler(opt, 10, LRSchedulerConfig(warmup_steps=8, decay_ratio=0.5))
