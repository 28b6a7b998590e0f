"""Never write garbage into the weights: skip a step whose loss or gradient norm is not finite
(and, optionally, a loss spike), and stop the run after too many in a row.

One NaN step is enough to poison every weight through the optimizer, and AdamW's moments
keep the poison after the data is fine again; a run that trains on after that only burns
GPU hours. A skipped step does no optimizer update, no LR-schedule step and no model
post-step hook (the MoE bias update); its batch is consumed, not retried. After
`training.max_skipped_steps` consecutive skips the run stops with one line that names the
step, the values and the likely cause.

Cost: the decision needs the global loss and the global gradient norm. Both already exist
on every rank, identical (the loss all-reduce, moved before the step, and the clip's norm),
so there is no extra collective. Where every optimizer is fused (the default on CUDA), the
skip is decided on the device: `skip_flag` is handed to the fused AdamW kernel as its
`found_inf` (the flag GradScaler uses), which then leaves params, moments and step counters
untouched, so the optimizer is launched before the host reads the flags and the GPU does
not idle while the CPU launches it. The one host read per step (for logging) follows; the
host then makes the same decision (`check`, the same doubles compared the same way) for
what only the host can do: the LR schedule, the post-step hooks, the counters. Unfused
optimizers (foreach / for-loop: CPU) have no `found_inf`, so there the host read moves
before `optimizer.step()`. `training.max_skipped_steps = 0` turns the guard off and
restores the old order. `scripts/bench_step_guard.py` measures it.

Loss spikes (`training.loss_spike_factor` k > 0): a step whose loss exceeds k times the
mean of the last 20 accepted losses (once there are 5) is skipped too. The window is not
checkpointed: after a resume the spike check waits for 5 new steps.
"""

from __future__ import annotations

import logging
import math
from collections import deque

import torch

logger = logging.getLogger("trainer")

SPIKE_WINDOW, SPIKE_MIN_HISTORY = 20, 5


class TrainingDiverged(RuntimeError):
    """Too many consecutive skipped steps; one line naming the step and the likely cause."""


class StepGuard:
    def __init__(self, max_skipped_steps: int, loss_spike_factor: float = 0.0, *, lr: float | None = None):
        self.max_skipped = max_skipped_steps
        self.spike_factor = loss_spike_factor
        self.lr = lr
        self.history: deque[float] = deque(maxlen=SPIKE_WINDOW)
        self.consecutive = 0
        self.total_skipped = 0

    @property
    def enabled(self) -> bool:
        return self.max_skipped > 0

    def _spike_mean(self) -> float | None:
        if self.spike_factor > 0 and len(self.history) >= SPIKE_MIN_HISTORY:
            return sum(self.history) / len(self.history)
        return None

    def _reason(self, loss: float, grad_norm: float) -> str | None:
        if not math.isfinite(loss):
            return "non-finite loss"
        if not math.isfinite(grad_norm):
            return "non-finite gradient norm"
        mean = self._spike_mean()
        if mean is not None and loss > self.spike_factor * mean:
            return f"loss spike (> {self.spike_factor:g} x the running mean {mean:.4f})"
        return None

    @staticmethod
    def decides_on_device(optimizers) -> bool:
        """Whether the skip can be applied inside the optimizer step (fused AdamW's found_inf)."""
        return bool(optimizers) and all(g.get("fused") for o in optimizers for g in o.param_groups)

    def skip_flag(self, scalars: torch.Tensor, n_loss: int) -> torch.Tensor:
        """The decision of `check` computed on the device, without a host read: a 0-d float32
        tensor, 1.0 = skip. `scalars` = [loss terms (n_loss)..., ..., grad norm] in float64,
        the values `check` receives; the spike threshold is a host double from past steps."""
        losses, norm = scalars[:n_loss], scalars[-1]
        bad = ~torch.isfinite(losses).all() | ~torch.isfinite(norm)
        mean = self._spike_mean()
        if mean is not None:
            bad = bad | (losses[0] > self.spike_factor * mean)
        return bad.to(torch.float32)

    def step_on_device(self, optimizers, flag: torch.Tensor) -> None:
        """Runs every (fused) optimizer's step with `flag` as its found_inf: a flagged step
        leaves params, moments and step counters exactly as they were."""
        for opt in optimizers:
            opt.found_inf = flag.to(next(p for g in opt.param_groups for p in g["params"]).device)
            try:
                opt.step()
            finally:
                del opt.found_inf

    def _likely_cause(self, reason: str) -> str:
        lr = f" (optimizer.lr = {self.lr:g}, the peak)" if self.lr is not None else ""
        if reason.startswith("loss spike"):
            return (f"likely the learning rate{lr} or bad data near this step; lower optimizer.lr, or raise "
                    "training.loss_spike_factor")
        if reason == "non-finite gradient norm":
            return (f"likely a gradient overflow; lower optimizer.lr{lr}, raise lr_scheduler.warmup_steps, or "
                    "keep training.max_norm > 0")
        return (f"likely the learning rate{lr} (the weights overflowed) or an overflow in bf16; lower optimizer.lr, "
                "raise lr_scheduler.warmup_steps, or check the data; resume from the last checkpoint once fixed")

    def check(self, step: int, loss: float, grad_norm: float, *, log: bool = True) -> str | None:
        """The reason to skip this step, or None to apply it. Raises TrainingDiverged after
        max_skipped_steps consecutive skips. Every rank sees the same values, so every rank
        decides the same."""
        if not self.enabled:
            return None
        reason = self._reason(loss, grad_norm)
        if reason is None:
            self.consecutive = 0
            self.history.append(loss)
            return None
        self.consecutive += 1
        self.total_skipped += 1
        if self.consecutive >= self.max_skipped:
            raise TrainingDiverged(
                f"training error: stopped at step {step}: {self.consecutive} steps in a row skipped "
                f"(training.max_skipped_steps = {self.max_skipped}), the last for a {reason} (loss {loss:.4g}, "
                f"grad_norm {grad_norm:.4g}); {self._likely_cause(reason)}")
        if log:
            logger.warning(f"step {step} skipped (no optimizer update): {reason}: loss {loss:.4g}, grad_norm "
                           f"{grad_norm:.4g}; {self.consecutive} in a row, the run stops at {self.max_skipped}")
        return reason
