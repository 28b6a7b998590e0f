"""The planner's time model (planner/step_time.py): fixed costs per block pass and collective
call, the busiest pipeline rank, overlapped traffic per phase and link, float8's gathers and
casts, context parallelism's work and traffic per method. Fast: no search, no estimator."""

from __future__ import annotations

import tomllib

import pytest

from tests.test_planner import DEBUG, HW


def _fsdp_gathers(st):
    """FSDP's all-gathers of a predicted step, forward and backward together (calls, seconds)."""
    import types

    both = [c for c in st.collectives if c.name.startswith("FSDP all-gather")]
    assert {c.phase for c in both} <= {"forward", "backward"} and both
    return types.SimpleNamespace(calls=sum(c.calls for c in both), seconds=sum(c.seconds for c in both))


def test_fixed_cost_terms_count_block_passes_and_collective_calls():
    """The eager-dispatch term is block_overhead_s per block per microbatch (stretched by ranks /
    cores), each collective pays collective_latency_s per call, and a blocking one (TP) also
    sync_point_s, but only where no rank waits on a shared core: checked against counts made by
    hand for FSDP 2, FSDP 8, TP 2 and FSDP 2 x TP 2 on a 2-core CPU entry, and 0 on the GPU
    entries. (tests/test_tp_comm.py checks the call counts against a real step.)"""
    import dataclasses

    from planner.hardware import KNOWN, hardware_from_table
    from planner.layout import Plan
    from planner.step_time import predict
    from planner.workload import workload_of
    from trainer.config import load_config

    table = tomllib.loads(HW.format(gib=4.0))
    base = hardware_from_table(table, "test")
    costly = dataclasses.replace(base, efficiency=dataclasses.replace(
        base.efficiency, block_overhead_s=0.003, collective_latency_s=0.001, fsdp_unit_overhead_s=0.002,
        ac_op_dispatch_x=2.5, dtensor_dispatch_x=3.0, sync_point_s=0.004))
    cfg = load_config(DEBUG)
    w = workload_of(cfg)
    units = w.n_layers + 2  # FSDP units: the embedding, each block, the final norm + head
    for world, stretch in ((2, 1.0), (8, 4.0)):
        plan = Plan(world, 1, world, local_batch=2)
        plain, fixed = predict(plan, w, base, 128, compute_bytes=4), predict(plan, w, costly, 128, compute_bytes=4)
        per_mb = 0.003 * w.n_layers + 0.002 * units  # blocks, and FSDP's hooks per unit
        assert fixed.parts["eager dispatch"] == pytest.approx(per_mb * plan.n_microbatches * stretch)
        # the step's host work shares the cores as the dispatch does
        assert fixed.parts["fixed overhead"] == pytest.approx(costly.efficiency.step_overhead_s * stretch)
        gather, plain_gather = _fsdp_gathers(fixed), _fsdp_gathers(plain)
        # forward and backward; the norm + head unit stays gathered from forward into backward
        assert gather.calls == plan.n_microbatches * (2 * units - 1)
        assert gather.seconds - plain_gather.seconds == pytest.approx(gather.calls * 0.001 * stretch)
        assert fixed.step_s > plain.step_s
    # The latency grows by oversubscribed_latency_x per doubling of the ranks per core: 8 ranks on
    # 2 cores are two doublings, so x3 stretches it 9-fold (the default 2 is the linear 4 above).
    steep = dataclasses.replace(costly, efficiency=dataclasses.replace(costly.efficiency, oversubscribed_latency_x=3.0))
    gather = _fsdp_gathers(predict(Plan(8, 1, 8, local_batch=2), w, steep, 128, compute_bytes=4))
    assert gather.seconds - plain_gather.seconds == pytest.approx(gather.calls * 0.001 * 9)
    # TP 2 with op AC, no FSDP: the block dispatch times both multiples
    tp_op = Plan(2, 1, 1, tp=2, local_batch=2, ac="op")
    assert predict(tp_op, w, costly, 128, compute_bytes=4).parts["eager dispatch"] == pytest.approx(
        0.003 * 2.5 * 3.0 * w.n_layers * tp_op.n_microbatches)
    # A block that dispatches twice the calibration block's (measured per model on CPU entries)
    heavy = dataclasses.replace(w, block_dispatch_weight=2.0)
    assert predict(tp_op, heavy, costly, 128, compute_bytes=4).parts["eager dispatch"] == pytest.approx(
        2 * 0.003 * 2.5 * 3.0 * w.n_layers * tp_op.n_microbatches)
    # TP's gathers and reduce-scatters block: each call pays the latency and the sync point on 2
    # ranks; on 4 ranks (2 per core) the latency is stretched x2 and the sync point is gone
    for plan, per_call in ((Plan(2, 1, 1, tp=2, local_batch=2), 0.001 + 0.004),
                           (Plan(4, 1, 2, tp=2, local_batch=2), 0.001 * 2)):
        sp, sp_plain = (next(c for c in predict(plan, w, hw, 128, compute_bytes=4).collectives
                             if c.name == "TP/SP all-gather") for hw in (costly, base))
        assert sp.calls == (4 * w.n_layers + 2) * plan.n_microbatches and not sp.overlapped
        assert sp.seconds - sp_plain.seconds == pytest.approx(sp.calls * per_call)
    gpu = KNOWN["h100-sxm"].efficiency
    assert gpu.block_overhead_s == gpu.collective_latency_s == gpu.fsdp_unit_overhead_s == gpu.sync_point_s == 0
    assert gpu.ac_op_dispatch_x == gpu.ac_full_dispatch_x == gpu.ac_budget_dispatch_x == gpu.dtensor_dispatch_x == 1


