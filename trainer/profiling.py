"""torch.profiler traces and CUDA memory snapshots."""

from __future__ import annotations

from dataclasses import dataclass

from configuration.fields import opt


@dataclass
class ProfilingConfig:
    """[profiling]"""

    enable_profiling: bool = opt(False, "Write torch.profiler Chrome traces.")
    save_traces_folder: str = opt("profile_traces", "Trace folder, relative to job.dump_folder.")
    profile_freq: int = opt(10, "Trace one step every N steps.", min=1)
    enable_memory_snapshot: bool = opt(False, "Dump CUDA memory snapshots (CUDA only).")
    save_memory_snapshot_folder: str = opt("memory_snapshot", "Snapshot folder, relative to job.dump_folder.")


import contextlib
import logging
import pickle
from pathlib import Path

import torch

logger = logging.getLogger("trainer")


@contextlib.contextmanager
def maybe_profile(cfg: ProfilingConfig, dump_folder: str, rank: int, start_step: int):
    """Yields a profiler whose `.step()` the loop calls once per step (or None).

    Traces the last step of every `profile_freq` window, as Chrome JSON in
    <dump_folder>/<save_traces_folder>/iteration_<step>/rank<r>_trace.json.
    """
    if not cfg.enable_profiling:
        yield None
        return
    trace_dir = Path(dump_folder) / cfg.save_traces_folder
    step_box = [start_step]
    warmup = 1 if cfg.profile_freq > 2 else 0
    active = 1

    def on_ready(prof):
        out = trace_dir / f"iteration_{step_box[0]}"
        out.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(out / f"rank{rank}_trace.json"))
        logger.info(f"profiler trace written to {out}")

    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    schedule = torch.profiler.schedule(wait=cfg.profile_freq - warmup - active, warmup=warmup, active=active)
    with torch.profiler.profile(activities=activities, schedule=schedule, on_trace_ready=on_ready) as prof:
        class _Stepper:
            def step(self, step: int) -> None:
                step_box[0] = step
                prof.step()
        yield _Stepper()


class MemorySnapshotter:
    """CUDA allocator snapshots every `profile_freq` steps; on CPU it says so once and does nothing."""

    def __init__(self, cfg: ProfilingConfig, dump_folder: str, rank: int, device: torch.device):
        self.enabled = cfg.enable_memory_snapshot and device.type == "cuda"
        self.cfg, self.rank = cfg, rank
        self.folder = Path(dump_folder) / cfg.save_memory_snapshot_folder
        if cfg.enable_memory_snapshot and not self.enabled:
            logger.warning("profiling.enable_memory_snapshot: memory snapshots are CUDA-only; unavailable on "
                           f"{device.type}, skipping")
        if self.enabled:
            torch.cuda.memory._record_memory_history(max_entries=100000)

    def step(self, step: int) -> None:
        if self.enabled and step % self.cfg.profile_freq == 0:
            out = self.folder / f"iteration_{step}"
            out.mkdir(parents=True, exist_ok=True)
            with open(out / f"rank{self.rank}_memory_snapshot.pickle", "wb") as f:
                pickle.dump(torch.cuda.memory._snapshot(), f)
