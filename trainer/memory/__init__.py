"""Per-rank training memory: estimated from the model the trainer assembles, and measured.

`estimate_memory(cfg, world_size=...)` lays one rank of the config out with the trainer's
own assembly path (`parallelisms.apply.build_model_parts`: PP split, TP -> EP -> AC ->
FSDP) on fake tensors under a fake process group, reads what that rank holds, and runs
its blocks and its head on fake tensors to count what they keep and allocate. Nothing
is allocated; the estimator holds no copy of any parallel plan. Modules:

- `assemble`: the layout (`Layout`, `default_world_size`) and the fake-world assembly;
- `probes`: `LiveBytesTracker` and the block / head probes on the assembled modules;
- `estimate`: `MemoryEstimate`, `estimate_memory`, `format_estimate`;
- `measure`: `measure_step`, one real step on this machine (saved bytes, peak RSS);
- `validate`: `ValidationCase`, `validate_cases`: estimate vs measurement, per case.

`scripts/estimate_memory.py` is the command line; docs/memory.md explains the numbers.
"""

from trainer.memory.assemble import Layout, default_world_size, resolve_layout
from trainer.memory.estimate import GiB, MiB, MemoryEstimate, estimate_memory, fmt_bytes, format_estimate
from trainer.memory.measure import _hwm_bytes, _malloc_trim, _reset_hwm, _rss_bytes, measure_step
from trainer.memory.probes import BlockProbe, HeadProbe, LiveBytesTracker, probe_block, probe_head
from trainer.memory.validate import MALLOC_ENV, ValidationCase, format_validation, run_measurements, validate_cases

__all__ = [
    "GiB", "MiB", "Layout", "default_world_size", "resolve_layout", "MemoryEstimate", "estimate_memory",
    "fmt_bytes", "format_estimate", "measure_step", "BlockProbe", "HeadProbe", "LiveBytesTracker", "probe_block",
    "probe_head", "MALLOC_ENV", "ValidationCase", "format_validation", "run_measurements", "validate_cases",
    "_hwm_bytes", "_malloc_trim", "_reset_hwm", "_rss_bytes",
]
