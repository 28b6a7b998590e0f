"""Config precedence, validation errors and --help."""

import json
import tomllib
import subprocess
import sys
from pathlib import Path

import pytest

from trainer.config import CONFIG_DIR, SECTIONS, help_text, load_config
from configuration.fields import ConfigError, field_docs

REPO = Path(__file__).resolve().parent.parent


def test_precedence_defaults_toml_cli(tmp_path):
    toml = tmp_path / "c.toml"
    toml.write_text('[training]\nsteps = 7\nseq_len = 128\n[optimizer]\nlr = 0.5\n')
    cfg = load_config(["--config", str(toml), "--training.steps", "9"])
    assert cfg.training.steps == 9          # CLI beats TOML
    assert cfg.training.seq_len == 128      # TOML beats default
    assert cfg.optimizer.lr == 0.5
    assert cfg.training.local_batch_size == 8  # default survives
    cfg = load_config(["--config", str(toml), "--training.steps=11", "--checkpoint.enable"])
    assert cfg.training.steps == 11 and cfg.checkpoint.enable is True


def test_every_required_key_is_overridable():
    keys = ["job.dump_folder", "model.name", "model.flavor", "training.steps", "training.seq_len",
            "training.local_batch_size", "training.global_batch_size", "training.max_norm", "training.seed",
            "optimizer.lr", "lr_scheduler.warmup_steps", "checkpoint.enable", "checkpoint.folder",
            "checkpoint.interval", "checkpoint.keep_latest_k", "metrics.log_freq", "metrics.enable_tensorboard",
            "compile.enable", "profiling.enable_profiling", "profiling.profile_freq", "activation_checkpoint.mode",
            "parallelism.data_parallel_shard_degree"]
    values = {"job.dump_folder": "x", "model.name": "llama3", "model.flavor": "8B", "checkpoint.folder": "ck",
              "activation_checkpoint.mode": "full"}
    for key in keys:
        section, name = key.split(".")
        value = values.get(key)
        if value is None:
            current = getattr(getattr(load_config([]), section), name)
            value = {bool: "true", int: "3", float: "0.5"}[type(current)]
        cfg = load_config([f"--{key}", value])
        assert str(getattr(getattr(cfg, section), name)).lower() in (value.lower(), str(float(value)) if
                                                                     value.replace(".", "").isdigit() else value)


@pytest.mark.parametrize("argv, fragment", [
    (["--training.stpes", "3"], "unknown key training.stpes (did you mean training.steps?)"),
    (["--trainig.steps", "3"], "did you mean --training.steps?"),
    (["--training.steps", "abc"], "training.steps: expected int, got 'abc'"),
    (["--training.steps", "0"], "training.steps: 0 is below the minimum 1"),
    (["--optimizer.lr", "fast"], "optimizer.lr: expected float"),
    (["--checkpoint.enable", "maybe"], "checkpoint.enable: expected bool"),
    (["--activation_checkpoint.mode", "opp"], "did you mean 'op'?"),
    (["--model.flavor", "8b"], "model.flavor: unknown value '8b'"),
    (["--model.name", "lama3"], "did you mean 'llama3'?"),
    (["--config", "llama9b.toml"], "not found"),
    (["--training.dataset", "files"], "training.dataset moved to data.type"),
    (["--training.dataset_path", "x"], "training.dataset_path moved to data.path"),
    (["--data.type", "c4"], "data.type: 'c4' is not one of"),
    (["--data.type", "files"], "data.path: a files source needs a path"),
    (["--data.document_masking", "--parallelism.context_parallel_degree", "2"], "data.document_masking: not supported"),
    (["--training.seq_len", "99999999"], "training.seq_len"),
    (["positional"], "unexpected argument"),
])
def test_errors_are_one_line_and_name_the_key(argv, fragment):
    with pytest.raises(ConfigError) as e:
        load_config(argv)
    assert fragment in str(e.value)
    assert "\n" not in str(e.value)


def test_toml_errors(tmp_path):
    bad_section = tmp_path / "a.toml"
    bad_section.write_text("[trainig]\nsteps = 3\n")
    with pytest.raises(ConfigError, match=r"unknown section \[trainig\].*did you mean \[training\]"):
        load_config(["--config", str(bad_section)])
    bad_type = tmp_path / "b.toml"
    bad_type.write_text('[training]\nsteps = "ten"\n')
    with pytest.raises(ConfigError, match="training.steps: expected int, got 'ten'"):
        load_config(["--config", str(bad_type)])


