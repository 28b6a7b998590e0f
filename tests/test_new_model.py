"""A new model with a different attention (tests/qwen3_model.py: Qwen3's QK-norm) goes
through FSDP, TP and op-level AC with no edit to trainer/ or parallelisms/: its spec and
TP plan are all it brings, and every layout matches one process within 1e-5."""

from __future__ import annotations

import json

import pytest
import torch

from tests.helpers import run_in_process, torchrun

ARGS = ["--model.name", "tests.qwen3_model", "--model.flavor", "debug", "--training.seq_len", "64",
        "--training.steps", "3", "--metrics.enable_tensorboard", "false", "--lr_scheduler.warmup_steps", "1",
        "--training.max_norm", "0.3", "--metrics.log_freq", "1"]


def _clean(name: str) -> str:
    return name.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")


@pytest.mark.multirank
@pytest.mark.timeout(600)
def test_qwen3_qk_norm_under_fsdp_tp_and_op_ac_matches_one_process(tmp_path):
    losses, ref = run_in_process([*ARGS, "--training.local_batch_size", "4", "--job.dump_folder", str(tmp_path / "one")])
    ref_grads = {_clean(n): p.grad.clone() for n, p in ref.model_parts[0].named_parameters()}
    assert ref_grads["layers.0.attention.q_norm.weight"].abs().max() > 0  # the QK-norm is really in the graph

    cases = [
        {"name": "fsdp2_op", "args": [*ARGS, "--training.local_batch_size", "2", "--activation_checkpoint.mode", "op"]},
        {"name": "tp2_op", "args": [*ARGS, "--training.local_batch_size", "4", "--activation_checkpoint.mode", "op",
                                    "--parallelism.tensor_parallel_degree", "2"]},
        {"name": "tp2_nosp", "args": [*ARGS, "--training.local_batch_size", "4",
                                      "--parallelism.tensor_parallel_degree", "2",
                                      "--parallelism.enable_sequence_parallel", "false"]},
    ]
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    torchrun(2, [str(tmp_path / "cases.json"), str(tmp_path / "out")], module="tests.parallel_worker", timeout=500)
    for case in cases:
        rec = torch.load(tmp_path / "out" / f"{case['name']}.stage0.pt")
        for got, want in zip(rec["losses"], losses):
            assert abs(got - want) <= 1e-5 * abs(want), (case["name"], rec["losses"], losses)
        assert set(rec["grads"]) == set(ref_grads)
        for name, g in rec["grads"].items():
            scale = ref_grads[name].abs().max()
            assert (g - ref_grads[name]).abs().max() <= 1e-5 * scale, (case["name"], name)
