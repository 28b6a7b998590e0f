"""Every parallel layout equals one rank: losses, last-step gradients and post-step params.

All runs start from one seed checkpoint and see the same global batches (the loader's
global batch composition does not depend on the dp degree), in fp32, with a constant LR
and gradient clipping on. Layouts run as cases of two torchrun launches of
tests/parallel_worker.py (2 and 4 ranks); references run in this process. DCP cases save
under one layout at step 2 and continue to step 4 under another.

Tolerances: 1e-5 relative. Adam turns tiny fp32 summation-order differences into
larger ones over steps (an element with a near-zero gradient gets an update of about
+-lr either way), so the LR is kept small (1e-4): then the last-step gradients agree
to ~1e-6 of their scale. Post-step params are compared by tensor norm.

Gradient clipping is active in every step (max_norm 0.3, below the models' grad norms),
so the global norm across dp, TP and PP is checked too.

DCP data order: the loader's position is a global batch index. Resuming a dp=2
checkpoint on dp=4, ranks 2 and 3 have no `dataloader_dp{r}` state of their own, so the
Checkpointer gives them dp rank 0's (without that, they restarted at batch 0 and the
step-3 loss differed by ~1e-2 relative). The DCP cases then match the uninterrupted run.

Run with `-s` to see the table of measured differences.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from tests.helpers import run_in_process, torchrun

pytestmark = [pytest.mark.multirank]

STEPS = 4
TOL = 1e-5
BASE = ["--training.seq_len", "64", "--training.global_batch_size", "4", "--training.steps", str(STEPS),
        "--optimizer.lr", "1e-4", "--lr_scheduler.warmup_steps", "0", "--lr_scheduler.min_lr_factor", "1.0",
        "--training.max_norm", "0.3", "--metrics.log_freq", "1", "--metrics.enable_tensorboard", "false",
        "--checkpoint.enable",
        "--checkpoint.interval", "1000"]
PP2 = ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_microbatch_size", "1"]


def sched(name: str, spr: int = 1) -> list[str]:
    return ["--parallelism.pipeline_parallel_schedule", name, "--parallelism.pipeline_parallel_stages_per_rank",
            str(spr)]


# name -> (world size, flavor, extra args). local_batch_size x dp = 4 everywhere.
LAYOUTS: dict[str, tuple[int, str, list[str]]] = {
    # 2 ranks
    "fsdp2": (2, "debug_small", ["--training.local_batch_size", "2", "--checkpoint.interval", "2"]),
    "tp2_sp_lossparallel": (2, "debug_small", ["--training.local_batch_size", "4",
                                               "--parallelism.tensor_parallel_degree", "2"]),
    "tp2_nosp_gathered": (2, "debug_small", ["--training.local_batch_size", "4",
                                             "--parallelism.tensor_parallel_degree", "2",
                                             "--parallelism.enable_sequence_parallel", "false",
                                             "--parallelism.disable_loss_parallel", "true"]),
    "tp2_ac_op": (2, "debug_small", ["--training.local_batch_size", "4", "--parallelism.tensor_parallel_degree", "2",
                                     "--activation_checkpoint.mode", "op"]),
    "fsdp2_compile": (2, "debug_small", ["--training.local_batch_size", "2", "--compile.enable", "true"]),
    "pp2_gpipe": (2, "debug_small", ["--training.local_batch_size", "4", *PP2, *sched("GPipe")]),
    "pp2_1f1b": (2, "debug_small", ["--training.local_batch_size", "4", *PP2, *sched("1F1B")]),
    "pp2_1f1b_accum2": (2, "debug_small", ["--training.local_batch_size", "2", *PP2, *sched("1F1B")]),
    "pp2_1f1b_deepseek": (2, "ds_debug", ["--training.local_batch_size", "4", *PP2, *sched("1F1B")]),
    "pp2_interleaved1f1b_x2": (2, "debug", ["--training.local_batch_size", "4", *PP2, *sched("Interleaved1F1B", 2)]),
    "pp2_loopedbfs_x2": (2, "debug", ["--training.local_batch_size", "4", *PP2, *sched("LoopedBFS", 2)]),
    "pp2_interleavedzb_x2": (2, "debug", ["--training.local_batch_size", "4", *PP2,
                                          *sched("InterleavedZeroBubble", 2)]),
    "pp2_zbv_x2": (2, "debug", ["--training.local_batch_size", "4", *PP2, *sched("ZBVZeroBubble", 2)]),
    "pp2_dualpipev_x2": (2, "debug", ["--training.local_batch_size", "4", *PP2, *sched("DualPipeV", 2)]),
    # 4 ranks
    "fsdp4": (4, "debug_small", ["--training.local_batch_size", "1"]),
    "fsdp4_offload_never": (4, "debug_small", ["--training.local_batch_size", "1",
                                               "--parallelism.fsdp_cpu_offload", "true",
                                               "--parallelism.fsdp_reshard_after_forward", "never"]),
    "hsdp2x2": (4, "debug_small", ["--training.local_batch_size", "1",
                                   "--parallelism.data_parallel_replicate_degree", "2"]),
    "hsdp2x2_always": (4, "debug_small", ["--training.local_batch_size", "1",
                                          "--parallelism.data_parallel_replicate_degree", "2",
                                          "--parallelism.fsdp_reshard_after_forward", "always"]),
    "fsdp2_tp2": (4, "debug_small", ["--training.local_batch_size", "2", "--parallelism.tensor_parallel_degree", "2",
                                     "--checkpoint.interval", "2"]),
    "pp2_fsdp2": (4, "debug_small", ["--training.local_batch_size", "2", *PP2, *sched("1F1B")]),
    "pp2_tp2": (4, "debug_small", ["--training.local_batch_size", "4", "--parallelism.tensor_parallel_degree", "2",
                                   *PP2, *sched("1F1B")]),
    # 8 ranks: the N-D composition
    "fsdp2_tp2_pp2_interleaved": (8, "debug", ["--training.local_batch_size", "2",
                                               "--parallelism.tensor_parallel_degree", "2", *PP2,
                                               *sched("Interleaved1F1B", 2)]),
}

# name -> (world size, source layout whose step-2 checkpoint is resumed, extra args of the new layout)
RESUMES: dict[str, tuple[int, str, list[str]]] = {
    "dcp_fsdp2_to_fsdp4": (4, "fsdp2", LAYOUTS["fsdp4"][2]),
    "dcp_fsdp2tp2_to_fsdp4": (4, "fsdp2_tp2", LAYOUTS["fsdp4"][2]),
    "dcp_fsdp2tp2_to_pp2fsdp2": (4, "fsdp2_tp2", LAYOUTS["pp2_fsdp2"][2]),
    "dcp_fsdp2_to_1rank": (1, "fsdp2", ["--training.local_batch_size", "4"]),
}

REPORT: list[str] = []


# Reference models: key -> (model.name, model.flavor). debug_small: 3 layers (uneven PP
# split), GQA 4/2 heads (TP 2 leaves one KV head per rank); debug: 6 layers (4 stages);
# ds_debug: DeepSeek V3 debug (MLA + MoE) for PP.
MODELS = {"debug_small": ("llama3", "debug_small"), "debug": ("llama3", "debug"), "ds_debug": ("deepseek_v3", "debug")}


def _common(root: Path, name: str, flavor: str, models: dict = MODELS) -> list[str]:
    model, fl = models[flavor]
    return [*BASE, "--model.name", model, "--model.flavor", fl, "--job.dump_folder", str(root / "runs" / name),
            "--checkpoint.folder", str(root / "ck" / name),
            "--checkpoint.initial_load_path", str(root / f"seed_{flavor}" / "checkpoint" / "step-0")]


def _state(trainer) -> tuple[dict, dict]:
    params, grads = {}, {}
    for name, p in trainer.model_parts[0].named_parameters():
        params[name] = p.detach().clone()
        grads[name] = p.grad.detach().clone()
    return params, grads


def _load(out: Path, name: str) -> dict:
    files = sorted(out.glob(f"{name}.stage*.pt"))
    assert files, f"no output for {name}"
    merged: dict = {"params": {}, "grads": {}, "loaded": {}}
    for f in files:
        rec = torch.load(f, weights_only=False)
        merged["losses"] = rec["losses"]
        for key in ("params", "grads", "loaded"):
            merged[key].update(rec.get(key, {}))
    return merged


def max_rel(got: dict, ref: dict) -> float:
    """Max over tensors of max|got - ref| / max|ref|."""
    assert set(got) == set(ref), (sorted(set(got) ^ set(ref)))
    worst = 0.0
    for k, r in ref.items():
        g = got[k]
        assert g.shape == r.shape, (k, g.shape, r.shape)
        worst = max(worst, (g.float() - r.float()).abs().max().item() / max(r.abs().max().item(), 1e-30))
    return worst


def norm_rel(got: dict, ref: dict) -> float:
    """Max over tensors of ||got - ref|| / ||ref||."""
    assert set(got) == set(ref), (sorted(set(got) ^ set(ref)))
    return max(((got[k].float() - r.float()).norm() / r.float().norm().clamp_min(1e-30)).item()
               for k, r in ref.items())


def loss_rel(got: list[float], ref: list[float]) -> float:
    assert len(got) == len(ref), (got, ref)
    return max(abs(a - b) / abs(b) for a, b in zip(got, ref))


def write_seed_checkpoints(root: Path, flavors, models: dict = MODELS) -> None:
    """One process writes the step-0 weights of each flavor (keys of `models`) under root/seed_<flavor>."""
    for flavor in flavors:
        model, fl = models[flavor]
        run_in_process([*BASE, "--model.name", model, "--model.flavor", fl, "--training.local_batch_size", "4",
                        "--checkpoint.create_seed_checkpoint", "--job.dump_folder", str(root / f"seed_{flavor}")])


def reference_run(args: list[str]) -> dict:
    """One process trains `args`: {"losses", "params", "grads"} of its last step."""
    losses, trainer = run_in_process(args)
    params, grads = _state(trainer)
    return {"losses": losses, "params": params, "grads": grads}


def print_report(rows: list[str]) -> None:
    print("\nlayout                         world  loss       grad       param")
    print("(loss: max over steps of |d|/|ref|; grad: last step, max over tensors of max|d|/max|ref|; "
          "param: after the last step, max over tensors of ||d||/||ref||)")
    print("\n".join(rows))


@pytest.fixture(scope="module")
def refs(tmp_path_factory):
    """Seed checkpoints and one-rank references; yields (root, refs) and prints the report at the end."""
    root = tmp_path_factory.mktemp("layouts")
    write_seed_checkpoints(root, MODELS)
    refs = {}
    # debug_small: 2 steps, checkpoint, resume to 4 (bitwise equal to one run; gives the step-2 params too).
    args = _common(root, "ref_debug_small", "debug_small") + ["--training.local_batch_size", "4"]
    l1, t1 = run_in_process([*args, "--training.steps", "2"])
    step2 = {n: p.detach().clone() for n, p in t1.model_parts[0].named_parameters()}
    l2, t2 = run_in_process(args)
    params, grads = _state(t2)
    refs["debug_small"] = {"losses": l1 + l2, "params": params, "grads": grads, "step2": step2}
    for flavor in ("debug", "ds_debug"):
        refs[flavor] = reference_run(_common(root, f"ref_{flavor}", flavor) + ["--training.local_batch_size", "4"])
    yield root, refs
    print_report(REPORT)


def _launch(root: Path, world: int) -> dict:
    """All cases of one world size in one torchrun launch; returns name -> merged record."""
    cases = [{"name": n, "args": _common(root, n, fl) + extra} for n, (w, fl, extra) in LAYOUTS.items() if w == world]
    for n, (w, src, extra) in RESUMES.items():
        if w == world:
            cases.append({"name": n, "args": _common(root, n, "debug_small") + extra, "dump_loaded": True,
                          "copy": [str(root / "ck" / src / "step-2"), str(root / "ck" / n / "step-2")]})
    return run_layout_cases(root, world, cases)


def run_layout_cases(root: Path, world: int, cases: list[dict], timeout: int = 420) -> dict:
    """`cases` in one torchrun launch of tests/parallel_worker.py; returns name -> merged record."""
    (root / f"cases{world}.json").write_text(json.dumps(cases))
    proc = torchrun(world, [str(root / f"cases{world}.json"), str(root / "out")], timeout=timeout,
                    module="tests.parallel_worker")
    print("\n".join(line for line in proc.stdout.splitlines() if line.startswith("[worker]")))
    return {c["name"]: _load(root / "out", c["name"]) for c in cases}


@pytest.fixture(scope="module")
def suite(refs):
    root, ref = refs
    results = {**_launch(root, 2), **_launch(root, 4)}
    # One rank resumes the FSDP 2 checkpoint.
    name = "dcp_fsdp2_to_1rank"
    shutil.copytree(root / "ck" / "fsdp2" / "step-2", root / "ck" / name / "step-2")
    from trainer.config import load_config
    from trainer.train import Trainer

    trainer = Trainer(load_config(_common(root, name, "debug_small") + RESUMES[name][2]))
    loaded = {n: p.detach().clone() for n, p in trainer.model_parts[0].named_parameters()}
    try:
        losses = trainer.train()
    finally:
        trainer.close()
    params, grads = _state(trainer)
    results[name] = {"losses": losses, "params": params, "grads": grads, "loaded": loaded}
    return ref, results


def compare_to_reference(name: str, world: int, got: dict, ref: dict, report: list[str], note: str = "") -> None:
    """Losses, last-step grads and post-step params of a run vs its reference, within TOL;
    appends a row to `report`."""
    dl = loss_rel(got["losses"], ref["losses"])
    dg = max_rel(got["grads"], ref["grads"])
    dp = norm_rel(got["params"], ref["params"])
    report.append(f"{name:<30} {world:>5}  {dl:9.2e}  {dg:9.2e}  {dp:9.2e}  {note}")
    assert dl <= TOL, (name, got["losses"], ref["losses"])
    assert dg <= TOL, (name, dg)
    assert dp <= TOL, (name, dp)


def _check(name: str, flavor: str, suite, world: int) -> None:
    refs, results = suite
    ref, got = refs[flavor], results[name]
    compare_to_reference(name, world, got, ref, REPORT,
                         f"(param max-abs rel {max_rel(got['params'], ref['params']):.1e})")


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", [n for n, (w, _, _) in LAYOUTS.items() if w <= 4])
def test_layout_matches_one_rank(name, suite):
    world, flavor, _ = LAYOUTS[name]
    _check(name, flavor, suite, world)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_fsdp_tp_pp_3d_matches_one_rank(refs):
    """FSDP 2 x TP 2 (SP, loss parallel) x PP 2 (Interleaved1F1B, 2 stages per rank) on 8 ranks."""
    root, ref = refs
    name = "fsdp2_tp2_pp2_interleaved"
    _check(name, "debug", (ref, _launch(root, 8)), 8)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", list(RESUMES))
def test_dcp_resume_across_layouts(name, suite):
    """Saved at step 2 under one layout, resumed under another: the loaded weights are the
    step-2 weights, and steps 3-4 (plus final grads/params) match the one-rank run."""
    refs, results = suite
    world = RESUMES[name][0]
    got = results[name]
    assert len(got["losses"]) == STEPS - 2
    dl0 = norm_rel(got["loaded"], refs["debug_small"]["step2"])
    assert dl0 <= TOL, (name, dl0)
    ref = dict(refs["debug_small"])
    ref["losses"] = ref["losses"][2:]
    dl = loss_rel(got["losses"], ref["losses"])
    dg = max_rel(got["grads"], ref["grads"])
    dp = norm_rel(got["params"], ref["params"])
    REPORT.append(f"{name:<30} {world:>5}  {dl:9.2e}  {dg:9.2e}  {dp:9.2e}  (loaded step-2 params {dl0:.1e})")
    assert dl <= TOL, (name, got["losses"], ref["losses"])
    assert dg <= TOL, (name, dg)
    assert dp <= TOL, (name, dp)
