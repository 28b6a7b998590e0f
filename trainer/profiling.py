"""torch.profiler traces and CUDA memory snapshots."""

from __future__ import annotations

from dataclasses import dataclass

from trainer.configurable import opt


@dataclass
class ProfilingConfig:
    """[profiling]"""

    enable_profiling: bool = opt(False, "Write torch.profiler Chrome traces.")
    save_traces_folder: str = opt("profile_traces", "Trace folder, relative to job.dump_folder.")
    profile_freq: int = opt(10, "Trace one step every N steps.", min=1)
    enable_memory_snapshot: bool = opt(False, "Dump CUDA memory snapshots (CUDA only).")
    save_memory_snapshot_folder: str = opt("memory_snapshot", "Snapshot folder, relative to job.dump_folder.")
