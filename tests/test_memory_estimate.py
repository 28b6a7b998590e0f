"""The memory estimator: runs on fake tensors for the shipped configs, and agrees with a
real training step on this CPU (saved activation bytes within 5%, peak within 15%), also
under TP and EP, where the local shapes come from the real plans."""

from __future__ import annotations

import math

import pytest
import torch

from trainer.config import load_config
from trainer.memory import (
    LiveBytesTracker,
    ValidationCase,
    default_world_size,
    estimate_memory,
    format_validation,
    validate_cases,
)

DEBUG = ["--config", "llama_debug.toml", "--data.type", "synthetic", "--metrics.enable_tensorboard", "false",
         "--loss.ce_chunk_size", "128"]


def _check_rows(rows, peak_tol: float = 0.15):
    text = format_validation(rows)
    for r in rows:
        assert r["hwm_used"], text
        assert abs(r["saved_err"]) <= 0.05, text
        assert abs(r["peak_err"]) <= peak_tol, text
        assert abs(r["total_err"]) <= 0.15, text
    return text


@pytest.mark.timeout(500)
def test_estimate_matches_a_real_step_single_rank(tmp_path):
    cases = [ValidationCase(f"{mode}{'-chunked' if chunked else ''}",
                            DEBUG + ["--activation_checkpoint.mode", mode, "--loss.chunked_ce", str(chunked).lower()])
             for mode in ("none", "op") for chunked in (False, True)]
    rows = validate_cases(cases, str(tmp_path), timeout=450)
    print(_check_rows(rows))
    by = {r["case"]: r for r in rows}
    # Chunked CE keeps less for backward, by at least the fp32 log-probs of the logits.
    logits = 4 * 256 * 2048 * 4
    for mode in ("none", "op"):
        assert by[mode]["meas_saved"] - by[f"{mode}-chunked"]["meas_saved"] >= logits
        assert by[mode]["est_saved"] - by[f"{mode}-chunked"]["est_saved"] >= logits


@pytest.mark.multirank
@pytest.mark.timeout(500)
def test_estimate_matches_a_real_step_two_rank_fsdp(tmp_path):
    rows = validate_cases([ValidationCase("fsdp2-full", DEBUG + ["--activation_checkpoint.mode", "full"], nproc=2)],
                          str(tmp_path), timeout=450)
    print(_check_rows(rows))


@pytest.mark.multirank
@pytest.mark.timeout(500)
def test_estimate_counts_muon_state_and_step(tmp_path):
    """Muon (trainer/muon.py): its momentum buffers are counted exactly (one fp32 copy of the
    Muon matrices, AdamW's two moments on the rest), and its step's temporaries (one stack at a
    time: its updates, the assembly's buffers under FSDP, NS's own) agree with the optimizer
    step measured on one rank and on FSDP 2 (whose matrices are assembled by all-to-all).
    Counting Muon's state as 0 and its step as AdamW's was 33% (one rank) and 55% (FSDP 2) low
    on the step, 42% and 55% on the total.

    The estimate counts tensors, so it is held to the tensors a real step allocates
    (`LiveBytesTracker` over 5 more steps, the smallest peak: gloo's thread holding a
    dropped buffer a moment longer only adds; one run peaked at 24.4 MiB where the others
    gave 21.4): the optimizer step's within 3%, the whole step's
    within 10%, and the estimate's peak phase is the measured one. At seq 32 the step is small
    (one rank: 23.5 MiB of gradients + 4.0 of Muon) and RSS grows 4-6 MiB beyond the tensors
    here, 8.6 MiB on the CI machine: against RSS, a 25% bound failed there. RSS is still held:
    at least the tensors (they were resident) and at most 16 MiB beyond them. Under FSDP 2 the
    peak is the first block's backward (the later blocks' gradients and the held
    reduce-scatter input), which the estimate missed before: 20.8 MiB against 21.4."""
    muon = ["--optimizer.name", "muon", "--training.seq_len", "32", "--training.local_batch_size", "1"]
    rows = validate_cases([ValidationCase("muon", DEBUG + muon, tensor_peak=True),
                           ValidationCase("muon-fsdp2", DEBUG + muon, nproc=2, tensor_peak=True)],
                          str(tmp_path), timeout=450)
    text = format_validation(rows)
    print(text)
    for r in rows:
        assert r["hwm_used"], text
        assert abs(r["saved_err"]) <= 0.05, text
        assert abs(r["optimizer_step_err"]) <= 0.03, text
        assert abs(r["tensor_err"]) <= 0.10, text
        assert abs(r["est_total"] / (r["meas_persistent"] + r["meas_tensor_peak"]) - 1) <= 0.10, text
        assert all(0 <= g <= 16 * 2**20 for g in r["runtime_growth_by_rank"]), text
        assert r["est_persistent"] == r["meas_persistent"], (r["case"], text)
        measured_in_step = r["meas_optimizer_step"] >= r["meas_tensor_peak"]
        assert (r["peak_phase"] == "optimizer step") == measured_in_step, text
    assert [r["peak_phase"] for r in rows] == ["optimizer step", "earlier block backward"], text


