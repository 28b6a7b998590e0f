"""Expert parallelism and MoE composition: every layout equals one rank; AC numerics and
trace on the MoE model; MoE load metrics; DCP resume with the balancing biases.

All runs use the tiny DeepSeek V3 flavor `ep_test` (registered by tests/ep_worker.py:
1 dense + 2 MoE blocks, 8 experts top-2) and start from one seed checkpoint whose
`expert_bias` skews routing: experts 6 and 7 never get a token (so under EP 4 one rank
receives nothing from anyone), expert 0 gets ~2.5x the mean. Same global batches, fp32,
constant LR, clipping on. Adam's eps is 1e-4 here: with the default 1e-8 the update of
an element whose gradient is ~1e-9 (there are many at init, e.g. behind q_norm) is
~lr * sign(grad), so last-bit differences of the summation order become 1e-4-relative
parameter differences after one step, for FSDP alone just as for EP.

Multi-rank layouts run as cases of two torchrun launches of tests/ep_worker.py (2 and 4
ranks); references run in this process. Run with `-s` for the table of differences.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import tests.ep_worker as ep_worker
from tests.helpers import read_metrics, run_in_process, torchrun

STEPS = 3
TOL = 1e-5
BASE = ["--model.name", "deepseek_v3", "--model.flavor", "ep_test", "--training.seq_len", "64",
        "--training.global_batch_size", "4", "--training.steps", str(STEPS), "--training.mixed_precision_param",
        "float32", "--optimizer.lr", "1e-3", "--optimizer.eps", "1e-4", "--lr_scheduler.warmup_steps", "0",
        "--lr_scheduler.min_lr_factor", "1.0", "--metrics.log_freq", "1", "--metrics.enable_tensorboard", "false",
        "--checkpoint.enable", "--checkpoint.interval", "1000"]
EP = "--parallelism.expert_parallel_degree"
TP = "--parallelism.tensor_parallel_degree"
LB = "--training.local_batch_size"
PP2 = ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_microbatch_size", "1",
       "--parallelism.pipeline_parallel_schedule", "1F1B"]

# name -> (world, extra args); local_batch_size x dp degree = 4 everywhere.
LAYOUTS: dict[str, tuple[int, list[str]]] = {
    "ep2": (2, [LB, "2", EP, "2", "--checkpoint.interval", "2"]),
    "ep2_ac_op": (2, [LB, "2", EP, "2", "--activation_checkpoint.mode", "op"]),
    "ep2_ac_full": (2, [LB, "2", EP, "2", "--activation_checkpoint.mode", "full"]),
    # bf16 params under FSDP; the EP-only experts (no efsdp mesh, so outside FSDP) stay fp32
    # and are cast to the activations' dtype by GroupedExperts.
    "ep2_bf16": (2, [LB, "2", EP, "2", "--training.mixed_precision_param", "bfloat16",
                     "--training.mixed_precision_on_cpu", "true"]),
    "ep2_tp2_sp": (2, [LB, "4", EP, "2", TP, "2"]),
    "tp2_sp": (2, [LB, "4", TP, "2"]),
    "tp2_nosp": (2, [LB, "4", TP, "2", "--parallelism.enable_sequence_parallel", "false"]),
    "ep4": (4, [LB, "1", EP, "4"]),
    "ep2_fsdp2": (4, [LB, "1", EP, "2"]),
    "ep2_pp2": (4, [LB, "2", EP, "2", *PP2]),
    "ep2_tp2_fsdp2": (4, [LB, "2", EP, "2", TP, "2"]),
    "ep2_hsdp2x2": (4, [LB, "1", EP, "2", "--parallelism.data_parallel_replicate_degree", "2"]),
}
# name -> (world, layout whose step-2 checkpoint is resumed, extra args of the resuming layout)
RESUMES: dict[str, tuple[int, str, list[str]]] = {
    "resume_ep2_same": (2, "ep2", LAYOUTS["ep2"][1]),
    "resume_ep2_to_tp2ep2fsdp2": (4, "ep2", LAYOUTS["ep2_tp2_fsdp2"][1]),
}
REPORT: list[str] = []
# Layouts compared on the loss only, with this relative tolerance (bf16 compute vs fp32).
LOSS_ONLY = {"ep2_bf16": 5e-3}


def _args(root: Path, name: str, extra: list[str]) -> list[str]:
    return [*BASE, "--job.dump_folder", str(root / "runs" / name), "--checkpoint.folder", str(root / "ck" / name),
            "--checkpoint.initial_load_path", str(root / "seed" / "checkpoint" / "step-0"), *extra]


def _merge(out: Path, name: str) -> dict:
    files = sorted(out.glob(f"{name}.stage*.pt"))
    assert files, f"no output for {name}"
    merged: dict = {"params": {}, "grads": {}, "buffers": {}}
    for f in files:
        rec = torch.load(f, weights_only=False)
        for key in ("params", "grads", "buffers"):
            merged[key].update(rec[key])
        for key in ("losses", "empty_receives", "metrics"):
            if key in rec:
                merged[key] = rec[key]
    return merged


def max_rel(got: dict, ref: dict) -> float:
    """Max over tensors of max|got - ref| / max|ref|."""
    assert set(got) == set(ref), sorted(set(got) ^ set(ref))
    worst = 0.0
    for k, r in ref.items():
        assert got[k].shape == r.shape, (k, got[k].shape, r.shape)
        worst = max(worst, (got[k] - r).abs().max().item() / max(r.abs().max().item(), 1e-30))
    return worst


def loss_rel(got: list[float], ref: list[float]) -> float:
    assert len(got) == len(ref), (got, ref)
    return max(abs(a - b) / abs(b) for a, b in zip(got, ref))


@pytest.fixture(scope="module")
def suite(tmp_path_factory):
    root = tmp_path_factory.mktemp("ep")
    ep_worker.write_seed_checkpoint([*BASE, LB, "4", "--checkpoint.create_seed_checkpoint",
                                     "--job.dump_folder", str(root / "seed")])
    losses, trainer = run_in_process(_args(root, "ref", [LB, "4", "--checkpoint.interval", "2"]))
    ref = {"losses": losses, **ep_worker.snapshot(trainer.model_parts)}
    ref["metrics"] = read_metrics(root / "runs" / "ref")
    out, results, logs = root / "out", {}, {}
    for world in (2, 4):
        cases = [{"name": n, "args": _args(root, n, extra)} for n, (w, extra) in LAYOUTS.items() if w == world]
        cases += [{"name": n, "args": _args(root, n, extra),
                   "copy": [str(root / "ck" / src / "step-2"), str(root / "ck" / n / "step-2")]}
                  for n, (w, src, extra) in RESUMES.items() if w == world]
        (root / f"cases{world}.json").write_text(json.dumps(cases))
        proc = torchrun(world, [str(root / f"cases{world}.json"), str(out)], timeout=400, module="tests.ep_worker",
                        env={"AC_TRACE": "1"})
        logs[world] = proc.stdout + proc.stderr
        print("\n".join(line for line in proc.stdout.splitlines() if line.startswith("[ep_worker]")))
        for c in cases:
            results[c["name"]] = _merge(out, c["name"])
    yield ref, results, logs
    print("\nlayout                      world  loss rel   grad rel   param rel  bias rel   empty receives")
    print("\n".join(REPORT))


def _compare(name: str, world: int, ref: dict, got: dict) -> None:
    dl = loss_rel(got["losses"], ref["losses"])
    if name in LOSS_ONLY:
        REPORT.append(f"{name:<27} {world:>5}  {dl:9.2e}  (bf16: loss only)  {got['empty_receives']}")
        assert dl <= LOSS_ONLY[name], (name, got["losses"], ref["losses"])
        assert all(torch.isfinite(g).all() for g in got["grads"].values())
        return
    dg, dp, db = (max_rel(got[k], ref[k]) for k in ("grads", "params", "buffers"))
    REPORT.append(f"{name:<27} {world:>5}  {dl:9.2e}  {dg:9.2e}  {dp:9.2e}  {db:9.2e}  {got['empty_receives']}")
    assert dl <= TOL, (name, got["losses"], ref["losses"])
    assert dg <= TOL and dp <= TOL and db <= TOL, (name, dg, dp, db)


@pytest.mark.multirank
@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_matches_one_rank(name, suite):
    ref, results, _ = suite
    world = LAYOUTS[name][0]
    got = results[name]
    _compare(name, world, ref, got)
    if name == "ep4":
        # Experts 6 and 7 (EP rank 3's) get no token: that rank received zero rows in each
        # MoE forward (2 layers x 3 steps).
        assert got["empty_receives"] >= 2 * STEPS, got["empty_receives"]


@pytest.mark.multirank
@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", list(RESUMES))
def test_dcp_resume_with_ep(name, suite):
    """Saved at step 2 under EP 2, resumed under the same or another layout: step 3 and the
    final params, grads and expert biases match the one-rank run (bitwise on the same layout)."""
    ref, results, _ = suite
    world, src, _ = RESUMES[name]
    got = results[name]
    assert len(got["losses"]) == STEPS - 2
    _compare(name, world, {**ref, "losses": ref["losses"][2:]}, got)
    if name == "resume_ep2_same":
        assert got["losses"] == results[src]["losses"][2:]
        assert all(torch.equal(got["buffers"][k], results[src]["buffers"][k]) for k in got["buffers"])


@pytest.mark.multirank
@pytest.mark.timeout(900)
def test_routing_is_skewed_and_logged(suite):
    """The seed skews routing (an idle expert, a hot one); per-layer load reaches metrics.jsonl
    identically under EP, and TP ranks' tokens are counted too (sequence parallel)."""
    ref, results, _ = suite
    last = ref["metrics"][-1]
    for layer in ("1", "2"):
        assert last[f"moe/layer{layer}_idle_experts"] == 2
        assert last[f"moe/layer{layer}_max_over_mean"] > 1.5
    assert last["moe/max_over_mean"] == max(last["moe/layer1_max_over_mean"], last["moe/layer2_max_over_mean"])
    for name in ("ep4", "ep2_tp2_sp", "ep2_tp2_fsdp2"):
        rec = results[name]["metrics"][-1]
        for key in ("moe/layer1_max_over_mean", "moe/layer2_max_over_mean", "moe/layer1_idle_experts"):
            assert rec[key] == last[key], (name, key)