def test_a_tied_head_is_one_parameter_and_a_full_matmul():
    """Qwen3's small flavors tie the head to the embedding: the workload counts the weight once
    in the parameters (and so in FSDP's traffic) but still counts the head's matmul FLOPs."""
    from parallelisms.apply import build_model
    from planner.workload import workload_of
    from trainer.config import load_config

    cfg = load_config(["--config", "qwen3_debug.toml"])
    w = workload_of(cfg)
    args = cfg.model_args
    assert w.tied_head and w.head == w.embedding == args.vocab_size * args.dim
    assert w.total_params == sum(p.numel() for p in build_model(cfg.model_spec, args).parameters())


def test_the_busiest_pipeline_rank_follows_the_trainers_split():
    """6 blocks in 4 stages split [1, 2, 2, 1] (the ends weigh a block each): looped over 2 ranks,
    rank 1 holds stages 1 and 3, blocks 1, 2 and 5 and the head; rounding each stage up to 2
    blocks had counted 4. V-shaped (ZBV), rank 0 holds stages 0 and 3 (blocks 0 and 5, the
    embedding and the head), rank 1 stages 1 and 2: four blocks and neither end, the busier."""
    from planner.layout import Plan
    from planner.step_time import busiest_pp_rank
    from planner.workload import workload_of
    from trainer.config import load_config

    w = workload_of(load_config(["--config", "llama_debug.toml"]))
    assert w.n_layers == 6
    looped = Plan(2, 1, 1, pp=2, schedule="Interleaved1F1B", stages_per_rank=2, local_batch=2)
    assert busiest_pp_rank(looped, w) == ([1, 2, 5], False, True)
    v_shape = Plan(2, 1, 1, pp=2, schedule="ZBVZeroBubble", stages_per_rank=2, local_batch=2)
    assert busiest_pp_rank(v_shape, w) == ([1, 2, 3, 4], False, False)
    assert busiest_pp_rank(Plan(2, 1, 1, pp=2, local_batch=2), w) == ([3, 4, 5], False, True)


def test_overlapped_traffic_hides_per_phase_and_link():
    """FSDP's traffic hides behind its own phase's compute (forward gathers behind the forward,
    backward gathers and reduce-scatters behind the backward and recompute) and is exposed beyond
    it; what hides costs its link's contention share. Under PP the reduction after the last
    microbatch has nothing to hide behind."""
    import dataclasses

    from planner.hardware import KNOWN
    from planner.layout import Plan
    from planner.step_time import Collective, exposed_overlapped

    hw = dataclasses.replace(KNOWN["h100-sxm"], efficiency=dataclasses.replace(
        KNOWN["h100-sxm"].efficiency, contention_in_node=0.1, contention_inter_node=0.3))
    plan = Plan(16, 1, 16, local_batch=1, grad_accum=2)  # 2 microbatches: a first unit's gather each

    def coll(name, seconds, link, phase, calls=20):
        return Collective(name, 0.0, 16, link, seconds, True, calls, "all_gather", phase)

    compute, recompute = 3.0, 0.5  # windows: forward 1.0 s, backward 2.5 s
    colls = [coll("FSDP all-gather (forward)", 1.5, "inter-node", "forward"),
             coll("FSDP reduce-scatter", 1.0, "inter-node", "backward"),
             coll("HSDP all-reduce", 0.4, "in-node", "backward")]
    got = exposed_overlapped(colls, plan, hw, compute, recompute)
    first_units = 2 * 1.5 / 20
    want = (1.5 - 1.0) + 0.3 * 1.0 + 0.3 * 1.0 + 0.1 * 0.4 + first_units
    assert got == pytest.approx(want)
    # PP, 4 microbatches: the once-per-step gather hides behind the first microbatch's forward
    # only (0.25 s), its reduction after the last microbatch nowhere
    pp = Plan(16, 1, 8, pp=2, local_batch=4)
    ends = [coll("FSDP all-gather (first forward)", 0.4, "inter-node", "first forward", calls=10),
            coll("FSDP reduce-scatter", 0.7, "inter-node", "end"),
            coll("PP send/recv (forward)", 0.9, "inter-node", "forward")]  # every microbatch's: 1 s window
    assert exposed_overlapped(ends, pp, hw, compute, recompute) == pytest.approx(
        (0.4 - 0.25) + 0.3 * 0.25 + 0.7 + 0.3 * 0.9 + 0.4 / 10)