DEEPSEEK = ["--config", "deepseek_debug.toml", *DEBUG[2:]]
QWEN3 = ["--config", "qwen3_debug.toml", *DEBUG[2:]]
QWEN3_MOE = ["--config", "qwen3_moe_debug.toml", *DEBUG[2:]]


@pytest.mark.slow
@pytest.mark.multirank
@pytest.mark.timeout(900)
def test_estimate_matches_a_real_step_tp2_and_ep2(tmp_path):
    """TP 2 for Llama (op AC: SAC under sequence parallel) and DeepSeek (MLA's wq_b / wkv_b
    column-wise, MoE under SP), EP 2 (local experts, FSDP over the dense params) for DeepSeek and
    Qwen3 MoE, and Qwen3 dense (tied head, QK-norm) on one rank and under TP 2 with op AC (its own
    plan; nothing in trainer/memory names it), in one torchrun launch. Saved bytes within 5%; the
    persistent state (each rank's parameter and optimizer-state tensors) exactly, which only the
    plans' real local shapes give, and the tied head counted once."""
    tp2 = ["--parallelism.tensor_parallel_degree", "2"]
    op = ["--activation_checkpoint.mode", "op"]
    cases = [ValidationCase("llama-tp2-op", DEBUG + tp2 + op, nproc=2),
             ValidationCase("deepseek-tp2", DEEPSEEK + tp2, nproc=2),
             ValidationCase("deepseek-ep2", DEEPSEEK + ["--parallelism.expert_parallel_degree", "2"], nproc=2),
             ValidationCase("qwen3-op", QWEN3 + op),
             ValidationCase("qwen3-tp2-op", QWEN3 + tp2 + op, nproc=2),
             ValidationCase("qwen3-moe-ep2", QWEN3_MOE + ["--parallelism.expert_parallel_degree", "2"], nproc=2)]
    rows = validate_cases(cases, str(tmp_path), timeout=850)
    text = _check_rows(rows)
    print(text)
    for r in rows:
        assert r["est_persistent"] == r["meas_persistent"], (r["case"], text)


def test_live_bytes_tracker_follows_frees():
    with LiveBytesTracker() as t:
        a = torch.ones(1000)
        b = torch.ones(3000)
        del a
        c = b * 2
        assert t.sample() == 6000 * 4 and t.peak == 6000 * 4  # a was freed before c existed
        del b, c
        assert t.sample() == 0


def test_live_bytes_tracker_follows_storage_resizes_when_asked():
    """FSDP2 frees and re-allocates its gathered parameters by resizing their storages, which
    no op shows: `follow_resizes` re-reads the sizes, so a resized-away buffer stops counting
    and one grown back counts again; without it the first size counts until the end."""
    for follow in (True, False):
        with LiveBytesTracker(follow_resizes=follow) as t:
            a = torch.ones(1000)
            a.untyped_storage().resize_(0)
            b = torch.ones(3000)
            assert t.peak == (3000 if follow else 4000) * 4
            a.untyped_storage().resize_(2000 * 4)
            c = a.view(-1)  # an op after the resize
            assert t.sample() == (5000 if follow else 4000) * 4
            del a, b, c


def test_live_bytes_tracker_peaks_equal_a_refresh_after_every_op():
    """The tracker drops freed storages only when an op adds one (the peak can rise only then):
    the same peaks as dropping them after every op, through a block's forward and backward."""

    class EveryOp(LiveBytesTracker):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = super().__torch_dispatch__(func, types, args, kwargs)
            self._refresh()
            return out

    def peaks(tracker_type):
        torch.manual_seed(0)
        layer = torch.nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
        x = torch.randn(2, 16, 32, requires_grad=True)
        with tracker_type([x, *layer.parameters()]) as t:
            out = layer(x).square().sum()
            forward = (t.sample(), t.peak)
            t.reset_peak()
            out.backward()
            return forward, (t.sample(), t.peak)

    got, want = peaks(LiveBytesTracker), peaks(EveryOp)
    assert got == want and want[1][1] > want[0][0] > 0, (got, want)


