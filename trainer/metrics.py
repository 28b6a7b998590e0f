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


import contextlib
import json
import logging
import resource
import time
from pathlib import Path

import torch

logger = logging.getLogger("trainer")

# Dense bf16 peak FLOP/s by device-name substring (first match wins).
PEAK_BF16_FLOPS = (
    ("H200", 989e12), ("H100", 989e12), ("H800", 989e12), ("GH200", 989e12), ("B200", 2250e12),
    ("A100", 312e12), ("A800", 312e12), ("L40S", 362e12), ("L4", 121e12), ("A10G", 70e12), ("MI300X", 1307e12),
)


def device_peak_flops(device: torch.device) -> float | None:
    """Peak dense bf16 FLOP/s, or None where MFU is not defined (CPU, unknown GPUs)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((flops for key, flops in PEAK_BF16_FLOPS if key in name), None)


def memory_stats(device: torch.device) -> dict[str, float]:
    if device.type == "cuda":
        return {"memory/max_allocated_gib": torch.cuda.max_memory_allocated(device) / 2**30,
                "memory/max_reserved_gib": torch.cuda.max_memory_reserved(device) / 2**30}
    # ru_maxrss is in KiB on Linux.
    return {"memory/peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}


class MetricsLogger:
    """Writes one record per logged step to the console, TensorBoard and metrics.jsonl.

    Only the rank that holds the loss (the last pipeline stage's first rank) writes.
    """

    def __init__(self, cfg: MetricsConfig, dump_folder: str, *, enabled: bool, device: torch.device,
                 flops_per_token: float, non_data_parallel_size: int):
        self.cfg, self.enabled, self.device = cfg, enabled, device
        self.flops_per_token = flops_per_token
        self.non_dp = non_data_parallel_size
        self.peak_flops = device_peak_flops(device)
        self.jsonl = Path(dump_folder) / "metrics.jsonl"
        self.tb = None
        if enabled:
            self.jsonl.parent.mkdir(parents=True, exist_ok=True)
            if cfg.enable_tensorboard:
                from torch.utils.tensorboard import SummaryWriter
                self.tb = SummaryWriter(log_dir=str(Path(dump_folder) / cfg.save_tb_folder))
        self._t0 = time.perf_counter()
        self._tokens = 0
        self._steps = 0

    def should_log(self, step: int, last_step: bool) -> bool:
        return step == 1 or last_step or step % self.cfg.log_freq == 0

    def reset_timer(self) -> None:
        self._t0 = time.perf_counter()
        self._tokens = self._steps = 0

    @contextlib.contextmanager
    def paused(self):
        """Time spent inside (a validation pass) does not count toward tokens/s or step time."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self._t0 += time.perf_counter() - start

    def add_tokens(self, tokens: int) -> None:
        """Counts one step's tokens on this rank (called every step; logging happens every log_freq)."""
        self._tokens += tokens
        self._steps += 1

    def record(self, step: int, *, loss: float, grad_norm: float, lr: float,
               extra: dict[str, float] | None = None) -> dict[str, float] | None:
        elapsed = time.perf_counter() - self._t0
        # tokens/s per device: a TP/PP/CP group shares one stream of tokens.
        tps = self._tokens / max(elapsed, 1e-9) / self.non_dp
        mfu = 100 * self.flops_per_token * tps / self.peak_flops if self.peak_flops else None
        rec = {"step": step, "loss": loss, "grad_norm": grad_norm, "lr": lr, "tokens_per_s": tps,
               "mfu_pct": mfu, "step_time_s": elapsed / max(self._steps, 1), **memory_stats(self.device),
               **(extra or {})}
        self.reset_timer()
        if not self.enabled:
            return rec
        mem = next(iter(v for k, v in rec.items() if k.startswith("memory/")))
        logger.info(f"step {step:>6} | loss {loss:8.4f} | grad_norm {grad_norm:7.3f} | lr {lr:.2e} | "
                    f"tokens/s {tps:9.0f} | mfu {'n/a (CPU)' if mfu is None else f'{mfu:.1f}%'} | "
                    f"mem {mem:.2f} GiB")
        with open(self.jsonl, "a") as f:
            f.write(json.dumps(rec) + "\n")
        if self.tb is not None:
            for k, v in rec.items():
                if k != "step" and v is not None:
                    self.tb.add_scalar(k if "/" in k else f"train/{k}", v, step)
            self.tb.flush()
        return rec

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