def test_every_shipped_config_loads_by_name(tmp_path):
    names = sorted(p.name for p in CONFIG_DIR.glob("*.toml"))
    assert {"llama_debug.toml", "llama8b.toml", "llama70b.toml", "llama405b.toml"} <= set(names)
    # Configs that start from an HF folder (model.hf_path) read its config.json: stand in a copy
    # of Llama-3.1-8B's (only config.json is read when the config loads).
    from models.llama3 import LLAMA3_FLAVORS
    from models.llama3.state_dict_adapter import Llama3StateDictAdapter

    (tmp_path / "config.json").write_text(json.dumps(Llama3StateDictAdapter(LLAMA3_FLAVORS["8B"]).hf_config()))
    for name in names:
        table = tomllib.loads((CONFIG_DIR / name).read_text())
        hf = ["--model.hf_path", str(tmp_path)] if "hf_path" in table.get("model", {}) else []
        cfg = load_config(["--config", name, *hf])
        assert cfg.job.config_file.endswith(name)


def test_help_lists_every_field_with_its_doc():
    text = help_text()
    for section, cls in SECTIONS.items():
        for name, _, _, doc in field_docs(cls):
            assert f"--{section}.{name} " in text
            assert doc.split(".")[0] in text


def test_cli_error_exits_2_with_one_line_and_no_traceback():
    proc = subprocess.run([sys.executable, "-m", "trainer.train", "--training.stpes", "3"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines == ["config error: unknown key training.stpes (did you mean training.steps?)"]
    assert "Traceback" not in proc.stdout + proc.stderr


def test_impossible_layouts_are_rejected():
    from parallelisms.parallel_dims import ParallelDims, check_model_layout
    from models.llama3 import LLAMA3_FLAVORS

    with pytest.raises(ConfigError, match=r"= 6, but the world size is 4"):
        ParallelDims(dp_shard=3, tp=2, world_size=4)
    with pytest.raises(ConfigError, match="does not divide the world size"):
        ParallelDims(tp=3, world_size=4)
    dims = ParallelDims(tp=3, dp_shard=1, world_size=3)
    with pytest.raises(ConfigError, match="does not divide the model's 16 heads"):
        check_model_layout(LLAMA3_FLAVORS["debug"], tp=dims.tp, pp=dims.pp, seq_len=256, sequence_parallel=True)
    dims = ParallelDims(tp=2, dp_shard=1, world_size=2)
    with pytest.raises(ConfigError, match="seq_len: 255 is not divisible"):
        check_model_layout(LLAMA3_FLAVORS["debug"], tp=dims.tp, pp=dims.pp, seq_len=255, sequence_parallel=True)
    dims = ParallelDims(pp=4, dp_shard=1, world_size=4)
    with pytest.raises(ConfigError, match="4 stages exceed the model's 3 layers"):
        check_model_layout(LLAMA3_FLAVORS["debug_small"], tp=dims.tp, pp=dims.pp, seq_len=64, sequence_parallel=False)


@pytest.mark.parametrize("env, argv, line", [
    ({}, ["--training.stpes", "3"], "config error: unknown key training.stpes (did you mean training.steps?)"),
    ({"NGPU": "4"}, ["--parallelism.tensor_parallel_degree", "8"],
     "config error: parallelism: dp_replicate(1) x cp(1) x tp(8) x pp(1) = 8 does not divide the world size 4; "
     "choose degrees whose product divides it"),
])
def test_run_train_sh_fails_fast_with_one_line(env, argv, line):
    import os

    proc = subprocess.run(["./run_train.sh", *argv], cwd=REPO, env={**os.environ, **env}, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2
    assert [ln for ln in proc.stderr.splitlines() if ln.strip()] == [line]
    assert "Traceback" not in proc.stdout + proc.stderr and "ChildFailedError" not in proc.stdout + proc.stderr


@pytest.mark.parametrize("argv, fragment", [
    (["--optimizer.lr", "nan"], "optimizer.lr: nan is not a finite number"),
    (["--optimizer.beta1", "-inf"], "optimizer.beta1: -inf is not a finite number"),
    (["--training.max_norm", "1e999"], "training.max_norm: inf is not a finite number"),
    (["--checkpoint.load_step", "2"], "checkpoint.load_step needs checkpoint.enable = true"),
    (["--checkpoint.initial_load_in_hf", "true"], "checkpoint.initial_load_in_hf needs checkpoint.initial_load_path"),
    (["--compile.backend", "inductr"], "compile.backend: unknown torch.compile backend 'inductr' (did you mean"),
    (["--data.path", "corpus.jsonl"], "data.path: read only by data.type files, tokens, stream, but data.type is "
                                      "builtin"),
    (["--training.loss_spike_factor", "3", "--training.max_skipped_steps", "0"],
     "training.loss_spike_factor: 3 is read only by the guard"),
    (["--training.loss_spike_factor", "0.5"], "training.loss_spike_factor: 0.5 must exceed 1"),
])
def test_non_finite_floats_preconditions_and_backends_are_refused(argv, fragment):
    """Before: nan passed every range check (nan < min is False) and the others were ignored."""
    with pytest.raises(ConfigError) as e:
        load_config(argv)
    assert fragment in str(e.value) and "\n" not in str(e.value)


def test_options_that_the_layout_or_the_command_line_would_ignore():
    """fsdp_cpu_offload and the float8 all-gather without FSDP, float8 expert GEMMs without
    experts, were ignored; a command-line data.type
    replaces the file's source instead of tripping over its data.path."""
    with pytest.raises(ConfigError, match="parallelism.fsdp_cpu_offload: needs FSDP, but the layout on 1 rank"):
        load_config(["--parallelism.fsdp_cpu_offload", "true"], world_size=1)
    assert load_config(["--parallelism.fsdp_cpu_offload", "true"], world_size=2).parallelism.fsdp_cpu_offload
    float8 = ["--float8.enable", "true", "--float8.enable_fsdp_float8_all_gather", "true"]
    with pytest.raises(ConfigError, match="float8.enable_fsdp_float8_all_gather: needs FSDP"):
        load_config(float8, world_size=1)
    assert load_config(float8, world_size=2).float8.enable_fsdp_float8_all_gather
    with pytest.raises(ConfigError, match="float8.moe_grouped_gemm: the model has no routed experts"):
        load_config(["--float8.enable", "true", "--float8.moe_grouped_gemm", "true"])
    with pytest.raises(ConfigError, match="float8.moe_grouped_gemm: the model has no routed experts"):  # dense Qwen3
        load_config(["--model.name", "qwen3", "--float8.enable", "true", "--float8.moe_grouped_gemm", "true"])
    assert load_config(["--config", "llama8b.toml"]).data.path == "data/tokens"
    assert load_config(["--config", "llama8b.toml", "--data.type", "synthetic"]).data.path is None
    assert load_config(["--config", "llama8b.toml", "--data.type", "stream"]).data.path == "data/tokens"


def test_nan_in_toml_is_refused(tmp_path):
    toml = tmp_path / "c.toml"
    toml.write_text("[optimizer]\nlr = nan\n[training]\nmax_norm = inf\n")
    with pytest.raises(ConfigError, match="optimizer.lr: nan is not a finite number"):
        load_config(["--config", str(toml)])


@pytest.mark.parametrize("name, world", [("deepseek_v3_671b.toml", 512), ("llama405b.toml", 64),
                                         ("llama70b.toml", 8), ("deepseek_v3_16b.toml", 8), ("llama8b.toml", 1),
                                         ("llama_debug_3d.toml", 4), ("qwen3_8b.toml", 1), ("qwen3_30b_a3b.toml", 8)])
def test_dry_run_checks_the_world_size_the_config_implies(name, world):
    """Before: the pre-launch check validated these against the local process count (1) and failed."""
    from trainer.layout import implied_world_size, layout_for

    cfg = load_config(["--config", name])
    assert implied_world_size(cfg.parallelism) == world
    layout_for(cfg, world)  # the layout fits the world it implies


def test_dry_run_of_a_512_rank_config_prints_its_layout():
    proc = subprocess.run(["./run_train.sh", "--config", "deepseek_v3_671b.toml", "--dry-run"], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "layout: world size 512 (implied by the config" in proc.stdout
    assert "pp 8 x dp_replicate 1 x dp_shard 64" in proc.stdout


def test_tp_degree_for_a_model_without_a_tp_plan_is_refused_at_load():
    import dataclasses

    from models import get_model_spec
    from parallelisms.parallel_dims import check_layout
    from trainer.config import load_config

    cfg = load_config(["--parallelism.tensor_parallel_degree", "2"])
    no_plan = dataclasses.replace(get_model_spec("llama3"), tensor_parallel_fn=None)
    check_layout(cfg.parallelism, cfg.model_args, seq_len=256, local_batch_size=2, model_spec=cfg.model_spec)
    with pytest.raises(ConfigError, match="parallelism.tensor_parallel_degree: llama3 has no TP plan"):
        check_layout(cfg.parallelism, cfg.model_args, seq_len=256, local_batch_size=2, model_spec=no_plan)


@pytest.mark.parametrize("user, expected", [
    ({}, {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "TORCHINDUCTOR_COMPILE_THREADS": "1"}),
    ({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128", "TORCHINDUCTOR_COMPILE_THREADS": "4"},
     {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128", "TORCHINDUCTOR_COMPILE_THREADS": "4"}),
])
def test_run_train_sh_sets_allocator_and_compile_threads_unless_the_user_did(tmp_path, user, expected):
    """The environment run_train.sh hands the launcher (a stand-in that records it) on this CPU
    machine; on a GPU machine TORCHINDUCTOR_COMPILE_THREADS is left alone (no GPU here to test)."""
    import os

    launcher = tmp_path / "launcher.sh"
    launcher.write_text(f"#!/bin/sh\nenv > {tmp_path / 'env.txt'}\n")
    launcher.chmod(0o755)
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "TORCHINDUCTOR_COMPILE_THREADS")}
    proc = subprocess.run(["./run_train.sh"], cwd=REPO, env={**env, **user, "TORCHRUN": str(launcher)},
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    seen = dict(ln.split("=", 1) for ln in (tmp_path / "env.txt").read_text().splitlines() if "=" in ln)
    for key, value in expected.items():
        assert seen.get(key) == value, key