@pytest.mark.multirank
@pytest.mark.timeout(900)
def test_ac_trace_on_ep_moe(suite):
    """AC_TRACE=1 on the EP run with op-level SAC: the all-to-alls and topk are saved, the
    experts' down GEMM is skipped in the recompute (DeepSeek's MoE rules), the router gate's
    matmul is force-recomputed."""
    _, _, logs = suite
    log = logs[2]
    assert "AC_TRACE SAVE _c10d_functional.all_to_all_single.default" in log
    assert "AC_TRACE SAVE aten.topk.default" in log
    assert "AC_TRACE SKIP aten._grouped_mm.default" in log
    assert "force_recompute_mm_fqns: layers.1.moe.router.gate" in log


# ---------------------------------------------------------------- one process


def _one_rank(tmp_path: Path, name: str, extra: list[str]):
    return run_in_process(_args(tmp_path, name, [LB, "4", *extra]))


@pytest.fixture(scope="module")
def seed_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("ep1")
    ep_worker.write_seed_checkpoint([*BASE, LB, "4", "--checkpoint.create_seed_checkpoint",
                                     "--job.dump_folder", str(root / "seed")])
    return root


@pytest.mark.timeout(300)
def test_ac_modes_bitwise_on_moe(seed_root):
    """Every eager AC mode on the MoE model: losses and every gradient bitwise equal to none."""
    ref_losses, ref = _one_rank(seed_root, "ac_none", ["--training.steps", "2"])
    ref_grads = {ep_worker.clean(n): p.grad.clone() for n, p in ref.model_parts[0].named_parameters()}
    for mode in ("full", "selective", "op"):
        losses, t = _one_rank(seed_root, f"ac_{mode}", ["--training.steps", "2", "--activation_checkpoint.mode", mode,
                                                        "--activation_checkpoint.selective_layer_interval", "2"])
        assert losses == ref_losses, mode
        grads = {ep_worker.clean(n): p.grad for n, p in t.model_parts[0].named_parameters()}
        assert set(grads) == set(ref_grads)
        for n, g in grads.items():
            assert torch.equal(g, ref_grads[n]), (mode, n)


