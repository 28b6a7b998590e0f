"""Metrics: console, TensorBoard and metrics.jsonl.

MFU convention (`mfu_pct`): TorchTitan's. Training FLOPs per token = 6 x the (activated)
non-embedding parameters + 12 x L x H x Dh x S for attention (6 x L x H x (Dqk + Dv) x S
for MLA), where 12 = 3 (forward and backward) x 2 (QK^T and PV) x 2 (multiply-add) over all
S keys, as if attention were not causal. That is the figure peers publish, so it is the one
to compare. A causal kernel does half the attention work: `mfu_causal_pct` counts half the
attention term. Both are conventions of the packed window: document masking changes
neither. The per-model formulas and their FlopCounterMode audit: docs/performance.md.
The peak is the device's dense bf16 rate, looked up by the exact model name in the CUDA
device name (so "H100 PCIe" is not taken for an H100 SXM, nor an L40 for an L4).

Stragglers (`StragglerMonitor`): each rank's mean step time since the last log step rides in
per-rank slots of the step's one loss all-reduce on log steps (no sync of its own); every
record gets the slowest rank, its step time, the median and the lag between them.

After a resume from step N, metrics.jsonl keeps only the records up to N (the steps after
it are trained again), and TensorBoard purges the same steps, so each step appears once.
"""

from __future__ import annotations

from dataclasses import dataclass

from configuration.fields import opt


@dataclass
class MetricsConfig:
    """[metrics]"""

    log_freq: int = opt(10, "Log every N steps (and the first and last).", min=1)
    enable_tensorboard: bool = opt(True, "Write TensorBoard events under <dump_folder>/<save_tb_folder>.")
    save_tb_folder: str = opt("tb", "TensorBoard folder, relative to job.dump_folder.")
    straggler_factor: float = opt(2.0, "Warn, naming the rank, when a rank's step time (its own work, without "
                                  "waiting in the loop's all-reduces) exceeds this many times the median rank's "
                                  "for straggler_log_steps log steps in a row.", min=1.0)
    straggler_log_steps: int = opt(3, "Log steps in a row a rank must be slow before the straggler warning.", min=1)


import contextlib
import json
import logging
import re
import resource
import statistics
import time
from pathlib import Path

import torch

logger = logging.getLogger("trainer")

# Dense (no sparsity) bf16 peak FLOP/s per device model; per form factor where they differ.
# Sources: the vendors' datasheets, whose tensor-core figures are "with sparsity": halved here.
#   H100 / H800: SXM 1,979 / PCIe 1,513 / NVL 1,671 TF sparse (nvidia.com/en-us/data-center/h100).
#   H200: SXM 1,979 / NVL 1,671 TF sparse (nvidia.com/en-us/data-center/h200): the NVL board runs
#     at a lower clock and power (600 W), so it is not an SXM part. GH200: the H100 SXM die.
#   H20 (the China-market Hopper): 148 TF dense bf16 (NVIDIA's H20 product brief).
#   B200 (HGX B200): 36 PF sparse per 8 GPUs = 2.25 PF dense per GPU. GB200 (NVL72): 360 PF
#     sparse per 72 GPUs = 2.5 PF dense per GPU (higher clocks than HGX B200).
#   A100 / A800: 312 TF dense. A10: 125 TF dense. L40S 362 / L40 181 / L4 121 TF dense.
#   MI300X / MI325X: 1,307 TF dense bf16 (amd.com Instinct datasheets).
PEAK_BF16_FLOPS: dict[str, float | dict[str | None, float]] = {
    "H100": {"PCIe": 756e12, "NVL": 835e12, None: 989e12},  # None: SXM and HBM3 boards
    "H800": {"PCIe": 756e12, None: 989e12},
    "H200": {"NVL": 835.5e12, None: 989e12},  # None: SXM ("NVIDIA H200")
    "GH200": 989e12, "H20": 148e12,
    "B200": 2250e12, "GB200": 2500e12,
    "A100": 312e12, "A800": 312e12, "A10": 125e12,
    "L40S": 362e12, "L40": 181e12, "L4": 121e12, "A10G": 70e12,
    "MI300X": 1307e12, "MI325X": 1307e12,
}
_VENDOR_WORDS = {"nvidia", "amd", "instinct", "tesla", "radeon"}
_unknown_warned: set[str] = set()


