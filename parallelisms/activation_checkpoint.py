"""Activation checkpointing: none / full / selective / op / memory_budget.
See docs/activation_checkpointing.md."""

from __future__ import annotations

from dataclasses import dataclass

from trainer.configurable import opt

AC_MODES = ("none", "full", "selective", "op", "memory_budget")


def _parse_mode(value):
    # `mode = true` / `false` are accepted as the common shorthands.
    if isinstance(value, bool):
        return "full" if value else "none"
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return "full" if value.lower() == "true" else "none"
    return value


@dataclass
class ActivationCheckpointConfig:
    """[activation_checkpoint]: what each transformer block keeps for backward."""

    mode: str = opt("none", "none, full, selective (every Nth block), op (per-op SAC) or memory_budget "
                    "(compile picks; needs compile.enable). true = full, false = none.",
                    choices=AC_MODES, parse=_parse_mode)
    selective_layer_interval: int = opt(2, "For mode=selective: checkpoint every Nth block.", min=1)
    memory_budget: float = opt(0.5, "For mode=memory_budget: 0 = recompute all, 1 = save all.", min=0.0, max=1.0)
    force_recompute_mm_fqns: list[str] = opt([], "Module-name patterns (fnmatch) whose matmuls are always recomputed.")
    preserve_rng_state: bool = opt(True, "Restore RNG state in the recompute so dropout masks match.")

    def validate(self, root) -> None:
        from trainer.configurable import ConfigError
        if self.mode == "memory_budget" and not root.compile.enable:
            raise ConfigError("config error: activation_checkpoint.mode: memory_budget needs compile; "
                              "set --compile.enable true or pick another mode")
