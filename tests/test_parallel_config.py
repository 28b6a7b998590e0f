"""Layout validation (one-line errors at start-up), the pipeline split, and the big configs' dry runs."""

from __future__ import annotations

import pytest
import torch

from trainer.config import load_config
from configuration.fields import ConfigError

SMALL = ["--model.flavor", "debug_small", "--training.seq_len", "64", "--training.local_batch_size", "4"]


def _err(args: list[str]) -> str:
    with pytest.raises(ConfigError) as e:
        load_config(args)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("config error: "), msg
    return msg


@pytest.mark.parametrize("args, expect", [
    # TP must divide heads and KV heads (debug_small: 4 heads, 2 KV heads; debug: 16 heads)
    (["--parallelism.tensor_parallel_degree", "3"], "3 does not divide the model's 4 heads"),
    (["--parallelism.tensor_parallel_degree", "4"], "4 does not divide the model's 2 KV heads"),
    # SP shards the sequence over TP
    (["--parallelism.tensor_parallel_degree", "2", "--training.seq_len", "63"],
     "seq_len: 63 is not divisible by tensor_parallel_degree 2"),
    # PP: stages vs layers (3), schedule vs stages per rank, microbatches vs schedule
    (["--parallelism.pipeline_parallel_degree", "4"], "4 stages exceed the model's 3 layers"),
    (["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule", "Interleaved1F1B",
      "--parallelism.pipeline_parallel_stages_per_rank", "2"], "= 4 stages exceed the model's 3 layers"),
    (["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule", "1F1B",
      "--parallelism.pipeline_parallel_stages_per_rank", "2"], "1F1B runs one stage per rank"),
    (["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule", "ZBVZeroBubble"],
     "ZBVZeroBubble needs exactly 2 stages per rank"),
    (["--parallelism.pipeline_parallel_degree", "3", "--parallelism.pipeline_parallel_schedule", "1F1B",
      "--training.local_batch_size", "2"], "= 2 microbatches, but 1F1B with 3 stages on 3 ranks needs at least 3"),
    (["--model.flavor", "debug", "--parallelism.pipeline_parallel_degree", "2",
      "--parallelism.pipeline_parallel_schedule", "DualPipeV", "--parallelism.pipeline_parallel_stages_per_rank", "2",
      "--training.local_batch_size", "3"], "= 3 microbatches, but DualPipeV with 4 stages on 2 ranks needs at least 4"),
    (["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_microbatch_size", "3"],
     "local_batch_size: 4 is not a multiple of pipeline_parallel_microbatch_size 3"),
    (["--parallelism.pipeline_parallel_degree", "2", "--parallelism.module_fqns_per_model_part",
      "tok_embeddings,layers.0;layers.1;layers.2,norm,output"], "3 stages listed, but"),
    (["--parallelism.context_parallel_degree", "3"], "seq_len: 64 is not divisible by 2 x context_parallel_degree = 6"),
    (["--parallelism.context_parallel_degree", "4", "--parallelism.context_parallel_method", "alltoall",
      "--parallelism.tensor_parallel_degree", "2"], "alltoall splits the 2 local attention heads (after TP 2)"),
])
def test_impossible_layout_is_one_line_at_config_time(args, expect):
    assert expect in _err(SMALL + args)


def test_world_size_product_and_fix():
    from parallelisms.parallel_dims import ParallelDims

    with pytest.raises(ConfigError, match=r"dp_replicate\(2\) x dp_shard\(2\) x cp\(1\) x tp\(2\) x pp\(2\) = 16, "
                                          r"but the world size is 8; make the product 8"):
        ParallelDims(dp_replicate=2, dp_shard=2, tp=2, pp=2, world_size=8)
    dims = ParallelDims(dp_replicate=2, tp=2, pp=2, world_size=16)
    assert (dims.dp_shard, dims.dp_degree, dims.non_data_parallel_size) == (2, 4, 4)
    with pytest.raises(ConfigError, match="expert_parallel_degree: 3 must divide dp_shard"):
        ParallelDims(tp=2, ep=3, world_size=8)


def test_valid_layouts_pass():
    load_config(SMALL + ["--parallelism.tensor_parallel_degree", "2", "--parallelism.pipeline_parallel_degree", "2",
                         "--parallelism.pipeline_parallel_schedule", "1F1B"])
    load_config(SMALL + ["--model.flavor", "debug", "--parallelism.pipeline_parallel_degree", "2",
                         "--parallelism.pipeline_parallel_schedule", "DualPipeV",
                         "--parallelism.pipeline_parallel_stages_per_rank", "2"])


def _meta_model(n_layers: int):
    import dataclasses

    from models.llama3 import LLAMA3_FLAVORS, Llama3

    with torch.device("meta"):
        return Llama3(dataclasses.replace(LLAMA3_FLAVORS["debug_small"], n_layers=n_layers))


@pytest.mark.parametrize("n_layers, stages, blocks", [
    (3, 2, [1, 2]), (6, 4, [1, 2, 2, 1]), (6, 6, [1] * 6), (126, 16, [7] + [8] * 14 + [7]), (4, 4, [1] * 4)])
def test_split_balances_blocks_and_weights_the_ends(n_layers, stages, blocks):
    from parallelisms.pipeline import check_split, split_stages

    model = _meta_model(n_layers)
    split = split_stages(model, stages)
    check_split(model, split)
    assert [sum(n.startswith("layers.") for n in s) for s in split] == blocks
    assert split[0][0] == "tok_embeddings" and split[-1][-2:] == ["norm", "output"]


def test_stage_keeps_full_model_names():
    from parallelisms.pipeline import prune_to_stage, stage_ids_for_rank

    full = set(_meta_model(4).state_dict())
    first = prune_to_stage(_meta_model(4), ["tok_embeddings", "layers.0", "layers.1"])
    last = prune_to_stage(_meta_model(4), ["layers.2", "layers.3", "norm", "output"])
    assert first.norm is None and first.output is None and last.tok_embeddings is None
    assert set(first.state_dict()) | set(last.state_dict()) == full
    assert not set(first.state_dict()) & set(last.state_dict())
    assert stage_ids_for_rank(0, 2, 2, v_style=True) == [0, 3] and stage_ids_for_rank(1, 2, 2, v_style=True) == [1, 2]
    assert stage_ids_for_rank(1, 4, 2, v_style=False) == [1, 5]


def test_bad_split_override_is_rejected():
    from parallelisms.pipeline import check_split

    model = _meta_model(3)
    with pytest.raises(ConfigError, match="every module must be in exactly one stage"):
        check_split(model, [["tok_embeddings", "layers.0"], ["layers.2", "norm", "output"]])
    with pytest.raises(ConfigError, match="unknown module"):
        check_split(model, [["tok_embeddings", "layers.0", "layers.1"], ["layers.9", "layers.2", "norm", "output"]])
    with pytest.raises(ConfigError, match="model order"):
        check_split(model, [["tok_embeddings", "layers.1"], ["layers.0", "layers.2", "norm", "output"]])


@pytest.mark.parametrize("config", ["llama70b.toml", "llama405b.toml", "llama_debug_3d.toml", "qwen3_8b.toml",
                                    "qwen3_30b_a3b.toml"])
def test_big_layouts_pass_dry_run(config, capsys):
    from trainer.config import print_model_summary

    cfg = load_config(["--config", config, "--job.dry_run"])  # layout validation runs here
    summary = print_model_summary(cfg)
    assert summary["params"] > 0 and "parameters:" in capsys.readouterr().out
