"""Metrics: console, TensorBoard and metrics.jsonl."""

from __future__ import annotations

from dataclasses import dataclass

from trainer.configurable import opt


@dataclass
class MetricsConfig:
    """[metrics]"""

    log_freq: int = opt(10, "Log every N steps (and the first and last).", min=1)
    enable_tensorboard: bool = opt(True, "Write TensorBoard events under <dump_folder>/<save_tb_folder>.")
    save_tb_folder: str = opt("tb", "TensorBoard folder, relative to job.dump_folder.")
