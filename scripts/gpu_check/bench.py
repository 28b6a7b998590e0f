"""Trainer sections: the Llama 3 8B configs (one per section), chunked CE and DeepSeek 16B.

Honest numbers: each Llama config runs at 2 and 4 layers and the step time is extrapolated per
block to 32 layers (t32 = t4 + 28 x (t4 - t2) / 2): a 4-layer 8B spends ~31% of its FLOPs in
the 128k-vocab head, 5% at 32, so a 4-layer figure alone flatters nothing and says little.
Each timed step is synchronised at both ends; memory is the 4-layer run's max allocated and
reserved, next to the estimator's figure for that same config; host syncs are counted in one
more step under the sync debug mode (`common.count_syncs`).
"""

from __future__ import annotations

import gc
import statistics
import tempfile
import time

from gpu_check.common import count_syncs, device, gib, reason, register_flavor, sync, timed

import torch

LAYERS = (2, 4)
TARGET_LAYERS = 32


def _shape(dry: bool, model: str) -> tuple[str, int, int]:
    """(base flavor, seq_len, local batch) of a section's model."""
    if model == "llama3":
        return ("debug_small", 64, 2) if dry else ("8B", 8192, 1)
    return ("debug", 64, 2) if dry else ("16B", 4096, 1)


def trainer_args(dry: bool, model: str, n_layers: int, dump: str, extra: list[str]) -> list[str]:
    base, seq, batch = _shape(dry, model)
    flavor = register_flavor(model, base, f"gc_{model}_{n_layers}", n_layers=n_layers)
    args = ["--model.name", model, "--model.flavor", flavor, "--training.seq_len", str(seq),
            "--training.local_batch_size", str(batch), "--data.type", "synthetic", "--training.steps", "1000",
            "--metrics.log_freq", "1000000", "--metrics.enable_tensorboard", "false", "--job.dump_folder", dump,
            "--training.mixed_precision_param", "bfloat16", "--checkpoint.enable", "false"]
    if dry:  # bf16 on CPU as on the GPU; aot_eager stands in for inductor (a CPU inductor compile takes minutes)
        args += ["--training.mixed_precision_on_cpu", "true"]
        if "--compile.enable" in extra:
            args += ["--compile.backend", "aot_eager"]
    return args + extra


def measure(args: list[str], dev: torch.device, rows, config: str, label: str, *, estimate: bool,
            inspect=None) -> dict:
    """Builds a Trainer, runs warm-up and timed steps, one more step counting host syncs;
    `inspect(trainer)` (if given) runs once it is built."""
    import math

    from trainer.config import load_config
    from trainer.train import Trainer

    warmup, steps = (1, 2) if dev.type == "cpu" else (2, 4)
    cfg = load_config(args)
    est = None
    if estimate:
        rows.progress(config, f"{label}: memory estimate")
        est = _estimate(cfg, dev)
    rows.progress(config, f"{label}: build")
    trainer = Trainer(cfg)
    losses = []
    try:
        if inspect is not None:
            inspect(trainer)

        def step(batches):
            losses.append(trainer.train_step(batches, with_metrics=False).loss)

        rows.progress(config, f"{label}: {'compile + ' if cfg.compile.enable else ''}warm-up")
        first = timed(lambda: step(trainer.next_microbatches()), dev)
        for _ in range(warmup - 1):
            step(trainer.next_microbatches())
        if dev.type == "cuda":
            sync(dev)
            torch.cuda.reset_peak_memory_stats(dev)
        rows.progress(config, f"{label}: timed steps")
        times = []
        for _ in range(steps):
            batches = trainer.next_microbatches()
            times.append(timed(lambda: step(batches), dev))
        if dev.type == "cuda":
            alloc, reserved = torch.cuda.max_memory_allocated(dev), torch.cuda.max_memory_reserved(dev)
        else:
            from trainer.metrics import memory_stats

            alloc, reserved = memory_stats(dev)["memory/peak_rss_gib"] * 2**30, None
        rows.progress(config, f"{label}: sync count")
        batches = trainer.next_microbatches()
        with count_syncs(dev, compiled=cfg.compile.enable) as syncs:
            step(batches)
        from trainer.metrics import attention_flops_per_token

        return {"step_s": statistics.median(times), "first_s": first, "alloc": alloc, "reserved": reserved,
                "est": est, "syncs": f"{syncs['n']} ({syncs['how']})", "flops": trainer.flops_per_token,
                "attn_flops": attention_flops_per_token(trainer.model_args, cfg.training.seq_len),
                "tokens": cfg.training.local_batch_size * cfg.training.seq_len * trainer.grad_accum_steps,
                "loss_finite": all(math.isfinite(x) for x in losses)}
    finally:
        trainer.close(destroy_process_group=False)
        del trainer
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()


def _estimate(cfg, dev) -> str:
    # memory_budget's saved set is the compile partitioner's choice: the estimator has no count.
    if cfg.activation_checkpoint.mode == "memory_budget":
        return "n/a: memory_budget"
    try:
        from trainer.memory import estimate_memory

        return gib(estimate_memory(cfg, world_size=1, device=dev.type).total)
    except Exception as e:  # noqa: BLE001
        return f"n/a: {reason(e)}"