def peak_flops_for(name: str) -> float | None:
    """The dense bf16 peak of a CUDA device name ("NVIDIA H100 PCIe", "NVIDIA A100-SXM4-80GB",
    "NVIDIA GH200 480GB", "AMD Instinct MI300X"), by exact model word; None if unknown."""
    words = [w for w in re.split(r"[\s_-]+", name) if w and w.lower() not in _VENDOR_WORDS]
    if not words:
        return None
    entry = PEAK_BF16_FLOPS.get(words[0].upper())
    if isinstance(entry, dict):
        variants = {w.lower() for w in words[1:]}
        return next((v for k, v in entry.items() if k is not None and k.lower() in variants), entry[None])
    return entry


def device_peak_flops(device: torch.device) -> float | None:
    """Peak dense bf16 FLOP/s, or None where MFU is not defined (CPU, unknown GPUs: said once)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    peak = peak_flops_for(name)
    if peak is None and name not in _unknown_warned:
        _unknown_warned.add(name)
        logger.warning(f"MFU: no peak FLOP/s known for {name!r}; add it to trainer.metrics.PEAK_BF16_FLOPS")
    return peak


def attention_flops_per_token(model_args, seq_len: int) -> float:
    """The attention (scores and values) part of the model's FLOPs per token, in the
    non-causal convention: its `flops_per_token` is linear in seq_len, so f(S) - f(0)."""
    fn = getattr(model_args, "flops_per_token", None)
    return float(fn(seq_len, 0, 0) - fn(0, 0, 0)) if fn is not None else 0.0


def memory_stats(device: torch.device) -> dict[str, float]:
    """Peak memory: on CUDA since the last `reset_peak_memory` (each logged record's window, as
    TorchTitan logs it); on CPU the process's peak RSS (which cannot be reset)."""
    if device.type == "cuda":
        return {"memory/max_allocated_gib": torch.cuda.max_memory_allocated(device) / 2**30,
                "memory/max_reserved_gib": torch.cuda.max_memory_reserved(device) / 2**30}
    # ru_maxrss is in KiB on Linux.
    return {"memory/peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


class MetricsLogger:
    """Writes one record per logged step to the console, TensorBoard and metrics.jsonl.

    Only the rank that holds the loss (the last pipeline stage's first rank) writes.
    """

    def __init__(self, cfg: MetricsConfig, dump_folder: str, *, enabled: bool, device: torch.device,
                 flops_per_token: float, non_data_parallel_size: int, start_step: int = 0,
                 attention_flops_per_token: float = 0.0):
        self.cfg, self.enabled, self.device = cfg, enabled, device
        self.flops_per_token = flops_per_token
        self.causal_flops_per_token = flops_per_token - attention_flops_per_token / 2
        self.non_dp = non_data_parallel_size
        self.peak_flops = device_peak_flops(device)
        self.jsonl = Path(dump_folder) / "metrics.jsonl"
        self.tb = None
        if enabled:
            from trainer.errors import check_writable_folder

            check_writable_folder(dump_folder, "job.dump_folder")
            self._drop_records_after(start_step)
            if cfg.enable_tensorboard:
                from torch.utils.tensorboard import SummaryWriter
                self.tb = SummaryWriter(log_dir=str(Path(dump_folder) / cfg.save_tb_folder),
                                        purge_step=start_step + 1)
        self._t0 = time.perf_counter()
        self._tokens = 0
        self._steps = 0

    def _drop_records_after(self, step: int) -> None:
        """A run that starts at `step` trains the later steps again: drop their old records."""
        if not self.jsonl.is_file():
            return
        lines = self.jsonl.read_text().splitlines()
        keep = [ln for ln in lines if ln.strip() and json.loads(ln).get("step", 0) <= step]
        if len(keep) != len([ln for ln in lines if ln.strip()]):
            tmp = self.jsonl.with_name(self.jsonl.name + ".tmp")
            tmp.write_text("".join(ln + "\n" for ln in keep))
            tmp.replace(self.jsonl)
            logger.info(f"metrics.jsonl: dropped {len(lines) - len(keep)} records after step {step} "
                        "(trained again from there)")

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
        mfu_causal = 100 * self.causal_flops_per_token * tps / self.peak_flops if self.peak_flops else None
        rec = {"step": step, "loss": loss, "grad_norm": grad_norm, "lr": lr, "tokens_per_s": tps,
               "mfu_pct": mfu, "mfu_causal_pct": mfu_causal, "step_time_s": elapsed / max(self._steps, 1),
               **memory_stats(self.device), **(extra or {})}
        self.reset_timer()
        reset_peak_memory(self.device)  # the next record's peak is its own window's, not the first step's
        if not self.enabled:
            return rec
        mem = next(iter(v for k, v in rec.items() if k.startswith("memory/")))
        logger.info(f"step {step:>6} | loss {loss:8.4f} | grad_norm {grad_norm:7.3f} | lr {lr:.2e} | "
                    f"tokens/s {tps:9.0f} | mfu {'n/a' if mfu is None else f'{mfu:.1f}% (causal {mfu_causal:.1f}%)'} | "
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


class StragglerMonitor:
    """Per-rank step times on log steps, from the loss all-reduce's per-rank slots.

    A rank's step time here is its own work: the step's wall time minus what it waited in
    the loop's blocking all-reduces (the token count, the loss), where every other rank
    waits for the slow one. A rank slow before those (data, host stalls) is found exactly;
    one slow inside FSDP's or TP's collectives makes its peers wait there too, so it shows
    less. On CUDA the times are host-side (the loss all-reduce's wait shows at its read)."""

    def __init__(self, cfg: MetricsConfig, rank: int, world_size: int, *, log: bool):
        self.factor, self.patience = cfg.straggler_factor, cfg.straggler_log_steps
        self.rank, self.world, self.log = rank, world_size, log
        self._busy = 0.0
        self._steps = 0
        self._slow_in_a_row: dict[int, int] = {}
        self._step_t0 = 0.0
        self._wait = 0.0
        self._warm = False

    def start_step(self) -> None:
        self._step_t0, self._wait = time.perf_counter(), 0.0

    @contextlib.contextmanager
    def waiting(self):
        """A blocking collective where the others wait for the slowest rank: not its own work."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._wait += time.perf_counter() - t0

    def end_step(self) -> None:
        if not self._warm:  # the first step (compile, first allocations) is no one's steady pace
            self._warm = True
            return
        self._busy += time.perf_counter() - self._step_t0 - self._wait
        self._steps += 1

    def slots(self, with_metrics: bool) -> float | None:
        """This rank's mean step time since the last log step, to ride in its slot; None on
        other steps (then no slots) and when no step completed since (steps 1 and 2: the first
        step is not counted)."""
        if not with_metrics or self.world <= 1 or self._steps == 0:
            return None
        mean = self._busy / self._steps
        self._busy, self._steps = 0.0, 0
        return mean

    def observe(self, times: list[float], step: int) -> dict[str, float]:
        """Every rank's mean step time -> the record's fields; warns about a persistent straggler."""
        median = statistics.median_low(times)  # a real rank's time: with 2 ranks, the faster one
        slowest = max(range(len(times)), key=lambda r: times[r])
        slow = [r for r, t in enumerate(times) if median > 0 and t > self.factor * median]
        self._slow_in_a_row = {r: self._slow_in_a_row.get(r, 0) + 1 for r in slow}
        if self.log:
            for r in slow:
                if self._slow_in_a_row[r] == self.patience:
                    logger.warning(f"straggler: rank {r} took {times[r]:.3f} s per step against the median "
                                   f"{median:.3f} s ({times[r] / median:.1f}x > metrics.straggler_factor "
                                   f"{self.factor:g}) for {self.patience} log steps in a row, up to step {step}")
        return {"straggler/slowest_rank": float(slowest), "straggler/slowest_step_s": times[slowest],
                "straggler/median_step_s": median, "straggler/lag_s": times[slowest] - median}
