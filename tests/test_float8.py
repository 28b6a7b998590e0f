"""Float8 training (parallelisms/float8.py, torchao Float8Linear) on CPU.

torch 2.13's `torch._scaled_mm` has a CPU kernel, so these run the real float8 GEMMs:
- which Linear layers are converted (not the head, not the router gate, not dims % 16);
- over 100 steps on the debug model, the float8 loss stays within 3% of the fp32 one at
  every logged step (tensorwise and rowwise);
- FSDP 2 (with and without the float8 all-gather) and TP 2 equal one rank on the same
  microbatches, in fp32 master weights: float8 scales are computed over the whole
  tensor (a DTensor reduces its amax over the mesh), so sharding changes nothing but
  the summation order.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from tests.helpers import losses_by_step, run_in_process, torchrun
from tests.test_parallel_layouts import _load, loss_rel, max_rel, norm_rel

import torchao  # noqa: F401  (the dev extra installs it: missing, this fails, not skips)

F8 = ["--float8.enable", "true"]


def _build(name: str, flavor: str, **overrides):
    import dataclasses

    from models import get_model_spec

    spec = get_model_spec(name)
    args = dataclasses.replace(spec.flavors[flavor], **overrides)
    torch.manual_seed(0)
    model = spec.model_cls(args)
    model.init_weights()
    return model


@pytest.mark.parametrize("name,flavor", [("llama3", "debug_small"), ("deepseek_v3", "debug")])
def test_conversion_skips_head_router_and_odd_dims(name, flavor):
    from torchao.float8.float8_linear import Float8Linear

    from parallelisms.float8 import Float8Config, apply_float8

    model = _build(name, flavor)
    keys = list(model.state_dict())
    linears = {n: m.weight.shape for n, m in model.named_modules() if type(m) is nn.Linear}
    converted = apply_float8(model, Float8Config(enable=True))
    assert list(model.state_dict()) == keys  # checkpoints stay interchangeable
    f8 = {n for n, m in model.named_modules() if isinstance(m, Float8Linear)}
    assert f8 == set(converted)
    expected = {n for n, shape in linears.items()
                if n != "output" and not n.endswith("router.gate") and shape[0] % 16 == 0 and shape[1] % 16 == 0}
    assert f8 == expected and len(f8) >= 6
    assert isinstance(model.output, nn.Linear) and not isinstance(model.output, Float8Linear)
    assert all(not n.endswith("router.gate") for n in f8)


def test_float8_runs_scaled_mm_and_filters_match_patterns():
    from parallelisms.float8 import Float8Config, apply_float8

    model = nn.Sequential(nn.Linear(32, 48, bias=False), nn.Linear(48, 24), nn.Linear(24, 32))
    ref = [m.weight.detach().clone() for m in model]
    converted = apply_float8(model, Float8Config(enable=True, filter_fqns=["*0"], recipe="rowwise"))
    assert converted == []  # "0" filtered by pattern; "1" and "2" have a dim of 24
    model = nn.Sequential(nn.Linear(32, 48, bias=False), nn.Linear(48, 32, bias=False))
    with torch.no_grad():
        for m, w in zip(model, [ref[0], torch.randn(32, 48)]):
            m.weight.copy_(w)
    dense = [m.weight.detach().clone() for m in model]
    assert apply_float8(model, Float8Config(enable=True, filter_fqns=[])) == ["0", "1"]
    x = torch.randn(64, 32, requires_grad=True)
    with torch.profiler.profile() as prof:
        y = model(x)
        y.sum().backward()
    counts = {e.key: e.count for e in prof.key_averages()}
    assert counts.get("aten::_scaled_mm") == 6  # output, grad_input, grad_weight per Linear
    exact = x.detach() @ dense[0].t() @ dense[1].t()
    rel = (y.detach() - exact).norm() / exact.norm()
    assert 1e-4 < rel < 0.1, rel  # float8 rounding: visible, and small


def test_config_errors():
    from trainer.config import load_config
    from configuration.fields import ConfigError

    with pytest.raises(ConfigError, match="float8.enable_fsdp_float8_all_gather: needs recipe tensorwise"):
        load_config([*F8, "--float8.recipe", "rowwise", "--float8.enable_fsdp_float8_all_gather", "true"])
    with pytest.raises(ConfigError, match="float8.enable: false"):
        load_config(["--float8.moe_grouped_gemm", "true"])
    with pytest.raises(ConfigError, match="float8.moe_grouped_gemm: torchao's float8 grouped GEMM has CUDA"):
        from parallelisms.float8 import Float8Config, apply_float8

        apply_float8(_build("deepseek_v3", "debug"), Float8Config(enable=True, moe_grouped_gemm=True),
                     torch.device("cpu"))


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_float8_loss_within_3pct_of_fp32_over_100_steps(tmp_path):
    """About 2 minutes on 2 free cores for the three runs (eager float8 on CPU is slow: every
    cast is a tensor-subclass op); far longer on a loaded machine, hence the timeout. lr 1e-3:
    at llama_debug.toml's 3e-3 the loss curve itself jumps by 15% between logged steps."""
    base = ["--config", "llama_debug.toml", "--training.steps", "100", "--training.seq_len", "64",
            "--training.local_batch_size", "2",
            "--metrics.log_freq", "10", "--metrics.enable_tensorboard", "false", "--lr_scheduler.warmup_steps", "10",
            "--optimizer.lr", "1e-3"]
    curves = {}
    # fp32, not bf16 autocast: CPU float8 runs with oneDNN off (parallelisms/float8.py), where
    # bf16 matmuls are 250x slower; the high-precision reference is fp32 either way.
    for name, extra in {"fp32": [], "tensorwise": F8, "rowwise": [*F8, "--float8.recipe", "rowwise"]}.items():
        run_in_process([*base, *extra, "--job.dump_folder", str(tmp_path / name)])
        curves[name] = losses_by_step(tmp_path / name)
    ref = curves["fp32"]
    assert sorted(ref) == [1] + list(range(10, 101, 10))
    assert ref[100] < ref[1] - 1.5  # it trains
    for recipe in ("tensorwise", "rowwise"):
        got = curves[recipe]
        assert sorted(got) == sorted(ref)
        rel = {s: abs(got[s] - ref[s]) / ref[s] for s in ref}
        print(recipe, " ".join(f"{s}:{r:.4f}" for s, r in rel.items()))
        assert max(rel.values()) <= 0.03, rel
        assert got != ref  # float8 rounding reached the loss



