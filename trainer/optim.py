"""AdamW or Muon (trainer/muon.py), and the LR schedule: linear warmup, then linear / cosine / WSD decay."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from configuration.fields import ConfigError, opt


@dataclass
class OptimizerConfig:
    """[optimizer]"""

    name: str = opt("AdamW", "Optimizer. muon: Newton-Schulz orthogonalised momentum on the hidden matrices "
                    "(muon_params), AdamW (lr, beta1, beta2, eps, weight_decay) on the rest.",
                    choices=("AdamW", "Adam", "muon"))
    lr: float = opt(8e-4, "Peak learning rate.", min=0.0)
    beta1: float = opt(0.9, "Adam beta1.", min=0.0, max=1.0)
    beta2: float = opt(0.95, "Adam beta2.", min=0.0, max=1.0)
    eps: float = opt(1e-8, "Adam epsilon.", min=0.0)
    weight_decay: float = opt(0.1, "Decoupled weight decay.", min=0.0)
    implementation: str = opt("auto", "auto picks fused on CUDA and foreach elsewhere.",
                              choices=("auto", "fused", "foreach", "for-loop"))
    # ---- muon (name = "muon"): the rule and the Muon group's hyperparameters ----
    muon_params: list[str] = opt(["layers.*"], "Muon: fnmatch patterns of parameter names (wrapper prefixes "
                                 "removed) that go to Muon, if >= 2-D and not excluded; each must match one.")
    muon_exclude: list[str] = opt(["*norm*", "*.router.*", "*embed*", "output.*", "mtp.*"],
                                  "Muon: name patterns kept on AdamW although muon_params matches them.")
    muon_lr: float | None = opt(None, "Muon group's peak LR; None = lr (right with muon_update_scale rms).", min=0.0)
    muon_weight_decay: float | None = opt(None, "Muon group's decoupled weight decay; None = weight_decay.", min=0.0)
    muon_momentum: float = opt(0.95, "Muon momentum.", min=0.0, max=1.0)
    muon_nesterov: bool = opt(True, "Muon: Nesterov momentum (orthogonalise g + mu * buf instead of buf).")
    muon_ns_steps: int = opt(5, "Muon: quintic Newton-Schulz iterations.", min=1, max=20)
    muon_update_scale: str = opt("rms", "Muon update scale: rms = muon_rms_factor * sqrt(max(m, n)) (matches "
                                 "AdamW's update RMS, so its lr carries over; Moonlight) or spectral = "
                                 "sqrt(max(1, fan_out / fan_in)) (needs its own, larger lr).",
                                 choices=("rms", "spectral"))
    muon_rms_factor: float = opt(0.2, "Muon: the update RMS that the rms scale targets.", min=0.0)
    muon_ns_dtype: str = opt("auto", "Muon: Newton-Schulz precision; auto = bfloat16 on GPU, float32 on CPU.",
                             choices=("auto", "bfloat16", "float32"))


@dataclass
class LRSchedulerConfig:
    """[lr_scheduler]: warmup, an optional stable phase, then decay to lr * min_lr_factor."""

    warmup_steps: int = opt(200, "Linear warmup steps.", min=0)
    decay_type: str = opt("linear", "Decay shape after warmup; wsd holds the peak, then decays linearly "
                          "over the last decay_ratio of the steps.", choices=("linear", "cosine", "wsd"))
    decay_ratio: float | None = opt(None, "Fraction of the steps spent decaying; None = every step after "
                                    "warmup (0.1 for wsd).", min=0.0, max=1.0)
    min_lr_factor: float = opt(0.0, "Final LR as a fraction of the peak.", min=0.0, max=1.0)


def build_optimizer(model: torch.nn.Module, cfg: OptimizerConfig, device_type: str,
                    whole_model: list | None = None) -> torch.optim.Optimizer:
    """The optimizer of one model part. `whole_model`: the (name, param) pairs of the whole model
    (every pipeline stage; meta tensors do) that `optimizer.muon_params` is checked against;
    None: this part's own."""
    impl = cfg.implementation
    if impl == "auto":
        impl = "fused" if device_type == "cuda" else "foreach"
    if cfg.name == "muon":
        return build_muon(model, cfg, device_type, foreach=impl != "for-loop", whole_model=whole_model)
    params = model.parameters()
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


def check_muon_params(named_params: list, cfg: OptimizerConfig) -> None:
    """Each `optimizer.muon_params` pattern must select a parameter of `named_params` (the whole
    model: under PP a pattern may select parameters of other stages only)."""
    from trainer.muon import is_muon_param

    for pattern in cfg.muon_params:
        if not any(is_muon_param(n, p, [pattern], cfg.muon_exclude) for n, p in named_params):
            raise ConfigError(f"config error: optimizer.muon_params: {pattern!r} matches no >= 2-D parameter "
                              f"outside muon_exclude (names look like {named_params[0][0]!r}); fix the pattern")


def build_muon(model: torch.nn.Module, cfg: OptimizerConfig, device_type: str, foreach: bool = True,
               whole_model: list | None = None):
    from trainer.muon import Muon, split_params

    named = list(model.named_parameters())
    check_muon_params(named if whole_model is None else whole_model, cfg)
    muon, adamw, _ = split_params(named, cfg.muon_params, cfg.muon_exclude)
    ns_dtype = {"auto": torch.bfloat16 if device_type == "cuda" else torch.float32,
                "bfloat16": torch.bfloat16, "float32": torch.float32}[cfg.muon_ns_dtype]
    groups = [{"params": muon, "muon": True, "lr": cfg.lr if cfg.muon_lr is None else cfg.muon_lr,
               "weight_decay": cfg.weight_decay if cfg.muon_weight_decay is None else cfg.muon_weight_decay,
               "momentum": cfg.muon_momentum, "nesterov": cfg.muon_nesterov, "ns_steps": cfg.muon_ns_steps,
               "scale_mode": cfg.muon_update_scale, "rms_factor": cfg.muon_rms_factor},
              {"params": adamw, "muon": False, "lr": cfg.lr, "betas": (cfg.beta1, cfg.beta2), "eps": cfg.eps,
               "weight_decay": cfg.weight_decay}]
    return Muon([g for g in groups if g["params"]], ns_dtype=ns_dtype, foreach=foreach,
                device=torch.device(device_type))