def test_float8_gathers_in_float8_and_pays_its_casts():
    """float8: FSDP gathers the float8 Linears' weights in one byte under the float8 all-gather
    (the rest in bf16); every float8 Linear's casts are charged as elementwise bytes; one scale
    all-reduce per step; and H100's float8 rate reproduces torchao's microbenchmark of one Linear
    (1.39x at 4096 x 8192 x 16384), which is where it comes from."""
    import dataclasses

    from planner.hardware import KNOWN
    from planner.layout import Plan
    from planner.step_time import float8_linear_speedup, predict
    from planner.workload import workload_of
    from trainer.config import load_config

    hw = KNOWN["h100-sxm"]
    assert float8_linear_speedup(hw, 4096, 8192, 16384) == pytest.approx(1.39, abs=0.01)
    w = workload_of(load_config(["--config", "llama8b.toml"]))
    base = Plan(8, 1, 8, local_batch=2, ac="op", compile=True)
    bf16, fp8, fp8ag = (predict(dataclasses.replace(base, float8=f, float8_all_gather=ag), w, hw, 8192)
                        for f, ag in ((False, False), (True, False), (True, True)))

    def gathered(st):
        return sum(c.bytes for c in st.collectives if c.name.startswith("FSDP all-gather"))

    f8 = sum(w.layer_float8)
    assert f8 == sum(w.layer_dense)  # Llama: every block weight is a float8 Linear (no router)
    assert gathered(fp8) == gathered(bf16)
    assert gathered(bf16) - gathered(fp8ag) == pytest.approx(2 * f8 * 7 / 8, rel=1e-9)  # fwd + bwd, 1 byte less
    assert [c.name for c in fp8ag.collectives if c.name == "float8 scale all-reduce"]
    assert not [c for c in fp8.collectives if c.name == "float8 scale all-reduce"]
    tokens = 2 * 8192
    f_in, f_out = (sum(io[k] for io in w.layer_float8_io) for k in (0, 1))
    casts = tokens * (10 * f_in + 7 * f_out) + 2 * 5 * f8  # activations; the weight, forward and backward
    ew = hw.efficiency.compile_elementwise / (hw.hbm_gbs * 1e9 * hw.efficiency.hbm)
    assert fp8.parts["elementwise"] - bf16.parts["elementwise"] == pytest.approx(casts * ew, rel=1e-9)
    assert fp8.parts["matmul"] < bf16.parts["matmul"] and fp8ag.step_s < fp8.step_s


def test_context_parallel_work_and_traffic_per_method():
    """CP all-gather on MLA gathers the latent (kv_lora_rank + rope, whole on every TP rank) and
    up-projects the whole gathered sequence on each rank; under compile on CUDA it runs flex
    attention. Ulysses on GQA repeats K/V heads until cp divides them."""
    import dataclasses

    from planner.hardware import KNOWN
    from planner.layout import Plan
    from planner.step_time import predict
    from planner.workload import workload_of
    from trainer.config import load_config

    hw = KNOWN["h100-sxm"]
    cfg = load_config(["--config", "deepseek_debug.toml"])
    w = workload_of(cfg)
    args = cfg.model_args
    assert w.kv_width == args.kv_lora_rank + args.qk_rope_head_dim and any(w.layer_kv_up)
    seq = 256
    one, ag = (predict(Plan(4, 1, 2 // cp if cp < 2 else 1, cp=cp, tp=2, local_batch=1), w, hw, seq)
               for cp in (1, 2))
    kv = next(c for c in ag.collectives if c.name == "CP K/V all-gather")
    assert kv.bytes == pytest.approx(w.n_layers * seq * w.kv_width * 2 / 2)  # not divided by tp 2
    # every rank up-projects the other rank's half of the latent too: (cp - 1) x wkv_b per token
    extra = 6 * sum(w.layer_kv_up) * seq / 4 * (2 - 1) / (hw.bf16_tflops * 1e12 * hw.efficiency.matmul)
    assert ag.parts["matmul"] - one.parts["matmul"] / 2 == pytest.approx(extra, rel=1e-6)
    eager, compiled = (predict(Plan(2, 1, 1, cp=2, local_batch=1, compile=c), w, hw, seq) for c in (False, True))
    assert compiled.parts["attention"] == pytest.approx(eager.parts["attention"] / hw.efficiency.cp_flex_attention)
    ulysses = predict(Plan(2, 1, 1, cp=2, cp_method="alltoall", local_batch=1, compile=True), w, hw, seq)
    assert ulysses.parts["attention"] == pytest.approx(eager.parts["attention"])
    # GQA: 4 q heads over 2 K/V heads at cp 4: each K/V head repeated twice (none when every q
    # head has its own)
    gqa = workload_of(load_config(["--config", "llama_debug.toml", "--model.flavor", "debug_small"]))
    assert (gqa.n_heads, gqa.kv_heads) == (4, 2)
    mha = dataclasses.replace(gqa, kv_heads=gqa.n_heads)
    a2a = [next(c for c in predict(Plan(4, 1, 1, cp=4, cp_method="alltoall", local_batch=1), m, hw, seq).collectives
                if c.kind == "all_to_all") for m in (mha, gqa)]
    assert a2a[1].bytes - a2a[0].bytes == pytest.approx(a2a[0].bytes * gqa.kv_width / gqa.qkvo_width)