STEPS = 3
BASE = ["--model.flavor", "debug_small", "--training.seq_len", "64", "--training.global_batch_size", "2",
        "--training.steps", str(STEPS), "--training.mixed_precision_param", "float32", "--optimizer.lr", "1e-4",
        "--lr_scheduler.warmup_steps", "0", "--lr_scheduler.min_lr_factor", "1.0", "--training.max_norm", "0.3",
        "--metrics.log_freq", "1", "--metrics.enable_tensorboard", "false", "--checkpoint.enable",
        "--checkpoint.interval", "1000", *F8]
LB = "--training.local_batch_size"
TP2 = ["--parallelism.tensor_parallel_degree", "2"]
# name -> (extra args, reference). TP ranks run the same 2-sample microbatch as "one_mb";
# FSDP ranks one sample each, as "accum2" runs them one after the other.
LAYOUTS = {
    "fsdp2": ([LB, "1"], "accum2"),
    "fsdp2_float8_all_gather": ([LB, "1", "--float8.enable_fsdp_float8_all_gather", "true"], "accum2"),
    "fsdp2_rowwise": ([LB, "1", "--float8.recipe", "rowwise"], "accum2_rowwise"),
    "tp2": ([LB, "2", *TP2], "one_mb"),
    "tp2_rowwise": ([LB, "2", *TP2, "--float8.recipe", "rowwise"], "one_mb_rowwise"),
}
REFS = {"accum2": [LB, "1"], "accum2_rowwise": [LB, "1", "--float8.recipe", "rowwise"], "one_mb": [LB, "2"],
        "one_mb_rowwise": [LB, "2", "--float8.recipe", "rowwise"]}


def _args(root: Path, name: str, extra: list[str]) -> list[str]:
    return [*BASE, "--job.dump_folder", str(root / "runs" / name), "--checkpoint.folder", str(root / "ck" / name),
            "--checkpoint.initial_load_path", str(root / "seed" / "checkpoint" / "step-0"), *extra]


@pytest.fixture(scope="module")
def parallel_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("float8")
    run_in_process([*BASE, LB, "2", "--checkpoint.create_seed_checkpoint", "--job.dump_folder", str(root / "seed")])
    refs = {}
    # The torchrun ranks run with one thread; so do the references, so that the CPU kernels
    # sum in the same order (tensorwise scales are not powers of 2: a last-bit change of an
    # amax moves every rounding boundary, and flips many float8 roundings).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    for name, extra in REFS.items():
        losses, trainer = run_in_process(_args(root, name, extra))
        part = trainer.model_parts[0]
        refs[name] = {"losses": losses, "params": {n: p.detach().clone() for n, p in part.named_parameters()},
                      "grads": {n: p.grad.detach().clone() for n, p in part.named_parameters()}}
    torch.set_num_threads(threads)
    cases = [{"name": n, "args": _args(root, n, extra)} for n, (extra, _) in LAYOUTS.items()]
    (root / "cases.json").write_text(json.dumps(cases))
    torchrun(2, [str(root / "cases.json"), str(root / "out")], timeout=300, module="tests.parallel_worker")
    return refs, {n: _load(root / "out", n) for n in LAYOUTS}


@pytest.mark.multirank
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_float8_parallel_equals_one_rank(name, parallel_runs):
    refs, results = parallel_runs
    ref, got = refs[LAYOUTS[name][1]], results[name]
    dl, dg, dp = loss_rel(got["losses"], ref["losses"]), max_rel(got["grads"], ref["grads"]), \
        norm_rel(got["params"], ref["params"])
    print(f"{name}: loss {dl:.1e} grad {dg:.1e} param {dp:.1e}")
    if name == "tp2_rowwise":
        # RowwiseParallel layers (wo, w2) take their row scales over each rank's K shard: a
        # different float8 rounding of the same product, as accurate as one rank's (a unit
        # test of one such layer: 3.6% error vs fp32 either way, 0.2% apart). So compare at
        # float8 scale: the loss closely, the gradients by norm.
        dgn = norm_rel(got["grads"], ref["grads"])
        print(f"{name}: grad norm-rel {dgn:.1e}")
        assert dl <= 1e-4 and dgn <= 0.05 and dp <= 1e-2, (dl, dgn, dp)
        return
    assert dl <= 1e-5 and dg <= 1e-5 and dp <= 1e-5, (dl, dg, dp)
