"""The layout planner (planner/, scripts/plan.py): a small search end to end, its --write
config through `./run_train.sh --dry-run`, the bad-input lines, the estimate cache, and the
predicted memory of two cheap layouts against a measured step."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import tomllib

import pytest

from tests.helpers import REPO

DEBUG = ["--config", "llama_debug.toml", "--data.type", "synthetic", "--training.seq_len", "128"]
# A CPU-like entry with fixed numbers (tests must not depend on this machine's calibration).
HW = """name = "test-cpu"
device = "cpu"
cores = 2
bf16_tflops = 0.02
fp8_tflops = 0
hbm_gib = {gib}
hbm_gbs = 5
nvlink_gbs = 0.1
gpus_per_node = 64
internode_gbs = 0.1
"""


def _hw(tmp_path, gib: float = 4.0) -> str:
    path = tmp_path / f"hw{gib}.toml"
    path.write_text(HW.format(gib=gib))
    return str(path)


def _plan(argv, capsys):
    from planner.cli import main

    rc = main(argv)
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.mark.slow
def test_small_search_writes_a_config_that_the_dry_run_accepts(tmp_path, capsys):
    best = tmp_path / "best.toml"
    rc, out, err = _plan([*DEBUG, "--gpus", "2", "--hardware", _hw(tmp_path), "--global-batch-tokens", "1024",
                          "--ac", "full", "--compile", "off", "--top", "3", "--explain", "1", "--write", str(best)],
                         capsys)
    assert rc == 0, err
    rows = [line for line in out.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert 2 <= len(rows) <= 3
    steps = [float(r.split("|")[8]) for r in rows]
    assert steps == sorted(steps)  # ranked by predicted step time
    mem = [float(r.split("|")[5].split()[0].lstrip("~")) for r in rows]
    assert all(0 < m < 4.0 for m in mem)  # every printed plan fits the 4 GiB entry
    assert "step time, by part:" in out and "collectives per rank per step:" in out
    written = tomllib.loads(best.read_text())
    par = written["parallelism"]
    world = (par["data_parallel_replicate_degree"] * par["data_parallel_shard_degree"] * par["tensor_parallel_degree"]
             * par["context_parallel_degree"] * par["pipeline_parallel_degree"])
    assert world == 2 and written["training"]["seq_len"] == 128
    assert written["training"]["global_batch_size"] * 128 == 1024
    # The written file runs as is: the dry run accepts it on its world and adds the planner's lines.
    env = {**os.environ, "NGPU": "2", "TITAN_DRY_RUN_PLAN": "1", "TITAN_PLAN_GPU": _hw(tmp_path)}
    proc = subprocess.run(["./run_train.sh", "--config", str(best), "--dry-run"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "layout: world size 2" in proc.stdout
    line = next(l for l in proc.stdout.splitlines() if l.startswith("plan: predicted on 2 x test-cpu"))
    assert "tokens/s/GPU" in line and "GiB per rank" in line


def test_bad_hardware_is_one_line_exit_2(tmp_path, capsys):
    missing = tmp_path / "bad.toml"
    missing.write_text("\n".join(l for l in HW.format(gib=4).splitlines() if not l.startswith("hbm_gbs")))
    shrinking = tmp_path / "shrinking.toml"
    shrinking.write_text(HW.format(gib=4) + "\n[efficiency]\noversubscribed_latency_x = 0.5\n")
    for extra, expect in [
        (["--hardware", str(missing)], "missing field hbm_gbs (memory bandwidth, GB/s)"),
        (["--hardware", str(shrinking)], "efficiency.oversubscribed_latency_x = 0.5 is a multiple (a factor of a "
                                         "measured cost); give a number >= 1"),
        (["--hardware", "/nonexistent.toml"], "--hardware: /nonexistent.toml not found"),
    ]:
        rc, out, err = _plan([*DEBUG, "--gpus", "2", *extra], capsys)
        assert rc == 2 and expect in err and err.strip().count("\n") == 0
    # Through the script: one line on stderr, no traceback.
    proc = subprocess.run([sys.executable, "scripts/plan.py", *DEBUG, "--gpus", "2", "--gpu", "h100-sxn"], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip() == ("config error: --gpu: unknown GPU 'h100-sxn'; known: h100-sxm, h100-tt, "
                                   "h100-pcie, h200, b200, gb200, a100, mi300x, cpu-gloo (or --hardware FILE)")


def test_model_that_fits_nowhere_names_the_smallest_gpu_count(tmp_path, capsys):
    # 64 MiB per GPU: the debug Llama (6.6 M params: 105 MB of params, grads and AdamW states) fits
    # on no layout of 1 GPU; sharded over more GPUs it does.
    rc, out, err = _plan([*DEBUG, "--gpus", "1", "--hardware", _hw(tmp_path, 0.0625), "--global-batch-tokens",
                          "128", "--ac", "full"], capsys)
    assert rc == 2 and out == ""
    line = err.strip()
    assert "\n" not in line
    assert "fits at no layout on 1 x test-cpu (0.0625 GiB each, 10% kept free): " in line
    import re

    found = re.search(r"; (\d+) GPUs fit \((\S+), AC full, ([\d.]+) GiB per rank\)", line)
    assert found, line
    assert int(found.group(1)) in (2, 4, 8, 16) and float(found.group(3)) <= 0.0625


def test_estimates_are_cached_per_local_shape_and_scale_exactly():
    from planner.layout import Plan
    from planner.memory import MemoryModel

    mm = MemoryModel(DEBUG, "cpu", 64)
    small = mm.of(Plan(2, 1, 2, local_batch=2, ac="op"))
    big = mm.of(Plan(4, 1, 4, local_batch=8, grad_accum=1, ac="op"))  # same key: dp_shard and batch differ
    assert mm.calls == 2 and mm.hits == 1  # one key: its reference and the reference at twice the tokens
    assert big.activations == pytest.approx(4 * small.activations, rel=1e-9)
    exact = mm.estimate_exact(Plan(4, 1, 4, local_batch=8, ac="op"))
    assert mm.calls == 3
    assert big.tensors == pytest.approx(exact.total, rel=0.01)  # read off the reference vs the estimator itself
    # A plan that is its own reference: the cached fast path gives the full estimator's bytes.
    ref = Plan(2, 1, 2, local_batch=1, ac="op")
    assert mm.of(ref).exact and mm.of(ref).tensors == mm.estimate_exact(ref).total
    # The second reference point is estimated without the EP-skewed probe: `scale` must not
    # read its device terms (their EP imbalance term is missing there).
    import dataclasses

    from planner.memory import scale

    ref_plan, est, est2 = mm.reference(Plan(4, 1, 4, local_batch=8, ac="op"))
    odd = dataclasses.replace(est2, device_terms={"EP load imbalance": 10**12}, notes=["x"])
    assert scale(est, ref_plan, Plan(4, 1, 4, local_batch=8, ac="op"), odd) == \
        scale(est, ref_plan, Plan(4, 1, 4, local_batch=8, ac="op"), est2)


def test_predicted_memory_matches_a_measured_step():
    """Two 1-rank layouts whose plan memory is scaled (local batch 4) from the reference
    estimate (local batch 1), against the measured RSS growth of a real step: within 15%."""
    import tempfile

    from planner.layout import Plan
    from planner.memory import MemoryModel
    from trainer.memory import ValidationCase, run_measurements

    base = [*DEBUG, "--metrics.enable_tensorboard", "false", "--loss.ce_chunk_size", "128"]
    plans = {"none": Plan(1, 1, 1, local_batch=4, ac="none"), "op": Plan(1, 1, 1, local_batch=4, ac="op")}
    mm = MemoryModel(base, "cpu", 64)
    with tempfile.TemporaryDirectory() as d:
        got = run_measurements([ValidationCase(k, base + p.overrides()) for k, p in plans.items()], d, timeout=600)
    for name, plan in plans.items():
        predicted = mm.of(plan)
        assert not predicted.exact
        measured = got[name][0]["persistent_bytes"] + got[name][0]["peak_growth"]
        assert abs(predicted.tensors / measured - 1) < 0.15, (name, predicted.tensors, measured)


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


def test_lazy_references_bound_below_and_complete_to_the_same_bytes(monkeypatch):
    """AC `none` and `budget` references skip the EP-skewed probe and the second point until a
    plan's lower bound fits, and any reference first asked for a plan at its own microbatch (PP
    mb1 here) skips the second point until a plan needs it: the bound is never above the memory,
    and the completed estimate reads exactly as one estimated in full at once (GPU terms on: the
    EP skew applies)."""
    import planner.memory as pm
    from planner.cli import NEUTRAL
    from planner.layout import Plan

    argv = ["--config", "deepseek_debug.toml", *NEUTRAL, "--training.seq_len", "64"]
    plans = [Plan(8, 1, 8, ep=2, local_batch=lb, ac=ac) for ac, lbs in (("none", (1, 2, 4)), ("budget", (1, 2)))
             for lb in lbs]
    plans += [Plan(8, 1, 4, pp=2, microbatch=mb, local_batch=4, ep=2, ac=ac) for ac in ("none", "full")
              for mb in (1, 2)]
    lazy = pm.MemoryModel(argv, "cuda", 8)
    bounds = [pm.scale(e.est, e.plan, p, e.est2, bound=True).total for p in plans
              for e in [lazy._entry(p)]]
    assert not any(e.est2 for e in lazy.cache.values())  # nothing completed yet
    assert not any(e.skewed for e in lazy.cache.values() if e.plan.ac in pm.LAZY_AC)
    got = [lazy.of(p) for p in plans]
    monkeypatch.setattr(pm, "LAZY_AC", ())
    eager = pm.MemoryModel(argv, "cuda", 8)
    want = [eager.reference(p) and eager.of(p) for p in plans]  # both points at once, before any read
    for plan, low, g, w in zip(plans, bounds, got, want):
        assert g.total == w.total and g.device_terms == w.device_terms and g.peak_phase == w.peak_phase, plan
        assert 0 < low <= w.total, (plan, low, w.total)
    assert any(low < w.total for low, w in zip(bounds, want))  # the skew term is there to miss
    # fit(): a plan is rejected on its bound only when its memory does not fit either.
    fresh = pm.MemoryModel(argv, "cuda", 8)
    for plan, w in zip(plans, want):
        for capacity in (w.total - 1, w.total):
            mem, total = fresh.fit(plan, capacity)
            assert (mem is not None) == (w.total <= capacity) and total <= w.total


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


def test_every_skeleton_of_a_pipeline_search_is_predicted():
    """The search predicts each skeleton before the validators see it, so it must only yield
    layouts with a block per pipeline stage: 3 blocks on 4 ranks allow PP 2 with one stage per
    rank, not the two-stage-per-rank schedules (which raised in the trainer's own split)."""
    from planner.cli import space_for
    from planner.hardware import KNOWN
    from planner.search import Search
    from planner.workload import workload_of
    from trainer.config import load_config

    cfg = load_config([*DEBUG, "--model.flavor", "debug_small"])
    w = workload_of(cfg)
    assert w.n_layers == 3
    hw = KNOWN["h100-sxm"]
    search = Search(cfg, [], w, hw, 4, 128, 8, space_for({"compile": None, "float8": None, "ac": None}, hw), None)
    skels = list(search.skeletons())
    assert {(s.pp, s.stages_per_rank) for s in skels} == {(1, 1), (2, 1)}
    assert all(math.isfinite(search.optimistic(s)) for s in skels)


def _debug_search_parts(hw):
    from planner.cli import NEUTRAL
    from planner.memory import MemoryModel
    from planner.workload import workload_of
    from trainer.config import load_config

    argv = [*DEBUG, *NEUTRAL]
    cfg = load_config(argv)
    return cfg, argv, workload_of(cfg, hw), MemoryModel(argv, hw.device, hw.gpus_per_node)


def test_every_flag_combination_searches():
    """--ac, --compile on and --float8 on, alone and together, each find plans that have what the
    flags ask. The least-memory check of a layout (`frugal_fits`) used to try only AC full without
    compile or float8, so every one of these found nothing ("fits at no layout")."""
    from planner.cli import parse, space_for
    from planner.hardware import KNOWN
    from planner.search import Search

    hw = KNOWN["h100-sxm"]
    cfg, argv, w, memory = _debug_search_parts(hw)
    for flags in (["--ac", "op"], ["--ac", "none"], ["--ac", "budget"], ["--ac", "none,op"], ["--compile", "on"],
                  ["--float8", "on"], ["--ac", "op", "--compile", "on", "--float8", "on"],
                  ["--ac", "full", "--compile", "off", "--float8", "off"]):
        space = space_for(parse(flags)[0], hw)
        found = Search(cfg, argv, w, hw, 2, 128, 8, space, memory).run(2)
        assert found, flags
        for r in found:
            p = r.plan
            assert p.ac in space.ac_modes and p.compile in space.compile and p.float8 in space.float8, (flags, p)
            # float8 plans gather in float8 where FSDP shards (tensorwise, the default recipe)
            assert p.float8_all_gather == (p.float8 and p.dp_shard * p.cp * p.dp_replicate > 1), p
    # Combinations nothing satisfies are one line each, before any search.
    for flags, expect in ((["--ac", "budget", "--compile", "on"], "--ac budget with --compile on"),
                          (["--float8", "on"], "--float8 on: test-cpu has no float8 matmuls")):
        with pytest.raises(Exception) as e:
            from planner.hardware import hardware_from_table

            space_for(parse(flags)[0], hardware_from_table(tomllib.loads(HW.format(gib=4)), "test")
                      if "float8" in flags[0] else hw)
        assert expect in str(e.value) and "\n" not in str(e.value)


def test_the_gpu_count_hint_searches_the_same_flags(tmp_path, capsys):
    """A model that fits on no layout names the smallest GPU count that fits with the flags given
    (here op AC, which keeps more than full): that count finds a plan, half of it does not."""
    import re

    hw = _hw(tmp_path, 0.09)  # 1 rank: 0.09 GiB of params, grads and AdamW states alone
    common = [*DEBUG, "--hardware", hw, "--ac", "op", "--top", "1"]
    rc, out, err = _plan([*common, "--gpus", "1", "--global-batch-tokens", "128"], capsys)
    assert rc == 2 and "\n" not in err.strip()
    found = re.search(r"; (\d+) GPUs fit \((\S+), AC op, ([\d.]+) GiB per rank\)", err)
    assert found, err
    n = int(found.group(1))
    # the hint's search takes a sample per GPU at least
    rc, out, _ = _plan([*common, "--gpus", str(n), "--global-batch-tokens", str(128 * n)], capsys)
    assert rc == 0 and f"| 1 | {found.group(2)} | op |" in out
    assert n == 2 or _plan([*common, "--gpus", str(n // 2), "--global-batch-tokens", str(64 * n)], capsys)[0] == 2


def test_the_memory_margin_keeps_its_share_free(capsys):
    """Every plan leaves --margin of the GPU free: a margin just above plan 1's free share drops
    plan 1; 0.1 is the default; a margin outside 0..0.9 is one line."""
    import dataclasses

    from planner.cli import parse, space_for
    from planner.hardware import KNOWN
    from planner.search import DEFAULT_MARGIN, GiB, Search

    assert DEFAULT_MARGIN == 0.1 and parse([])[0]["margin"] is None and parse(["--margin", "0.25"])[0]["margin"] == 0.25
    hw = dataclasses.replace(KNOWN["h100-sxm"], hbm_gib=1.5)
    cfg, argv, w, memory = _debug_search_parts(hw)
    space = space_for(parse(["--ac", "none,op", "--compile", "off", "--float8", "off"])[0], hw)
    loose = Search(cfg, argv, w, hw, 2, 128, 64, space, memory, margin=0.0).run(3)
    free = 1 - loose[0].memory.total / (hw.hbm_gib * GiB)
    assert 0 < free < 0.8, free
    tight = Search(cfg, argv, w, hw, 2, 128, 64, space, memory, margin=free + 0.01).run(3)
    assert loose[0].plan not in [r.plan for r in tight]
    assert all(r.memory.total <= (1 - free - 0.01) * hw.hbm_gib * GiB for r in tight)
    for bad in ("1.5", "-0.1", "ten"):
        rc, out, err = _plan([*DEBUG, "--gpus", "2", "--margin", bad], capsys)
        assert rc == 2 and "--margin: expected a share of the memory from 0 to 0.9" in err and err.count("\n") == 1


def test_predict_prints_the_configs_own_layout(tmp_path, capsys):
    """--predict: no search; the config's own layout (FSDP 2 x TP 2 here, op AC) on --gpus, with
    the step of the time model and the memory of the full estimator on that very layout."""
    from planner.hardware import load_hardware_file
    from planner.layout import Plan
    from planner.step_time import predict
    from planner.workload import workload_of
    from trainer.config import load_config
    from trainer.memory import estimate_memory

    hw_file = _hw(tmp_path)
    argv = [*DEBUG, "--parallelism.data_parallel_shard_degree", "2", "--parallelism.tensor_parallel_degree", "2",
            "--activation_checkpoint.mode", "op", "--training.local_batch_size", "2"]
    rc, out, err = _plan([*argv, "--gpus", "4", "--hardware", hw_file, "--predict"], capsys)
    assert rc == 0, err
    first = out.splitlines()[0]
    cfg = load_config(argv, world_size=4)
    st = predict(Plan(4, 1, 2, tp=2, local_batch=2, ac="op"), workload_of(cfg), load_hardware_file(hw_file), 128,
                 compute_bytes=4)
    est = estimate_memory(cfg, 4, device="cpu")
    assert "fsdp2xtp2, AC op, lbs2" in first and f"step {st.step_s:.3f} s" in first, first
    assert f"memory {est.total / 1024**3:.2f} GiB per rank" in first, (first, est.total)
    assert "exposed comm (TP/CP/EP)" in out and "legend:" in out and "tpN: tensor parallel" in out
    # A layout the world cannot hold is the trainer's own one line.
    rc, out, err = _plan([*argv, "--gpus", "6", "--hardware", hw_file, "--predict"], capsys)
    assert rc == 2 and err.startswith("config error") and err.count("\n") == 1


def test_the_legend_explains_every_part_of_a_label():
    from planner.layout import Plan, legend

    plans = [Plan(16, 2, 2, cp=2, pp=2, schedule="ZBVZeroBubble", stages_per_rank=2, local_batch=4, grad_accum=2,
                  float8=True, float8_all_gather=True, compile=True),
             Plan(8, 1, 2, tp=2, cp=2, cp_method="alltoall", ep=4, chunked_ce=True, local_batch=1)]
    assert plans[0].layout_label() == "rep2xfsdp2xcp2agxpp2:ZBVx2/mb1"
    text = legend(plans)
    for part in ("repN: HSDP", "fsdpN: FSDP", "tpN: tensor parallel", "cpNag: context parallel",
                 "cpNa2a: context parallel", "ppN:S[xV]/mbM: pipeline", "ZBV: ZBVZeroBubble", "epN: expert parallel",
                 "lbsN:", "gaN: gradient accumulation", "cce: chunked", "fp8ag: float8", "compile: torch.compile",
                 "joined by x"):
        assert part in text, (part, text)
    assert "I1F1B" not in text and "fp8: " not in text  # only what the labels hold


def test_pipeline_with_fsdp_reads_the_unsharded_gradients_off_its_reference():
    """Under PP with FSDP every unit's gradient is held unsharded over the microbatches (the
    estimator's term): the same at any dp_shard, with the sharded gradients on top when the plan
    also accumulates. Read off the reference (dp_shard 2, no accumulation) for dp_shard 4 with and
    without accumulation, it equals the estimator run on each plan within 1%."""
    from planner.layout import Plan
    from planner.memory import MemoryModel

    mm = MemoryModel(DEBUG, "cpu", 64)
    for accum in (1, 2):
        plan = Plan(8, 1, 4, pp=2, microbatch=1, local_batch=2, grad_accum=accum, ac="full")
        got = mm.of(plan)
        exact = mm.estimate_exact(plan)
        assert exact.held_grads > 3 * exact.grads  # unsharded over dp_shard 4
        assert got.tensors == pytest.approx(exact.total, rel=0.01), (accum, got.tensors, exact.total)


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
    ends = [coll("FSDP all-gather (forward)", 0.4, "inter-node", "forward", calls=10),
            coll("FSDP reduce-scatter", 0.7, "inter-node", "end")]
    assert exposed_overlapped(ends, pp, hw, compute, recompute) == pytest.approx(
        (0.4 - 0.25) + 0.3 * 0.25 + 0.7 + 0.4 / 10)


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
