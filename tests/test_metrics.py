"""Metrics: the MFU peak table, the MFU conventions, and one record per step after a resume."""

from __future__ import annotations

import shutil

import pytest
import torch

from tests.helpers import TINY, read_metrics, run_in_process
from trainer import metrics
from trainer.metrics import MetricsConfig, MetricsLogger, attention_flops_per_token


@pytest.mark.parametrize("name, peak", [
    ("NVIDIA H100 80GB HBM3", 989e12),
    ("NVIDIA H100 PCIe", 756e12),     # before: 989e12 (substring "H100")
    ("NVIDIA H100 NVL", 835e12),      # before: 989e12
    ("NVIDIA GH200 480GB", 989e12),   # before: matched by the "H200" entry
    ("NVIDIA H200", 989e12),          # SXM
    ("NVIDIA H200 NVL", 835.5e12),    # before: 989e12 (taken for the SXM part)
    ("NVIDIA H20", 148e12),           # before: unknown; not an H200
    ("NVIDIA GB200", 2500e12),        # before: unknown
    ("NVIDIA H800 PCIe", 756e12),
    ("NVIDIA L40", 181e12),           # before: 121e12 (substring "L4")
    ("NVIDIA L40S", 362e12),
    ("NVIDIA L4", 121e12),
    ("NVIDIA A100-SXM4-80GB", 312e12),
    ("NVIDIA A100 80GB PCIe", 312e12),
    ("NVIDIA A10G", 70e12),
    ("NVIDIA B200", 2250e12),
    ("AMD Instinct MI300X", 1307e12),
    ("NVIDIA GeForce RTX 4090", None),  # unknown: MFU n/a, said once
    ("NVIDIA A10", 125e12),             # not an A100, not an A10G
    ("NVIDIA RTX A6000", None),
])
def test_peak_flops_by_exact_device_model(monkeypatch, name, peak):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    assert metrics.device_peak_flops(torch.device("cuda", 0)) == peak
    assert metrics.device_peak_flops(torch.device("cpu")) is None


def test_mfu_in_torchtitan_convention_and_causal(monkeypatch, tmp_path):
    from models.llama3 import LLAMA3_FLAVORS

    args = LLAMA3_FLAVORS["debug"]
    attn = attention_flops_per_token(args, 256)
    assert attn == 12 * args.n_layers * args.n_heads * args.head_dim * 256  # 12 * L * H * Dh * S
    monkeypatch.setattr(metrics, "device_peak_flops", lambda device: 1e12)
    log = MetricsLogger(MetricsConfig(enable_tensorboard=False), str(tmp_path), enabled=False,
                        device=torch.device("cpu"), flops_per_token=10 * attn, non_data_parallel_size=1,
                        attention_flops_per_token=attn)
    log.add_tokens(1000)
    rec = log.record(1, loss=1.0, grad_norm=1.0, lr=1e-3)
    tps = rec["tokens_per_s"]
    assert rec["mfu_pct"] == pytest.approx(100 * 10 * attn * tps / 1e12)
    assert rec["mfu_causal_pct"] == pytest.approx(100 * 9.5 * attn * tps / 1e12)  # attention halved


def test_each_record_reports_its_own_window_peak_memory(monkeypatch, tmp_path):
    """On CUDA a record's memory/max_* figures are the peaks since the previous record (the
    peak stats are reset after each), not the largest since the start (the first step's
    compile and allocator warm-up would hide every later change)."""
    peaks = {"allocated": 0, "reserved": 0}
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: peaks["allocated"])
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device=None: peaks["reserved"])
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: peaks.update(allocated=0, reserved=0))
    monkeypatch.setattr(metrics, "device_peak_flops", lambda device: None)
    log = MetricsLogger(MetricsConfig(enable_tensorboard=False), str(tmp_path), enabled=False,
                        device=torch.device("cuda", 0), flops_per_token=1.0, non_data_parallel_size=1)
    got = []
    for allocated in (8 * 2**30, 3 * 2**30):  # the first window's peak (compile) is higher
        peaks.update(allocated=max(peaks["allocated"], allocated), reserved=max(peaks["reserved"], 2 * allocated))
        got.append(log.record(len(got) + 1, loss=1.0, grad_norm=1.0, lr=1e-3))
    assert [r["memory/max_allocated_gib"] for r in got] == [8.0, 3.0]
    assert [r["memory/max_reserved_gib"] for r in got] == [16.0, 6.0]


def test_deepseek_attention_term():
    from models.deepseek_v3.args import DEEPSEEK_V3_FLAVORS

    a = DEEPSEEK_V3_FLAVORS["debug"]
    assert attention_flops_per_token(a, 128) == 6 * a.n_layers * a.n_heads * (a.qk_head_dim + a.v_head_dim) * 128


def test_each_step_once_in_metrics_after_resume(tmp_path):
    """A run logged steps 1-6, then lost its last checkpoints (a crash before they were
    complete); the resume from step 2 trains 3-6 again. Before: metrics.jsonl then held 3-6 twice."""
    common = TINY + ["--training.steps", "6", "--checkpoint.enable", "--checkpoint.interval", "2",
                     "--job.dump_folder", str(tmp_path), "--metrics.enable_tensorboard", "true"]
    first, _ = run_in_process(common)
    for step in (4, 6):
        shutil.rmtree(tmp_path / "checkpoint" / f"step-{step}")
    second, _ = run_in_process(common)
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    assert [r["loss"] for r in records] == first  # bitwise: the resumed steps are the same steps
    assert second == first[2:]
    # The logged lr is the rate of the step's own update (before: the next step's), resumed too.
    from trainer.optim import LRSchedulerConfig, lr_factor

    sched = LRSchedulerConfig(warmup_steps=2)
    assert [r["lr"] for r in records] == pytest.approx([1e-3 * lr_factor(s - 1, 6, sched) for s in range(1, 7)])
    assert records[0]["lr"] == pytest.approx(1e-3 / 3)


def test_expert_load_metrics_only_on_logging_steps(monkeypatch, tmp_path):
    """The load metrics cost a device-to-host copy: a step that is not logged skips them (the
    bias update still runs every step)."""
    import models.common.moe_balance as balance
    from trainer.config import load_config
    from trainer.train import Trainer

    calls = []
    real = balance.expert_load_metrics
    monkeypatch.setattr(balance, "expert_load_metrics", lambda *a: calls.append(1) or real(*a))
    trainer = Trainer(load_config(["--config", "deepseek_debug.toml", "--data.type", "synthetic", "--training.seq_len",
                                   "32", "--training.local_batch_size", "2", "--metrics.enable_tensorboard", "false",
                                   "--job.dump_folder", str(tmp_path)]))
    try:
        bias = [b.detach().clone() for n, b in trainer.model_parts[0].named_buffers() if n.endswith("expert_bias")]
        quiet = trainer.train_step(trainer.next_microbatches(), with_metrics=False)
        assert calls == [] and not any(k.startswith("moe/") for k in quiet.extra_metrics)
        after = [b for n, b in trainer.model_parts[0].named_buffers() if n.endswith("expert_bias")]
        assert bias and any(not torch.equal(a, b) for a, b in zip(after, bias))  # the update ran
        logged = trainer.train_step(trainer.next_microbatches(), with_metrics=True)
        assert calls == [1] and logged.extra_metrics["moe/max_over_mean"] >= 1.0
    finally:
        trainer.close()
