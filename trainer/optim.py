"""AdamW and the LR schedule: linear warmup, then linear / cosine / WSD decay."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from trainer.configurable import ConfigError, opt


@dataclass
class OptimizerConfig:
    """[optimizer]"""

    name: str = opt("AdamW", "Optimizer.", choices=("AdamW", "Adam"))
    lr: float = opt(8e-4, "Peak learning rate.", min=0.0)
    beta1: float = opt(0.9, "Adam beta1.", min=0.0, max=1.0)
    beta2: float = opt(0.95, "Adam beta2.", min=0.0, max=1.0)
    eps: float = opt(1e-8, "Adam epsilon.", min=0.0)
    weight_decay: float = opt(0.1, "Decoupled weight decay.", min=0.0)
    implementation: str = opt("auto", "auto picks fused on CUDA and foreach elsewhere.",
                              choices=("auto", "fused", "foreach", "for-loop"))


@dataclass
class LRSchedulerConfig:
    """[lr_scheduler]: warmup, an optional stable phase, then decay to lr * min_lr_factor."""

    warmup_steps: int = opt(200, "Linear warmup steps.", min=0)
    decay_type: str = opt("linear", "Decay shape after warmup; wsd holds the peak, then decays linearly "
                          "over the last decay_ratio of the steps.", choices=("linear", "cosine", "wsd"))
    decay_ratio: float | None = opt(None, "Fraction of the steps spent decaying; None = every step after "
                                    "warmup (0.1 for wsd).", min=0.0, max=1.0)
    min_lr_factor: float = opt(0.0, "Final LR as a fraction of the peak.", min=0.0, max=1.0)


def build_optimizer(params, cfg: OptimizerConfig, device_type: str) -> torch.optim.Optimizer:
    impl = cfg.implementation
    if impl == "auto":
        impl = "fused" if device_type == "cuda" else "foreach"
    kwargs = {"lr": cfg.lr, "betas": (cfg.beta1, cfg.beta2), "eps": cfg.eps, "weight_decay": cfg.weight_decay,
              "fused": impl == "fused", "foreach": impl == "foreach"}
    cls = torch.optim.AdamW if cfg.name == "AdamW" else torch.optim.Adam
    return cls(params, **kwargs)


def lr_factor(step: int, total_steps: int, cfg: LRSchedulerConfig) -> float:
    """LR multiplier for optimizer step `step` (0-based: the first step uses lr_factor(0))."""
    warmup = min(cfg.warmup_steps, total_steps)
    if step < warmup:
        return (step + 1) / (warmup + 1)
    ratio = cfg.decay_ratio if cfg.decay_ratio is not None else (0.1 if cfg.decay_type == "wsd" else None)
    decay_steps = total_steps - warmup if ratio is None else max(1, round(total_steps * ratio))
    decay_start = total_steps - decay_steps
    if step < decay_start:
        return 1.0
    progress = min(1.0, (step - decay_start + 1) / max(1, decay_steps))
    if cfg.decay_type == "cosine":
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
        shape = 1.0 - progress
    return cfg.min_lr_factor + (1.0 - cfg.min_lr_factor) * shape


def build_lr_scheduler(optimizer: torch.optim.Optimizer, total_steps: int, cfg: LRSchedulerConfig):
    if cfg.decay_ratio is not None and cfg.warmup_steps + round(total_steps * cfg.decay_ratio) > total_steps:
        raise ConfigError(f"config error: lr_scheduler.decay_ratio: warmup_steps ({cfg.warmup_steps}) + decay steps "
                          f"({round(total_steps * cfg.decay_ratio)}) exceed training.steps ({total_steps}); "
                          "lower one of them")
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, total_steps, cfg))
