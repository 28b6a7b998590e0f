"""The collectives of a tensor-parallel step (2 gloo ranks, one launch, every case).

- The gathered input of attention and of the MLP stays a DTensor, so the backward of the
  projections that read it is one reduce-scatter per gather, not an all-reduce per projection
  (parallelisms/tensor_parallel.py::module_input_style).
- Replicated weights on sequence-sharded input (the norms under SP) end the step with their
  parameters' placements, settled once by one all-reduce (parallelisms/grad_reduce.py), so
  the clipping and the optimizer issue no collective per weight.
Both show as all-reduces that do not grow with depth: 3 and 6 Llama layers issue the same
number, and each layer adds exactly its 2 gathers and 2 reduce-scatters, forward and backward.
Before these two changes every layer added 13 all-reduces. Numerics are covered by the
layout parity tests (tests/test_parallel_layouts.py, tests/test_new_model.py)."""

from __future__ import annotations

import json

import pytest

from tests.helpers import torchrun

COMMON = ["--data.type", "synthetic", "--training.seq_len", "32", "--training.local_batch_size", "2",
          "--metrics.enable_tensorboard", "false", "--checkpoint.enable", "false", "--validation.enable", "false",
          "--parallelism.tensor_parallel_degree", "2"]
CASES = {
    "llama3_3_layers": ["--config", "llama_debug.toml", "--model.flavor", "debug_small"],
    "llama3_6_layers": ["--config", "llama_debug.toml", "--model.flavor", "debug"],
    "deepseek_v3": ["--config", "deepseek_debug.toml"],
    "qwen3_moe": ["--config", "qwen3_moe_debug.toml"],
}


@pytest.fixture(scope="module")
def tp_steps(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tp_comm")
    cases = [{"name": name, "args": [*args, *COMMON, "--job.dump_folder", str(tmp / name)]} for name, args in CASES.items()]
    (tmp / "cases.json").write_text(json.dumps(cases))
    torchrun(2, [str(tmp / "cases.json"), str(tmp / "out")], module="tests.tp_comm_worker", timeout=600)
    return {name: json.loads((tmp / "out" / f"{name}.json").read_text()) for name in CASES}


@pytest.mark.multirank
@pytest.mark.timeout(700)
def test_only_gathers_and_reduce_scatters_grow_with_depth(tp_steps):
    short, deep = tp_steps["llama3_3_layers"]["counts"], tp_steps["llama3_6_layers"]["counts"]
    extra_layers = 3
    assert deep["all_gather_into_tensor"] - short["all_gather_into_tensor"] == 4 * extra_layers, (short, deep)
    assert deep["reduce_scatter_tensor"] - short["reduce_scatter_tensor"] == 4 * extra_layers, (short, deep)
    assert deep.get("all_reduce", 0) == short.get("all_reduce", 0), (short, deep)
    assert deep.get("allreduce_", 0) == short.get("allreduce_", 0), (short, deep)


@pytest.mark.multirank
@pytest.mark.timeout(700)
def test_every_gradient_ends_the_step_with_its_parameters_placements(tp_steps):
    assert {name: step["unsettled"] for name, step in tp_steps.items()} == {name: [] for name in CASES}
