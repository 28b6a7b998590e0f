"""Measuring a real training step on this machine: saved activation bytes and peak RSS growth.

Why RSS and a fresh process: on CPU there is no allocator statistic like
`torch.cuda.max_memory_allocated`; with a fixed glibc mmap threshold (`MALLOC_ENV` in
`trainer.memory.validate`) every allocation above 64 KiB gets its own mapping and is
returned on free, so resident memory follows the live bytes, and the kernel's
high-water mark (`VmHWM`, reset through `/proc/self/clear_refs`) gives a step's peak.

`measure_step(argv)` builds the trainer for `argv` in this process (any layout: run it
under torchrun for several ranks) and measures one step. `python -m
trainer.memory.measure --measure-cases CASES.json` runs a list of cases in one process
(one process group for all of them), writing one JSON result per case and rank.
"""

from __future__ import annotations

import gc
import os

import torch


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _hwm_bytes() -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _reset_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _malloc_trim() -> None:
    try:
        import ctypes
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except Exception:  # noqa: BLE001
        pass


class _PeakSampler:
    """Samples RSS from /proc/self/statm in a thread (fallback when VmHWM cannot be reset)."""

    def __init__(self, interval_s: float = 0.0005):
        import threading
        self.interval = interval_s
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, _rss_bytes())
            self._stop.wait(self.interval)

    def __enter__(self):
        self.peak = _rss_bytes()
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss_bytes())


def _local_tensors(tensors):
    for t in tensors:
        yield t.to_local() if hasattr(t, "to_local") else t


def _optimizer_states(trainer):
    """The local tensors of every optimizer's state (scalar step counters included)."""
    return _local_tensors(v for o in trainer.optimizers for st in o.state.values() for v in st.values()
                          if isinstance(v, torch.Tensor))


def _tensor_peaks(trainer, steps: int = 5) -> tuple[int, int]:
    """`steps` more steps under `LiveBytesTracker`: the peak of the tensors a step allocates
    (above the parameters, buffers and optimizer states), over the whole step and over the
    optimizer step alone (its pre- and post-hooks bracket it: the gradients, complete by then,
    count); the smallest of the steps'. Why the smallest: gloo's worker thread holds a
    collective's tensors for a moment after waking the caller, so a buffer that FSDP2 or Muon
    drops may outlive the next allocation; that race only adds (one FSDP 2 step peaked at
    21.4 MiB in some runs, 24.4 in another), and the step's own tensors are what is left
    without it."""
    from trainer.memory.probes import LiveBytesTracker

    parts = trainer.model_parts
    # Local shards: `plain_tensors` keeps an nn.Parameter (FSDP2's DTensor parameters) whole.
    resident = list(_local_tensors(t for p in parts for t in list(p.parameters()) + list(p.buffers())))
    resident += _optimizer_states(trainer)
    peaks = []
    for _ in range(steps):
        batches = trainer.next_microbatches()
        for opt in trainer.optimizers:
            opt.zero_grad(set_to_none=True)
        gc.collect()
        seen = {"step": 0, "before": 0}
        with LiveBytesTracker(resident, follow_resizes=True) as tracker:
            def before(*_):
                seen["before"] = tracker.peak  # the step's peak so far, kept while the optimizer's is taken
                tracker.reset_peak()

            def after(*_):
                seen["step"] = max(seen["step"], tracker.peak)
                tracker.peak = max(tracker.peak, seen["before"])

            hooks = [h for o in trainer.optimizers for h in (o.register_step_pre_hook(before),
                                                               o.register_step_post_hook(after))]
            try:
                trainer.train_step(batches)
            finally:
                for h in hooks:
                    h.remove()
        peaks.append((int(tracker.peak), int(seen["step"])))
    return min(p for p, _ in peaks), min(s for _, s in peaks)


def measure_step(argv: list[str], tensor_peak: bool = False) -> dict:
    """Builds the trainer for `argv` in this process, runs one warm-up step (AC policies
    calibrate on it), one step counting the activation bytes saved for backward with the
    AC module's counter (autograd saved tensors + SAC cache), then measures the peak RSS growth of one more step
    above a baseline taken after the warm-up with gradients freed (params + optimizer
    states resident). Run it in a fresh process with `MALLOC_ENV` so that frees return
    memory. Leaves the process group (if any) open for the next case.

    `tensor_peak`: more steps under `LiveBytesTracker` (`_tensor_peaks`), whose peak is the step's tensor
    bytes alone (what the estimate counts), without the runtime's own growth (gloo's
    buffers, Python objects, small mallocs) that RSS adds: 5-9 MiB, which decides a small
    step's RSS error and varies from machine to machine."""
    from parallelisms.ac_measure import SavedActivationCounter
    from trainer.config import load_config
    from trainer.train import Trainer

    cfg = load_config(argv)
    trainer = Trainer(cfg)
    try:
        parts = trainer.model_parts
        exclude = [t for p in parts for t in list(p.parameters()) + list(p.buffers())]
        trainer.train_step(trainer.next_microbatches())  # AC policies record their plans on a block's first call
        batches = trainer.next_microbatches()
        with SavedActivationCounter(exclude) as counter:
            trainer.train_step(batches)
        saved = counter.total_bytes
        saved_breakdown = dict(counter.bytes_by_source)
        del counter, exclude
        batches = trainer.next_microbatches()
        for opt in trainer.optimizers:
            opt.zero_grad(set_to_none=True)
        gc.collect()
        _malloc_trim()
        base = _rss_bytes()
        hwm_ok = _reset_hwm()
        with _PeakSampler() as sampler:
            trainer.train_step(batches)
        hwm = _hwm_bytes() if hwm_ok else None
        peak = max(sampler.peak, hwm or 0)
        tracked = step_tracked = None
        if tensor_peak:
            tracked, step_tracked = _tensor_peaks(trainer)
        persistent = sum(t.numel() * t.element_size() for p in parts for t in _local_tensors(p.parameters()))
        persistent += sum(t.numel() * t.element_size() for t in _optimizer_states(trainer) if t.dim() > 0)
        return {"saved_bytes": int(saved), "saved_breakdown": saved_breakdown, "rss_base": base, "rss_peak": peak,
                "peak_growth": int(peak - base), "hwm_used": hwm is not None, "sampler_peak": sampler.peak,
                "persistent_bytes": int(persistent), "rank": trainer.rank, "tensor_peak": tracked,
                "optimizer_step_tensor_peak": step_tracked}
    finally:
        trainer.close(destroy_process_group=False)


def _measure_main(spec_path: str) -> int:
    import json

    import torch.distributed as dist

    for case in json.loads(open(spec_path).read()):
        result = measure_step(case["argv"], tensor_peak=case.get("tensor_peak", False))
        with open(f"{case['out']}.rank{result['rank']}", "w") as f:
            json.dump(result, f)
        gc.collect()
        _malloc_trim()
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    import sys
    if len(sys.argv) == 3 and sys.argv[1] == "--measure-cases":
        from trainer.distributed import exit_process
        exit_process(_measure_main(sys.argv[2]))
    print("usage: python -m trainer.memory.measure --measure-cases CASES.json  "
          "(see scripts/estimate_memory.py --validate)")
    sys.exit(2)