@pytest.mark.timeout(300)
def test_resume_restores_expert_bias_bitwise(seed_root):
    """DCP resume of the MoE model: bitwise losses, and the balancing biases come back from the
    checkpoint (they differ from the seed's by then); metrics reach TensorBoard."""
    common = ["--training.steps", "4", "--checkpoint.interval", "2", "--metrics.enable_tensorboard", "true"]
    straight, t_straight = _one_rank(seed_root, "straight", common)
    first, t_first = run_in_process(_args(seed_root, "resumed", [LB, "4", *common]), stop_after=2)
    assert len(first) == 2
    bias_at_2 = {n: b.clone() for n, b in t_first.model_parts[0].named_buffers() if n.endswith("expert_bias")}
    seed_bias = torch.tensor(ep_worker.SKEW_BIAS)
    assert all(not torch.equal(b, seed_bias) for b in bias_at_2.values())

    from trainer.config import load_config
    from trainer.train import Trainer

    trainer = Trainer(load_config(_args(seed_root, "resumed", [LB, "4", *common])))
    assert trainer.step == 2
    loaded = {n: b.clone() for n, b in trainer.model_parts[0].named_buffers() if n.endswith("expert_bias")}
    assert loaded.keys() == bias_at_2.keys() and all(torch.equal(loaded[n], bias_at_2[n]) for n in loaded)
    try:
        second = trainer.train()
    finally:
        trainer.close()
    assert first + second == straight
    for (n, a), (_, b) in zip(t_straight.model_parts[0].named_buffers(), trainer.model_parts[0].named_buffers()):
        assert torch.equal(a, b), n
    tb = list((seed_root / "runs" / "straight").rglob("events.out.tfevents.*"))
    assert tb, "no TensorBoard event file"
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb[0].parent))
    acc.Reload()
    assert "moe/layer1_max_over_mean" in acc.Tags()["scalars"]


