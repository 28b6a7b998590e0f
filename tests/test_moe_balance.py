"""The sequence-wise balance loss and the routing bias, driven from the config.

Issue 12, bug 3: the balance loss reaches the router through `AddAuxLoss`, which gave
each forward call a gradient of 1, so its gradient was multiplied by the gradient
accumulation steps, the pipeline microbatches and the data-parallel ranks (and by TP
under sequence parallel, where each rank routed its own sequence shard). Now each forward
contributes its sequences' share of one mean over the global batch, and under sequence
parallel the pick counts are summed over TP so the loss is that of whole sequences.

Checked here: with a large `--moe.aux_loss_coeff`, one optimizer step's gradients (of
every parameter, the router's included) are the same for one batch of 4, 2 x 2 and 4 x 1
accumulation steps, FSDP 2, TP 2 with sequence parallel, PP 2 (4 microbatches) and EP 2,
and the balance loss's own contribution (gradients at coefficient c minus at 0) is large
and equal everywhere. All runs load the same HF folder (`--model.hf_path`), so they start
from the same weights. On the code before the fix the accumulation runs already differ
by 2x and 4x in that contribution.
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.helpers import run_in_process, torchrun

SEQ = 32
COEFF = "2.0"
TOL = 1e-5


@pytest.fixture(scope="module")
def ds_folder(tmp_path_factory):
    import transformers  # noqa: F401  (the dev extra installs it: missing, this fails, not skips)
    from tests.hf_builders import build_hf_deepseek

    return build_hf_deepseek(tmp_path_factory.mktemp("moe_balance") / "ds", vocab=2048, tokenizer=True)


def _args(folder, dump, local: int, coeff: str = COEFF, extra=()) -> list[str]:
    return ["--config", "llama_debug.toml", "--model.hf_path", str(folder), "--moe.aux_loss_coeff", coeff,
            "--training.seq_len", str(SEQ), "--training.local_batch_size", str(local),
            "--training.global_batch_size", "4", "--training.steps", "1", "--training.max_norm", "0",
            "--optimizer.lr", "0", "--lr_scheduler.warmup_steps", "1", "--metrics.enable_tensorboard", "false",
            "--job.dump_folder", str(dump), *extra]


def _grads(trainer) -> dict[str, torch.Tensor]:
    from tests.parallel_worker import clean_name, full

    return {clean_name(n): full(p.grad) for part in trainer.model_parts for n, p in part.named_parameters()}


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def layout_grads(layouts: dict[str, list[str]], tmp_path) -> dict[str, dict[str, torch.Tensor]]:
    """Runs one step of every layout (name -> CLI args) in one 2-rank torchrun launch
    (tests/parallel_worker.py); returns each layout's full gradients by parameter name."""
    cases = [{"name": name, "args": args} for name, args in layouts.items()]
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    torchrun(2, [str(tmp_path / "cases.json"), str(tmp_path / "out")], module="tests.parallel_worker", timeout=580)
    out = {}
    for name in layouts:
        out[name] = {}
        for stage in sorted((tmp_path / "out").glob(f"{name}.stage*.pt")):
            out[name].update(torch.load(stage, weights_only=False)["grads"])
    return out


def _router_keys(grads: dict) -> list[str]:
    return [k for k in grads if k.endswith("router.gate.weight")]


@pytest.mark.timeout(300)
def test_aux_loss_gradient_does_not_depend_on_accumulation(ds_folder, tmp_path):
    runs = {}
    for coeff in ("0", COEFF):
        for local in (4, 2, 1):
            _, trainer = run_in_process(_args(ds_folder, tmp_path / f"{coeff}_{local}", local, coeff))
            runs[coeff, local] = _grads(trainer)
    contribution = {local: {k: runs[COEFF, local][k] - runs["0", local][k] for k in runs["0", local]}
                    for local in (4, 2, 1)}
    ref = contribution[4]
    size = max(ref[k].abs().max().item() for k in _router_keys(ref))
    print(f"\naux-loss contribution to the router gradient: max {size:.3g}; accumulation 2 / 4 differ by "
          f"{_max_diff(contribution[2], ref):.2g} / {_max_diff(contribution[1], ref):.2g}")
    assert size > 1e-3  # the balance loss matters at this coefficient
    for local in (2, 1):
        assert _max_diff(runs[COEFF, local], runs[COEFF, 4]) < TOL, local
        assert _max_diff(contribution[local], ref) < TOL, local


LAYOUTS = {
    "fsdp2": (2, ["--parallelism.data_parallel_shard_degree", "2"]),
    "tp2_sp": (4, ["--parallelism.tensor_parallel_degree", "2", "--parallelism.enable_sequence_parallel", "true"]),
    "pp2": (4, ["--parallelism.pipeline_parallel_degree", "2"]),
    "ep2": (2, ["--parallelism.expert_parallel_degree", "2"]),
}


@pytest.mark.multirank
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_aux_loss_gradient_is_layout_invariant(ds_folder, tmp_path):
    """1 rank vs FSDP 2, TP 2 (sequence parallel), PP 2 and EP 2, one torchrun launch."""
    _, trainer = run_in_process(_args(ds_folder, tmp_path / "ref", 4))
    ref = _grads(trainer)
    layouts = {name: _args(ds_folder, tmp_path / name, local, extra=extra) for name, (local, extra) in LAYOUTS.items()}
    for name, grads in layout_grads(layouts, tmp_path).items():
        diff = _max_diff(grads, ref)
        print(f"{name}: max |grad - 1 rank| {diff:.2g}")
        assert diff < TOL, name


@pytest.mark.timeout(120)
def test_bias_update_rate_zero_freezes_routing(ds_folder, tmp_path):
    """--moe.bias_update_rate 0: the routing bias does not move; the default moves it."""
    frozen = _args(ds_folder, tmp_path / "frozen", 4, coeff="0", extra=["--moe.bias_update_rate", "0"])
    _, trainer = run_in_process(frozen)
    biases = [b for n, b in trainer.model_parts[0].named_buffers() if n.endswith("expert_bias")]
    from trainer.hf_io import HFReader

    src = HFReader(ds_folder)
    stored = [src.full(k) for k in sorted(src.keys()) if k.endswith("e_score_correction_bias")]
    assert len(biases) == len(stored) > 0 and all(torch.equal(b, s) for b, s in zip(biases, stored))
    _, trainer = run_in_process(_args(ds_folder, tmp_path / "moving", 4, coeff="0"))
    moved = [b for n, b in trainer.model_parts[0].named_buffers() if n.endswith("expert_bias")]
    assert any(not torch.equal(b, s) for b, s in zip(moved, stored))
