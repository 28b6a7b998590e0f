"""Muon under every layout equals Muon on one rank; its momentum resumes through DCP.

FSDP 2, TP 2, EP 2 (DeepSeek debug and Qwen3 MoE debug: experts whole on each rank, so
each expert's matrices are orthogonalised where they live) and PP 2 in one 2-rank
torchrun launch, with FSDP 2 under fsdp_cpu_offload and PP 2 whose `muon_params` patterns
each match one stage's blocks only (checked over the whole model, not per stage), and Qwen3
MoE under EP 2 with the balance loss pooled over its layers (the pick counts summed over
the data ranks: one rank's loss and gradients); FSDP 2 x TP 2 (Llama, and DeepSeek: MLA's
and the experts' TP plans) and HSDP 2 x 2 in a 4-rank one; against one-rank references: 5
steps in fp32 from one seed checkpoint, gradient clipping active (max_norm 0.3), losses,
last-step grads and post-step params within 1e-5 (tests/test_parallel_layouts.py's
measures). FSDP and TP shard the hidden matrices, so these pass only if every matrix is
orthogonalised whole (parallelisms/muon_assembly.py): NS of a shard is not a shard of NS.

Resume: the FSDP 2 run saves at step 3; the same layout resumed from it ends bitwise
equal to the uninterrupted run (momentum buffers and AdamW states through DCP), and
TP 2 resumed from it (resharded) matches the reference within 1e-5.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers import run_in_process
from tests.test_parallel_layouts import MODELS, PP2, _common, compare_to_reference, loss_rel, max_rel, norm_rel, \
    print_report, run_layout_cases, write_seed_checkpoints

pytestmark = [pytest.mark.multirank]

STEPS = 5
MUON = ["--training.steps", str(STEPS), "--optimizer.name", "muon", "--optimizer.muon_lr", "2e-3",
        "--checkpoint.interval", "1000"]
LB, TP, EP = "--training.local_batch_size", "--parallelism.tensor_parallel_degree", \
    "--parallelism.expert_parallel_degree"

# Each pattern matches blocks of one PP stage only (debug_small: 3 blocks over 2 stages).
SPLIT = ["--optimizer.muon_params", "layers.0.*,layers.2.*"]
# HF's balance loss, one over every MoE layer (models/common/moe_pool.py), at a weight that moves the routers.
POOLED = ["--moe.aux_loss_scope", "model", "--moe.aux_loss_coeff", "0.5"]
# name -> (world, flavor, extra args); local_batch_size x dp = 4 everywhere.
LAYOUTS: dict[str, tuple[int, str, list[str]]] = {
    "muon_fsdp2": (2, "debug_small", [LB, "2", "--checkpoint.interval", "3"]),
    "muon_tp2": (2, "debug_small", [LB, "4", TP, "2"]),
    "muon_ep2": (2, "ds_debug", [LB, "2", EP, "2"]),
    "muon_ep2_qwen3_moe": (2, "qwen3_moe", [LB, "2", EP, "2"]),
    "muon_pp2": (2, "debug_small", [LB, "4", *PP2]),
    "muon_fsdp2_tp2": (4, "debug_small", [LB, "2", TP, "2"]),
    "muon_fsdp2_tp2_deepseek": (4, "ds_debug", [LB, "2", TP, "2"]),  # MLA's and the experts' TP plans
    "muon_hsdp2x2": (4, "debug_small", [LB, "1", "--parallelism.data_parallel_replicate_degree", "2"]),
    "muon_fsdp2_offload": (2, "debug_small", [LB, "2", "--parallelism.fsdp_cpu_offload", "true"]),
    "muon_pp2_split_patterns": (2, "debug_small", [LB, "4", *PP2, *SPLIT]),
    "muon_ep2_qwen3_moe_pooled": (2, "qwen3_moe", [LB, "2", EP, "2", *POOLED]),
}
# A layout's reference runs with these args too (default: none).
REF_ARGS = {"muon_pp2_split_patterns": SPLIT, "muon_ep2_qwen3_moe_pooled": POOLED}
# name -> (world, layout resumed from its step-3 checkpoint, the new layout's args)
RESUMES: dict[str, tuple[int, str, list[str]]] = {
    "muon_resume_fsdp2": (2, "muon_fsdp2", LAYOUTS["muon_fsdp2"][2]),
    "muon_dcp_fsdp2_to_tp2": (2, "muon_fsdp2", LAYOUTS["muon_tp2"][2]),
}
REPORT: list[str] = []
# Qwen3 MoE debug: 8 softmax-routed experts top 2, no shared expert, one dense block first.
FLAVORS = {**MODELS, "qwen3_moe": ("qwen3", "debug_moe")}


def _ref_key(name: str) -> tuple[str, tuple[str, ...]]:
    return LAYOUTS[name][1], tuple(REF_ARGS.get(name, ()))


def _args(root, name: str, flavor: str, extra: list[str]) -> list[str]:
    return _common(root, name, flavor, FLAVORS) + MUON + extra


@pytest.fixture(scope="module")
def muon_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("muon_layouts")
    flavors = sorted({flavor for _, flavor, _ in LAYOUTS.values()})
    write_seed_checkpoints(root, flavors, FLAVORS)
    refs = {}
    for k, (flavor, ref_args) in enumerate(sorted({_ref_key(n) for n in LAYOUTS})):
        losses, trainer = run_in_process(_args(root, f"ref{k}_{flavor}", flavor, [LB, "4", *ref_args]))
        part = trainer.model_parts[0]
        refs[flavor, ref_args] = {"losses": losses,
                                  "params": {n: p.detach().clone() for n, p in part.named_parameters()},
                                  "grads": {n: p.grad.detach().clone() for n, p in part.named_parameters()}}
    results = {}
    for world in (2, 4):
        cases = [{"name": n, "args": _args(root, n, fl, extra)} for n, (w, fl, extra) in LAYOUTS.items()
                 if w == world]
        cases += [{"name": n, "args": _args(root, n, "debug_small", extra),
                   "copy": [str(root / "ck" / src / "step-3"), str(root / "ck" / n / "step-3")]}
                  for n, (w, src, extra) in RESUMES.items() if w == world]
        results.update(run_layout_cases(root, world, cases))
    yield refs, results
    print_report(REPORT)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_muon_layout_matches_one_rank(name, muon_runs):
    refs, results = muon_runs
    world = LAYOUTS[name][0]
    assert len(results[name]["losses"]) == STEPS
    compare_to_reference(name, world, results[name], refs[_ref_key(name)], REPORT)


@pytest.mark.timeout(900)
def test_muon_resume_is_bitwise_and_reshards(muon_runs):
    refs, results = muon_runs
    full, same = results["muon_fsdp2"], results["muon_resume_fsdp2"]
    assert same["losses"] == full["losses"][3:]
    for key in ("params", "grads"):
        assert set(same[key]) == set(full[key])
        for n, t in full[key].items():
            assert torch.equal(same[key][n], t), (key, n)
    got, ref = results["muon_dcp_fsdp2_to_tp2"], dict(refs["debug_small", ()])
    ref["losses"] = ref["losses"][3:]
    assert loss_rel(got["losses"], ref["losses"]) <= 1e-5
    assert max_rel(got["grads"], ref["grads"]) <= 1e-5
    assert norm_rel(got["params"], ref["params"]) <= 1e-5
