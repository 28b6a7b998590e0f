"""Per-block torch.compile."""

from __future__ import annotations

from dataclasses import dataclass

from trainer.configurable import opt


@dataclass
class CompileConfig:
    """[compile]: torch.compile each transformer block."""

    enable: bool = opt(False, "Compile each transformer block (wrapped by AC when AC is on).")
    backend: str = opt("inductor", "torch.compile backend.")
