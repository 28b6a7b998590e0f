"""torch.compile under every parallelism: compiled equals eager within 1e-5 (losses,
last-step grads, post-step params) under TP 2, PP 2, FSDP 2 x TP 2, EP 2 (with and
without op-level AC), and the graph breaks dynamo reports for woven MoE blocks. Also
chunked CE under EP 2 x FSDP (the layout of train_configs/deepseek_v3_16b.toml, which
turns it on) equals plain CE.

Each layout runs as-is and with the variant (compile, or chunked CE) as two cases of the
same torchrun launch (same process group, same thread count, same seed), so any
difference is the variant's. The
multi-rank cases use backend=aot_eager: dynamo and AOT autograd trace the DTensor, PP
and EP graphs exactly as with inductor, without inductor's C++ codegen (minutes per
block shape per rank on 2 shared cores); one TP 2 case runs inductor itself.
tests/test_ac_compile.py covers inductor with AC on one rank.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import tests.ep_worker  # noqa: F401  (registers the `ep_test` flavor for the in-process run)
from tests.helpers import run_in_process, torchrun
from tests.test_parallel_layouts import _load, loss_rel, max_rel

pytestmark = [pytest.mark.multirank, pytest.mark.slow]

TOL = 1e-5
COMMON = ["--training.seq_len", "64", "--training.global_batch_size", "4", "--training.steps", "2",
          "--training.mixed_precision_param", "float32", "--optimizer.lr", "1e-3", "--optimizer.eps", "1e-4",
          "--lr_scheduler.warmup_steps", "0", "--training.max_norm", "0.3", "--metrics.log_freq", "1",
          "--metrics.enable_tensorboard", "false", "--data.type", "synthetic"]
LLAMA = ["--model.flavor", "debug_small", *COMMON]
DEEPSEEK = ["--model.name", "deepseek_v3", "--model.flavor", "ep_test", *COMMON]
AOT = ["--compile.enable", "true", "--compile.backend", "aot_eager"]
INDUCTOR = ["--compile.enable", "true"]
LB = "--training.local_batch_size"
TP2 = ["--parallelism.tensor_parallel_degree", "2"]
PP2 = ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_microbatch_size", "1",
       "--parallelism.pipeline_parallel_schedule", "1F1B"]
EP2 = ["--parallelism.expert_parallel_degree", "2"]
OP = ["--activation_checkpoint.mode", "op"]

# layout -> (world, worker module, model args, layout args, variant args)
LAYOUTS = {
    "tp2": (2, "tests.parallel_worker", LLAMA, [LB, "4", *TP2], AOT),
    "tp2_inductor": (2, "tests.parallel_worker", LLAMA, [LB, "4", *TP2], INDUCTOR),
    "pp2": (2, "tests.parallel_worker", LLAMA, [LB, "4", *PP2], AOT),
    "ep2": (2, "tests.ep_worker", DEEPSEEK, [LB, "2", *EP2], AOT),
    "ep2_ac_op": (2, "tests.ep_worker", DEEPSEEK, [LB, "2", *EP2, *OP], AOT),
    "fsdp2_tp2": (4, "tests.parallel_worker", LLAMA, [LB, "2", *TP2], AOT),
    "ep2_chunked_ce": (2, "tests.ep_worker", DEEPSEEK, [LB, "2", *EP2, *OP], ["--loss.chunked_ce", "true",
                                                                             "--loss.ce_chunk_size", "48"]),
}


def _launch(root: Path, world: int, module: str) -> dict:
    cases = []
    for name, (w, mod, model, layout, compiled) in LAYOUTS.items():
        if w == world and mod == module:
            for kind, extra in (("base", []), ("variant", compiled)):
                cases.append({"name": f"{name}.{kind}", "args": [*model, *layout, *extra,
                                                                 "--job.dump_folder", str(root / name / kind)]})
    path = root / f"cases_{world}_{module}.json"
    path.write_text(json.dumps(cases))
    torchrun(world, [str(path), str(root / "out")], timeout=900, module=module)
    return {c["name"]: _load(root / "out", c["name"]) for c in cases}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("compile_layouts")
    out: dict = {}
    for world, module in sorted({(w, m) for w, m, *_ in LAYOUTS.values()}):
        out.update(_launch(root, world, module))
    return out


@pytest.mark.timeout(1800)
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_variant_equals_base(name, results):
    eager, compiled = results[f"{name}.base"], results[f"{name}.variant"]
    dl = loss_rel(compiled["losses"], eager["losses"])
    dg = max_rel(compiled["grads"], eager["grads"])
    dp = max_rel(compiled["params"], eager["params"])
    print(f"{name}: loss {dl:.1e} grad {dg:.1e} param {dp:.1e}")
    assert dl <= TOL and dg <= TOL and dp <= TOL, (name, dl, dg, dp)


@pytest.mark.timeout(600)
def test_woven_moe_blocks_report_one_graph_break(tmp_path):
    """fp32 MoE blocks are woven (their experts loop over data-dependent splits): dynamo
    reports one graph break, the disabled `MoE.run_experts`, shared by every MoE layer (they
    trace the same frame); the dense block compiles whole, with none."""
    import torch
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    eager, _ = run_in_process([*DEEPSEEK, LB, "2", "--job.dump_folder", str(tmp_path / "eager")])
    compiled, trainer = run_in_process([*DEEPSEEK, LB, "2", *AOT, "--job.dump_folder", str(tmp_path / "compiled")])
    assert loss_rel(compiled, eager) <= TOL
    breaks = counters["graph_break"]
    print("graph breaks:", dict(breaks), "unique graphs:", counters["stats"]["unique_graphs"])
    assert sum(breaks.values()) == 1 and "MoE.run_experts" in next(iter(breaks))
    layers = trainer.model_parts[0].layers
    dense, moe = layers["0"], layers["1"]
    assert dense._compiled_call_impl is not None  # whole block
    assert moe._compiled_call_impl is None and moe.moe._compiled_call_impl is not None
    assert moe.attention._compiled_call_impl is not None
    assert moe.moe.experts.compiled_grouped_mm is not None
    torch._dynamo.reset()


@pytest.mark.timeout(600)
def test_bf16_moe_block_compiles_whole(tmp_path):
    """In bf16 without EP (what one GPU runs), a MoE block is one graph, fullgraph, with its
    grouped GEMMs inside (the experts cast autocast's fp32 input to bf16): no graph break."""
    import torch
    from torch._dynamo.utils import counters

    bf16 = ["--training.mixed_precision_on_cpu", "true", "--training.mixed_precision_param", "bfloat16"]
    torch._dynamo.reset()
    counters.clear()
    eager, _ = run_in_process([*DEEPSEEK, LB, "2", *bf16, "--job.dump_folder", str(tmp_path / "eager")])
    compiled, trainer = run_in_process([*DEEPSEEK, LB, "2", *bf16, *AOT, "--job.dump_folder",
                                        str(tmp_path / "compiled")])
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    assert all(b._compiled_call_impl is not None for b in trainer.model_parts[0].layers.values())
    assert loss_rel(compiled, eager) <= 1e-2, (compiled, eager)  # bf16: decompositions round differently
    torch._dynamo.reset()
