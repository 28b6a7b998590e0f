"""The MoE semantics table of docs/moe.md, one test per row (and the review's MoE fixes).

- The sequence balance loss averages over whole sequences of the global batch under
  every layout. Issue 19: under context parallelism each CP rank computed it from its
  own S / cp tokens' pick counts and scores, and FSDP summed the router gradients over
  dp_shard x cp, so the loss's gradient came out ~cp times too large. Now the counts are
  summed over CP (and TP under SP) by a plan-installed reduction
  (parallelisms/sequence_shards.py); DeepSeek debug with `--moe.aux_loss_coeff 0.01` at
  cp 2 (both methods) and cp 2 x tp 2 equals one rank within 1e-5 (losses of both steps,
  last-step gradients; before the fix the router's were 1.23 relative off). The other layouts (dp, tp with SP, pp, accumulation, ep)
  are tests/test_moe_balance.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.helpers import run_in_process, torchrun

TOL = 1e-5
COEFF = "0.01"


def ds_args(dump: Path, *extra: str, steps: int = 2) -> list[str]:
    """DeepSeek V3 debug, fp32, seq 64, global batch 2, the balance loss on, clipping off."""
    return ["--config", "deepseek_debug.toml", "--moe.aux_loss_coeff", COEFF, "--training.seq_len", "64",
            "--training.local_batch_size", "2", "--training.global_batch_size", "2", "--training.steps", str(steps),
            "--optimizer.lr", "1e-4", "--lr_scheduler.warmup_steps", "0", "--lr_scheduler.min_lr_factor", "1.0",
            "--training.max_norm", "0", "--metrics.log_freq", "1", "--metrics.enable_tensorboard", "false",
            "--job.dump_folder", str(dump), *extra]


def _cp(method: str) -> list[str]:
    return ["--parallelism.context_parallel_degree", "2", "--parallelism.context_parallel_method", method]


CP_LAYOUTS = {  # name -> (world size, extra args)
    "cp2_allgather": (2, _cp("allgather")),
    "cp2_alltoall": (2, _cp("alltoall")),
    "cp2_tp2_sp": (4, [*_cp("allgather"), "--parallelism.tensor_parallel_degree", "2"]),
}


def _rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    return (got.float() - ref.float()).abs().max().item() / max(ref.abs().max().item(), 1e-30)


def _launch(root: Path, world: int) -> dict[str, dict]:
    cases = [{"name": n, "args": ds_args(root / n, *extra)} for n, (w, extra) in CP_LAYOUTS.items() if w == world]
    (root / f"cases{world}.json").write_text(json.dumps(cases))
    out = root / f"out{world}"
    torchrun(world, [str(root / f"cases{world}.json"), str(out)], module="tests.parallel_worker", timeout=900)
    return {c["name"]: torch.load(out / f"{c['name']}.stage0.pt", weights_only=False) for c in cases}


@pytest.fixture(scope="module")
def cp_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_cp")
    losses, trainer = run_in_process(ds_args(root / "ref"))
    from tests.parallel_worker import gather_state

    _, grads = gather_state(trainer.model_parts, with_grads=True)
    ref = {"losses": losses, "grads": grads}
    return ref, {**_launch(root, 2), **_launch(root, 4)}


@pytest.mark.multirank
@pytest.mark.slow
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("name", list(CP_LAYOUTS))
def test_sequence_aux_loss_under_cp_equals_one_rank(name, cp_runs):
    ref, runs = cp_runs
    got = runs[name]
    loss = max(abs(a - b) / abs(b) for a, b in zip(got["losses"], ref["losses"]))
    assert len(got["losses"]) == len(ref["losses"]) == 2
    router = [k for k in ref["grads"] if k.endswith("router.gate.weight")]
    assert router and set(got["grads"]) == set(ref["grads"])
    grad = max(_rel(got["grads"][k], ref["grads"][k]) for k in ref["grads"])
    print(f"\n{name}: loss rel {loss:.2e}, grad rel {grad:.2e} (router: "
          f"{max(_rel(got['grads'][k], ref['grads'][k]) for k in router):.2e})")
    assert loss <= TOL, (got["losses"], ref["losses"])
    assert grad <= TOL


def _biases(trainer) -> list[torch.Tensor]:
    return [b.clone() for part in trainer.model_parts for n, b in part.named_buffers() if n.endswith("expert_bias")]


@pytest.mark.timeout(300)
def test_bias_update_counts_training_forwards_only(tmp_path):
    """Validation forwards do not feed the expert loads: the routing bias after 3 steps is
    the same with validation every step and without it (issue 19: it was not)."""
    toml = tmp_path / "ds_val.toml"
    toml.write_text((Path(__file__).parent.parent / "train_configs" / "deepseek_debug.toml").read_text()
                    + '\n[[validation.sources]]\ntype = "synthetic"\n')
    common = ["--moe.aux_loss_coeff", "0", "--training.steps", "3", "--validation.freq", "1",
              "--validation.steps", "2"]
    _, off = run_in_process(ds_args(tmp_path / "off", *common, "--config", str(toml)))
    _, on = run_in_process(ds_args(tmp_path / "on", *common, "--config", str(toml), "--validation.enable", "true"))
    assert on.validator is not None and off.validator is None
    before, after = _biases(off), _biases(on)
    assert len(before) == 5 and any(b.abs().sum() > 0 for b in before)  # the bias moved
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    assert all(m.training for part in on.model_parts for m in part.modules())  # train mode after validation