def test_default_world_size_fits_the_degrees():
    assert default_world_size(load_config(["--config", "llama8b.toml"]).parallelism) == 8
    assert default_world_size(load_config(["--config", "llama405b.toml"]).parallelism) == 64
    # PP 8 x EP 64 (EP borrows dp_shard): 512 ranks, as the config's comment says.
    assert default_world_size(load_config(["--config", "deepseek_v3_671b.toml"]).parallelism) == 512


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_estimates_for_the_shipped_configs_on_meta(capsys):
    from scripts.estimate_memory import main

    # Llama 3 8B on 8 GPUs: FSDP over 8, bf16 compute; exact param shards and optimizer states.
    cfg = load_config(["--config", "llama8b.toml"])
    est = {}
    for mode in ("none", "full", "op"):
        for chunked in (False, True):
            c = load_config(["--config", "llama8b.toml", "--activation_checkpoint.mode", mode,
                             "--loss.chunked_ce", str(chunked).lower()])
            est[mode, chunked] = estimate_memory(c, 8)
    e = est["op", False]
    from models import get_model_spec
    spec = get_model_spec("llama3")
    with torch.device("meta"):
        model = spec.model_cls(spec.flavors["8B"])
    shard_bytes = sum(math.ceil(p.shape[0] / 8) * math.prod(p.shape[1:]) * 4 for p in model.parameters())
    assert e.params == e.grads == shard_bytes and e.optimizer == 2 * shard_bytes
    assert e.compute_dtype == "bfloat16" and e.tokens_per_microbatch == 8192 and e.blocks_on_rank == 32
    # Full AC keeps only each block's bf16 input.
    assert est["full", False].activations_per_block == {"full/dense": 8192 * 4096 * 2}
    acts = {m: est[m, False].activations for m in ("none", "full", "op")}
    assert acts["none"] > acts["op"] > acts["full"]
    logits_fp32 = 8192 * 128256 * 4
    for mode in ("none", "full", "op"):
        plain, chunked = est[mode, False], est[mode, True]
        assert plain.activations == chunked.activations
        assert plain.loss_saved - chunked.loss_saved >= logits_fp32
        assert plain.loss_peak - chunked.loss_peak >= logits_fp32
        assert chunked.total < plain.total
        assert plain.loss_peak_other == chunked.loss_peak and chunked.loss_peak_other == plain.loss_peak
    del cfg

    # Every shipped large config estimates on the meta device through the CLI.
    for name in ("llama8b", "llama70b", "llama405b", "deepseek_v3_16b", "deepseek_v3_671b"):
        assert main(["--config", f"{name}.toml"]) == 0
        out = capsys.readouterr().out
        assert "TOTAL (estimated peak per rank)" in out and "activations per block" in out, out
    assert main(["--config", "llama70b.toml", "--ngpu", "64", "--json"]) == 0
    import json
    d = json.loads(capsys.readouterr().out)
    assert d["world_size"] == 64 and d["layout"]["dp_shard"] == 8 and d["layout"]["tp"] == 8
    assert d["total"] == d["params"] + d["optimizer"] + d["step_peak"]
    # A config error is one line and exit code 2.
    assert main(["--config", "llama405b.toml", "--ngpu", "12"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("config error") and "\n" not in err


@pytest.mark.multirank
@pytest.mark.timeout(500)
def test_pp_with_fsdp_holds_unsharded_gradients_over_the_microbatches(tmp_path):
    """PP 2 x FSDP 2 on 4 gloo ranks, 2 microbatches: torch's pipeline stage turns FSDP's gradient
    sync off until the last microbatch, so each rank holds its stage's gradients unsharded (fp32)
    through the step. At seq 32 the parameters dominate, so the term decides the peak: the step peak
    and the total are within 10% of the measured step (without the term: -20% and -13%). The stage
    also turns resharding after backward off, so with `fsdp_reshard_after_forward always` every
    unit still ends up gathered (counted as two: -22%), in the same launch."""
    argv = DEBUG + ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "2",
                    "--training.local_batch_size", "2", "--parallelism.pipeline_parallel_microbatch_size", "1",
                    "--training.seq_len", "32"]
    always = argv + ["--parallelism.fsdp_reshard_after_forward", "always"]
    rows = validate_cases([ValidationCase("pp2-fsdp2", argv, nproc=4), ValidationCase("pp2-fsdp2-always", always, 4)],
                          str(tmp_path), timeout=450)
    text = format_validation(rows)
    print(text)
    for r in rows:
        assert r["hwm_used"] and r["est_persistent"] == r["meas_persistent"], text
        assert abs(r["peak_err"]) <= 0.10 and abs(r["total_err"]) <= 0.10, text
    # The held gradients are the busiest rank's stage, whole (fp32): its FSDP units' gathered sizes.
    est = estimate_memory(load_config(argv), 4, device="cpu")
    assert est.held_grads > 1.8 * est.grads, (est.held_grads, est.grads)  # unsharded: ~dp_shard x the shards
    assert est.phases["block backward"] >= est.held_grads + est.activations
