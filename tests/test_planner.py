"""The layout planner (planner/, scripts/plan.py): a small search end to end, its --write
config through `./run_train.sh --dry-run`, every flag combination, the GPU-count hint, the
memory margin, --predict, the legend, the bad-input lines, the estimate cache (PP x FSDP's
unsharded gradients included), and the predicted memory of two cheap layouts against a
measured step. The time model's own tests: tests/test_planner_time.py."""

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


def test_backward_phase_gradients_scale_with_the_sharding():
    """At seq 32 the debug model's peak is the first block's backward, which holds the later
    blocks' sharded gradients: read off a dp_shard 2 reference, a dp_shard 8 plan must agree
    with the estimator itself (before `earlier_blocks` the planner kept the reference's
    gradients: +25% at dp_shard 8; the reference's worst block alone, with its
    gradients scaled, -3.7%: at dp_shard 8 a later block is the worst)."""
    from planner.layout import Plan
    from planner.memory import MemoryModel

    mm = MemoryModel(["--config", "llama_debug.toml", "--data.type", "synthetic", "--training.seq_len", "32"],
                     "cpu", 64)
    plan = Plan(8, 1, 8, local_batch=1, ac="full")
    read = mm.of(plan)
    exact = mm.estimate_exact(plan)
    assert not read.exact and read.peak_phase == max(exact.phases, key=exact.phases.get) == "earlier block backward"
    assert read.tensors == pytest.approx(exact.total, rel=0.01)
    # Accumulating, the gradients are held all along: no such phase, and no gradients twice
    # (the qwen3_30b_a3b search on 8 GPUs found no layout when they were).
    accum = Plan(8, 1, 8, local_batch=1, grad_accum=2, ac="full")
    read, exact = mm.of(accum), mm.estimate_exact(accum)
    assert "earlier block backward" not in exact.phases and read.peak_phase == "block backward"
    assert read.tensors == pytest.approx(exact.total, rel=0.01)


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
        # --predict's reading of the plan itself is the estimator's, accumulation included
        assert mm.exact(plan).tensors == exact.total and mm.exact(plan).total == exact.device_total


def test_a_search_skips_pipelines_for_the_pooled_balance_loss():
    """Qwen3-MoE's balance loss pooled over every MoE layer (HF's, the scope its flavors and HF
    imports default to) is refused under PP, as a layout check: the search leaves the PP
    layouts out and finds the others (it used to stop at the first PP layout with that line,
    so `plan.py --config qwen3_30b_a3b.toml --gpus 8` planned nothing)."""
    from planner.cli import NEUTRAL, parse, space_for
    from planner.hardware import KNOWN
    from planner.memory import MemoryModel
    from planner.search import Search
    from planner.workload import workload_of
    from trainer.config import load_config

    hw = KNOWN["h100-sxm"]
    argv = ["--config", "qwen3_moe_debug.toml", "--data.type", "synthetic", "--training.seq_len", "128",
            "--moe.aux_loss_scope", "model", *NEUTRAL]
    cfg = load_config(argv)
    assert cfg.model_args.aux_loss_scope == "model" and cfg.model_args.aux_loss_coeff > 0
    w = workload_of(cfg, hw)
    search = Search(cfg, argv, w, hw, 2, 128, 8, space_for(parse(["--ac", "full", "--compile", "off", "--float8", "off"])[0], hw),
                    MemoryModel(argv, hw.device, hw.gpus_per_node))
    assert any(s.pp > 1 for s in search.skeletons())  # there are PP layouts to leave out
    found = search.run(2)
    assert found and all(r.plan.pp == 1 for r in found), [r.plan for r in found]