def extrapolate(m2: dict, m4: dict, peak_flops: float | None) -> dict:
    """Per-block extrapolation of the 2- and 4-layer runs to 32 layers (FLOPs per token and
    step time are both linear in the layer count)."""
    per = TARGET_LAYERS - LAYERS[1]
    block_s = (m4["step_s"] - m2["step_s"]) / (LAYERS[1] - LAYERS[0])
    if block_s <= 0:
        return {"tokens/s (32L)": "n/a: 4L not slower than 2L"}
    t32 = m4["step_s"] + per * block_s
    lin = lambda key: m4[key] + per * (m4[key] - m2[key]) / (LAYERS[1] - LAYERS[0])  # noqa: E731
    tps = m4["tokens"] / t32
    out = {"tokens/s (32L)": f"{tps:,.0f}"}
    if peak_flops:
        flops, attn = lin("flops"), lin("attn_flops")
        out["MFU %"] = f"{100 * flops * tps / peak_flops:.1f}"
        out["MFU causal %"] = f"{100 * (flops - attn / 2) * tps / peak_flops:.1f}"
    else:
        out["MFU %"] = out["MFU causal %"] = "n/a"
    return out


def run_llama(rows, dry: bool, compiled: bool, float8: bool, mode: str) -> None:
    from parallelisms.activation_checkpoint import AC_MODES
    from trainer.metrics import device_peak_flops

    dev = device(dry)
    config = f"AC {mode}, compile {'on' if compiled else 'off'}, float8 {'on' if float8 else 'off'}"
    if mode not in AC_MODES:
        rows.emit({"config": config, "result": f"n/a: this build has no AC mode {mode}"})
        return
    extra = ["--activation_checkpoint.mode", mode] + (["--compile.enable", "true"] if compiled else []) + \
        (["--float8.enable", "true"] if float8 else [])
    if float8 and not dry and torch.cuda.get_device_capability(dev) < (8, 9):
        rows.emit({"config": config, "result": "n/a: float8 needs compute capability >= 8.9"})
        return
    got = {}
    for n_layers in LAYERS:
        with tempfile.TemporaryDirectory() as dump:
            try:
                got[n_layers] = measure(trainer_args(dry, "llama3", n_layers, dump, extra), dev, rows, config,
                                        f"{n_layers} layers", estimate=n_layers == LAYERS[-1])
            except Exception as e:  # noqa: BLE001 - a failed config is a row of the report, not the end of it
                rows.emit({"config": config, "result": f"FAILED during {rows.phase}: {reason(e)}"})
                return
    m2, m4 = got[LAYERS[0]], got[LAYERS[1]]
    rows.emit({"config": config, **extrapolate(m2, m4, device_peak_flops(dev)),
               "alloc GiB": gib(m4["alloc"]) + ("" if dev.type == "cuda" else " (RSS)"),
               "reserved GiB": "n/a" if m4["reserved"] is None else gib(m4["reserved"]), "estimator GiB": m4["est"],
               "syncs/step": m4["syncs"],
               "result": f"ok: step {m2['step_s']:.3f} s (2L), {m4['step_s']:.3f} s (4L, "
                         f"{m4['tokens'] / m4['step_s']:,.0f} tokens/s); first step {m2['first_s']:.1f} s"})


def _plain_rows(rows, dry: bool, model: str, n_layers: int, configs: list[tuple[str, list[str]]]) -> None:
    """One trainer run per config at one depth: the figures as measured (no extrapolation)."""
    dev = device(dry)
    for config, extra in configs:
        with tempfile.TemporaryDirectory() as dump:
            t0 = time.perf_counter()
            try:
                m = measure(trainer_args(dry, model, n_layers, dump, extra), dev, rows, config, f"{n_layers} layers",
                            estimate=True)
            except Exception as e:  # noqa: BLE001
                rows.emit({"config": config, "result": f"FAILED during {rows.phase}: {reason(e)}"})
                continue
        rows.emit({"config": config, "alloc GiB": gib(m["alloc"]) + ("" if dev.type == "cuda" else " (RSS)"),
                   "reserved GiB": "n/a" if m["reserved"] is None else gib(m["reserved"]), "estimator GiB": m["est"],
                   "syncs/step": m["syncs"],
                   "result": f"ok: {m['tokens'] / m['step_s']:,.0f} tokens/s at {n_layers} layers (not extrapolated), "
                             f"{time.perf_counter() - t0:.0f} s"})


def run_chunked_ce(rows, dry: bool) -> None:
    _plain_rows(rows, dry, "llama3", 1, [(f"1 layer, AC full, chunked_ce {flag}",
                                          ["--activation_checkpoint.mode", "full", "--loss.chunked_ce", flag])
                                         for flag in ("false", "true")])


def run_deepseek(rows, dry: bool) -> None:
    configs = [(f"3 layers, AC {m}", ["--activation_checkpoint.mode", m]) for m in ("op", "full")]
    _plain_rows(rows, dry, "deepseek_v3", 3, configs)