# ---------------------------------------------------------------- config errors


@pytest.mark.parametrize("extra, needle", [
    ([EP, "2", TP, "2", "--parallelism.enable_sequence_parallel", "false"], "needs sequence parallel"),
    ([EP, "3"], "does not divide the model's 8 routed experts"),
    (["--model.name", "llama3", "--model.flavor", "debug_small", EP, "2"], "has no routed experts"),
    # A dense Qwen3 flavor has n_routed_experts = 0: it was refused only inside a worker, after the launch.
    (["--model.name", "qwen3", "--model.flavor", "debug", EP, "2"], "has no routed experts"),
])
def test_ep_config_errors_are_one_line(extra, needle):
    from trainer.config import load_config
    from configuration.fields import ConfigError

    with pytest.raises(ConfigError) as e:
        load_config([*BASE, *extra])
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_parallel_dims_expert_meshes_math():
    from parallelisms.parallel_dims import ParallelDims

    dims = ParallelDims(dp_shard=4, tp=2, ep=4, world_size=8)
    assert dims.expert_fsdp_degree == 2
    dims = ParallelDims(dp_shard=2, tp=2, ep=4, world_size=4)
    assert dims.expert_fsdp_degree == 1


def test_deepseek_sac_save_ops_keep_all_to_all_and_let_grouped_mm_alternate():
    from models import MODEL_SPECS
    from parallelisms.activation_checkpoint import ActivationCheckpointConfig, OpSAC, OpSACPolicy, default_save_ops

    spec = MODEL_SPECS["deepseek_v3"]
    ops = torch.ops
    assert ops._c10d_functional.all_to_all_single.default in spec.sac_save_ops
    assert ops.aten.topk.default in spec.sac_save_ops
    assert ops.aten._grouped_mm.default not in spec.sac_save_ops
    policy = OpSACPolicy(default_save_ops(spec.sac_save_ops), explicit_save_ops=spec.sac_save_ops,
                         rules=OpSAC(ActivationCheckpointConfig(mode="op")))
    verdicts = [policy.decide(op, False)[1] for op in (ops.aten._grouped_mm.default, ops.aten._grouped_mm.default,
                                                        ops._c10d_functional.all_to_all_single.default)]
    assert verdicts == ["ALTERNATE", "ALTERNATE", "SAVE"]
