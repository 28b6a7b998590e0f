"""The estimator's fast path (trainer/memory/estimate_cache.py) against the full one.

The planner estimates through one `EstimateCache`: one assembled rank per distinct pipeline
stage shape, probes shared across layouts and batch sizes. Its estimates must be the full
estimator's (every PP rank assembled afresh) byte for byte, field by field, including the
CUDA terms (EP-skewed probe, NCCL communicators), across uneven PP splits, loop and V
placement, EP, chunked CE, TP with sequence parallel and every AC mode (`budget`
calibrates on first call, so it gets fresh assemblies)."""

from __future__ import annotations

from trainer.config import load_config
from trainer.memory import estimate_memory
from trainer.memory.device_overhead import GpuOverheads
from trainer.memory.estimate import estimate_memories
from trainer.memory.estimate_cache import EstimateCache

SEQ = ["--training.seq_len", "64"]


def _argv(model: str, *, pp=1, sched="1F1B", spr=1, dp=1, ep=1, tp=1, ac="full", lb=1, mb=1, rep=1, extra=()):
    return ["--config", model, *SEQ, "--parallelism.pipeline_parallel_degree", str(pp),
            "--parallelism.data_parallel_replicate_degree", str(rep),
            "--parallelism.pipeline_parallel_schedule", sched, "--parallelism.pipeline_parallel_stages_per_rank",
            str(spr), "--parallelism.data_parallel_shard_degree", str(dp), "--parallelism.expert_parallel_degree",
            str(ep), "--parallelism.tensor_parallel_degree", str(tp), "--activation_checkpoint.mode", ac,
            "--training.local_batch_size", str(lb), "--parallelism.pipeline_parallel_microbatch_size", str(mb),
            *extra]


NO_SKEW = GpuOverheads(ep_imbalance=1.0)  # no EP-skewed probe (the planner's second reference point)


def _compare(groups) -> EstimateCache:
    """Each group (world, argvs differing in batch sizes only[, overheads per argv]) goes through
    one shared cache; each config is then estimated afresh by the full path. Every field must
    be equal."""
    cache = EstimateCache()
    for world, argvs, *ov in groups:
        each = ov[0] if ov else [None] * len(argvs)
        fast = estimate_memories([load_config(a, world_size=world) for a in argvs], world, device="cuda",
                                 cache=cache, overheads=each)
        for argv, got, o in zip(argvs, fast, each):
            want = estimate_memory(load_config(argv, world_size=world), world, device="cuda", overheads=o)
            want_d, got_d = want.to_dict(), got.to_dict()
            diff = {k: (want_d[k], got_d[k]) for k in want_d if want_d[k] != got_d[k]}
            assert not diff, (argv, diff)
            assert got.device_terms and want.total > 0
    return cache


def test_fast_path_equals_full_estimator_deepseek_pp_ep():
    # deepseek_debug: 6 blocks (1 dense, 5 MoE, 8 experts). PP 4 (and PP 2 x 2 stages) split
    # them 1/2/2/1 with the embedding and head on the end stages: uneven stages, and middle
    # ranks whose counts are read off the stages already assembled.
    ds = "deepseek_debug.toml"
    groups = [
        (4, [_argv(ds, pp=2, dp=2, ep=2, ac="full", lb=2, mb=1), _argv(ds, pp=2, dp=2, ep=2, ac="full", lb=4, mb=2)]),
        (8, [_argv(ds, pp=4, dp=2, ep=2, ac="full", lb=4, mb=1)]),  # probes shared with PP 2, params not
        # Muon's terms read each matrix by name: a middle rank's, summed from other stages' readings
        (8, [_argv(ds, pp=4, dp=2, ep=2, ac="full", lb=4, mb=1,
                   extra=["--optimizer.name", "muon", "--optimizer.muon_params", "layers.2.*,layers.3.moe.*"])]),
        (8, [_argv(ds, pp=2, rep=2, dp=2, ep=2, ac="full", lb=2, mb=1)]),  # HSDP: EP's probes differ
        (4, [_argv(ds, pp=2, sched="Interleaved1F1B", spr=2, dp=2, ep=2, ac="op", lb=2)]),
        # One batch with the EP-skewed probe, one without (per-item skew; budget: fresh assemblies).
        (4, [_argv(ds, pp=2, sched="ZBVZeroBubble", spr=2, dp=2, ep=2, ac="budget", lb=2),
             _argv(ds, pp=2, sched="ZBVZeroBubble", spr=2, dp=2, ep=2, ac="budget", lb=4, mb=2)], [None, NO_SKEW]),
        (4, [_argv(ds, dp=4, ep=4, ac="none", extra=["--loss.chunked_ce", "true"])]),
    ]
    cache = _compare(groups)
    # The full path assembles every PP rank of every estimate plus rank 0 again for the EP
    # skew: (2+1) x 2 + (4+1) + (2+1) + (2+1) + (2+1) + 2 + (1+1) = 24. The cache needs fewer.
    assert cache.assemblies < 17, cache.assemblies


def test_fast_path_equals_full_estimator_llama_ac_modes():
    ll = "llama_debug.toml"
    groups = [
        (2, [_argv(ll, dp=2, ac="none")]),
        (2, [_argv(ll, dp=2, ac="op", lb=1), _argv(ll, dp=2, ac="op", lb=2)]),  # one assembly, two batches
        (2, [_argv(ll, dp=2, ac="budget", lb=1), _argv(ll, dp=2, ac="budget", lb=2)]),
        (4, [_argv(ll, dp=2, tp=2, ac="op")]),  # TP with sequence parallel
        (4, [_argv(ll, pp=2, dp=2, ac="full", lb=2)]),
        (4, [_argv(ll, dp=4, ac="op", lb=2)]),  # dp_shard 4: parameters and probes new (probes are per dp_shard)
    ]
    cache = _compare(groups)
    assert cache.assemblies <= 9, cache.assemblies
