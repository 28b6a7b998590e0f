"""`./run_train.sh --model.hf_path DIR`: a published-style HF folder trains with one option.

Each HF folder is built here with `transformers` (random weights) and a real
`tokenizer.json` trained with the `tokenizers` library; the Llama folder's config.json
uses the current spelling (`rope_parameters`), the DeepSeek one the legacy one
(`rope_theta` + `rope_scaling`) and holds one MTP layer in the hub layout. Then one
command per layout trains from it, with no flavor and no code: 1 rank, FSDP 2, TP 2
and PP 2 for Llama; EP 2 for DeepSeek with `--model.mtp_depth 1`. Every run checks:

* the first loss equals transformers' loss on the same global batch within 1e-5 (the
  loss is the main head's; MTP is logged apart);
* at lr 0 with the routing-bias rate 0, `checkpoint.last_save_in_hf` exports
  bit-identical tensors, MTP layers included.

Loss alignment: the trainer's (inputs, labels) are a window of S+1 tokens split as
inputs = w[:-1], labels = w[1:]; transformers shifts internally, so the same window is
`input_ids = labels = w`. Every layout below draws the same 4 windows as its first
global batch (the loader deals one global permutation over dp ranks and accumulation
steps), which the test rebuilds with the trainer's own loader and the folder's tokenizer.

`python -m tests.test_hf_train CASES.json OUT` is also a torchrun worker: it builds
trainers from `--model.hf_path` under sharded layouts and checks that every rank's
region-by-region read equals the whole tensor read then distributed (FSDP-over-TP
`_StridedShard` included), FP8 block-quantized folders too.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from tests.helpers import REPO, losses_by_step, run_killing_group

VOCAB = 2048
SEQ = 32
GLOBAL_BATCH = 4
LOSS_TOL = 1e-5


@pytest.fixture(scope="module")
def hf_folders(tmp_path_factory):
    import transformers  # noqa: F401  (the dev extra installs it: missing, this fails, not skips)
    import tokenizers  # noqa: F401  (the dev extra installs it: missing, this fails, not skips)
    from tests.hf_builders import add_hf_mtp_layers, build_hf_deepseek, build_hf_llama

    root = tmp_path_factory.mktemp("hf_train")
    llama = build_hf_llama(root / "llama", vocab=VOCAB, layers=3, tokenizer=True)
    deepseek = add_hf_mtp_layers(build_hf_deepseek(root / "deepseek", vocab=VOCAB, legacy=True, tokenizer=True))
    assert "rope_parameters" in json.loads((llama / "config.json").read_text())
    assert "rope_parameters" not in json.loads((deepseek / "config.json").read_text())
    return {"llama": llama, "deepseek": deepseek}


def run_train(nproc: int, args: list[str], timeout: int = 280):
    env = {**os.environ, "NPROC": str(nproc), "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    return run_killing_group([str(REPO / "run_train.sh"), *args], cwd=REPO, env=env, timeout=timeout)


def train_one_step_at_lr0(ranks: int, folder: Path, dump: Path, extra: list[str]) -> float:
    """`./run_train.sh --model.hf_path folder` for one step at lr 0 on SEQ x GLOBAL_BATCH tokens,
    exporting the last step as an HF folder; returns the first loss."""
    proc = run_train(ranks, [
        "--model.hf_path", str(folder), "--training.seq_len", str(SEQ), "--training.global_batch_size",
        str(GLOBAL_BATCH), "--training.steps", "1", "--optimizer.lr", "0",
        "--lr_scheduler.warmup_steps", "1", "--metrics.log_freq", "1", "--metrics.enable_tensorboard", "false",
        "--job.dump_folder", str(dump), "--checkpoint.enable", "true", "--checkpoint.last_save_in_hf", "true",
        *extra])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return losses_by_step(dump)[1]


def assert_export_is_the_source(folder: Path, export: Path):
    """The exported HF folder holds the source folder's tensors, bit for bit; returns its reader."""
    from trainer.hf_io import HFReader

    src, out = HFReader(folder), HFReader(export)
    assert sorted(src.keys()) == sorted(out.keys())
    changed = [k for k in src.keys() if not torch.equal(src.full(k), out.full(k))]
    assert not changed, changed[:5]
    return out


def _first_global_batch(folder: Path) -> torch.Tensor:
    """The 4 windows [4, S+1] every layout below trains on first (seed 42, builtin corpus)."""
    from trainer.data import DataConfig, build_dataloader
    from trainer.data.tokenizer import build_tokenizer

    loader = build_dataloader(DataConfig(type="builtin"), tokenizer=build_tokenizer(str(folder)),
                              tokenizer_path=str(folder), seq_len=SEQ, local_batch_size=GLOBAL_BATCH, dp_rank=0,
                              dp_world_size=1, seed=42)
    inputs, labels = next(iter(loader))
    assert torch.equal(inputs[:, 1:], labels[:, :-1])
    return torch.cat([inputs, labels[:, -1:]], dim=1)


def _hf_loss(folder: Path) -> float:
    from tests.hf_builders import load_hf_model

    window = _first_global_batch(folder)
    with torch.no_grad():
        return load_hf_model(folder)(input_ids=window, labels=window).loss.item()


LAYOUTS = {  # name -> (model, ranks, extra CLI args); every one has a global batch of 4
    "llama_1rank": ("llama", 1, ["--training.local_batch_size", "4"]),
    "llama_fsdp2": ("llama", 2, ["--training.local_batch_size", "2", "--parallelism.data_parallel_shard_degree", "2"]),
    "llama_tp2": ("llama", 2, ["--training.local_batch_size", "4", "--parallelism.tensor_parallel_degree", "2"]),
    "llama_pp2": ("llama", 2, ["--training.local_batch_size", "4", "--parallelism.pipeline_parallel_degree", "2"]),
    # Routed experts sharded over EP (borrowing the 2 FSDP ranks), the MTP layer on top.
    "deepseek_ep2_mtp": ("deepseek", 2, ["--training.local_batch_size", "2", "--parallelism.expert_parallel_degree",
                                         "2", "--model.mtp_depth", "1"]),
}


@pytest.mark.multirank
@pytest.mark.timeout(600)
@pytest.mark.parametrize("layout", [
    "llama_1rank", "llama_fsdp2", "deepseek_ep2_mtp",
    pytest.param("llama_tp2", marks=pytest.mark.slow), pytest.param("llama_pp2", marks=pytest.mark.slow),
])
def test_run_train_from_hf_folder(layout, hf_folders, tmp_path):
    model, ranks, extra = LAYOUTS[layout]
    folder = hf_folders[model]
    dump = tmp_path / "dump"
    frozen_routing = ["--moe.bias_update_rate", "0"] if model == "deepseek" else []
    first = train_one_step_at_lr0(ranks, folder, dump, [*frozen_routing, *extra])
    ref = _hf_loss(folder)
    print(f"\n{layout}: first loss {first:.7f}, transformers {ref:.7f}, |diff| {abs(first - ref):.2g}")
    assert abs(first - ref) < LOSS_TOL, (first, ref)

    # At lr 0 (and a frozen routing bias) the export is the source folder, bit for bit.
    out = assert_export_is_the_source(folder, dump / "checkpoint" / "step-1-hf")
    if model == "deepseek":
        assert any(".layers.3.eh_proj" in k for k in out.keys())  # the MTP layer went through
        assert "mtp_loss" in json.loads((dump / "metrics.jsonl").read_text().splitlines()[0])


def test_bad_hf_inputs_are_one_line(hf_folders, tmp_path, capsys):
    """Checked when the config loads (run_train.sh does it before any process starts): one
    line naming the field and what to pass. One case goes through run_train.sh: exit 2, no
    traceback."""
    from trainer.config import load_config
    from configuration.fields import ConfigError

    llama, deepseek = str(hf_folders["llama"]), str(hf_folders["deepseek"])
    cases = [
        (["--model.hf_path", str(tmp_path / "nope")], ["model.hf_path", "config.json not found"]),
        (["--model.hf_path", deepseek, "--model.name", "llama3"], ["model.name", "--model.name deepseek_v3"]),
        (["--model.hf_path", llama, "--model.flavor", "debug_small"],
         ["model.flavor", "ffn_hidden_dim: 160 != 192", "drop model.flavor"]),
        (["--model.hf_path", llama, "--model.mtp_depth", "1"], ["model.mtp_depth", "llama3 has no multi-token"]),
        (["--model.hf_path", deepseek, "--model.mtp_depth", "2"], ["model.mtp_depth", "--model.mtp_depth 1"]),
        (["--model.hf_path", llama, "--moe.bias_update_rate", "0"], ["moe.bias_update_rate", "no mixture"]),
        (["--model.hf_path", deepseek, "--checkpoint.initial_load_path", str(tmp_path)],
         ["checkpoint.initial_load_path", "checkpoint.enable"]),
        # The 16B flavor routes with softmax: HF's deepseek_v2, which has no routing bias to train.
        (["--model.name", "deepseek_v3", "--model.flavor", "16B", "--checkpoint.last_save_in_hf", "true"],
         ["checkpoint.last_save_in_hf", "deepseek_v2", "--moe.bias_update_rate 0"]),
    ]
    for args, needles in cases:
        with pytest.raises(ConfigError) as e:
            load_config(["--config", "llama_debug.toml", *args])
        msg = str(e.value)
        assert "\n" not in msg and msg.startswith("config error:") and all(n in msg for n in needles), (args, msg)
    # A tokenizer that is not there: the trainer's one line (in-process, 1 rank).
    from trainer.train import main as trainer_main

    import logging

    handlers = logging.getLogger().handlers[:]
    try:
        assert trainer_main(["--model.hf_path", llama, "--model.tokenizer_path", str(tmp_path),
                             "--job.dump_folder", str(tmp_path / "t")]) == 2
    finally:
        logging.getLogger().handlers[:] = handlers  # main() points logging at the captured stdout
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "model.tokenizer_path" in err[0] and str(tmp_path) in err[0], err
    proc = run_train(1, [*cases[1][0], "--job.dump_folder", str(tmp_path / "d")], timeout=120)
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(err) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "--model.name deepseek_v3" in err[0]


# --------------------------------------------------------------------------- torchrun worker


def _check_region_reads(model_parts, folder: Path) -> int:
    """Every sharded tensor read region by region equals the whole tensor read and then
    distributed, and equals what the trainer loaded; returns how many DTensors were checked."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.tensor import DTensor

    from models.hf_config import read_hf_config
    from trainer.hf_io import HFReader, _materialize, spec_for_model

    spec = spec_for_model(model_parts[0])
    recipes = spec.state_dict_adapter.for_args(model_parts[0].args, read_hf_config(folder)).recipes()
    reader = HFReader(folder)
    checked = 0
    for part in model_parts:
        for k, v in get_model_state_dict(part).items():
            if isinstance(v, DTensor):
                fast = _materialize(recipes[k], v, reader.get)
                slow = _materialize(recipes[k], v, reader.get, force_full=True)
                assert fast.placements == v.placements and torch.equal(fast.to_local(), slow.to_local()), k
                assert torch.equal(fast.to_local(), v.to_local()), k
                checked += 1
    reader.close()
    return checked


def _run_case(case: dict, out: Path) -> None:
    """Builds the trainer on `case["hf"]` and checks its shards; with `case["same_as"]` (an
    FP8 folder and its dequantized twin) the loaded shards equal the twin's, bitwise."""
    import torch.distributed as dist

    from trainer.config import load_config
    from trainer.hf_io import load_hf_into_model
    from trainer.train import Trainer

    trainer = Trainer(load_config(["--model.hf_path", case["hf"], *case["args"]]))
    try:
        checked = _check_region_reads(trainer.model_parts, Path(case["hf"]))
        assert checked > 0
        if case.get("same_as"):
            loaded = [{k: v.to_local().clone() for k, v in p.state_dict().items() if hasattr(v, "to_local")}
                      for p in trainer.model_parts]
            load_hf_into_model(trainer.model_parts, case["same_as"])
            for part, before in zip(trainer.model_parts, loaded):
                for k, v in part.state_dict().items():
                    if k in before:
                        assert torch.equal(before[k], v.to_local()), k
    finally:
        trainer.close(destroy_process_group=False)
    if dist.get_rank() == 0:
        (out / f"{case['name']}.ok").write_text(str(checked))
    dist.barrier()


@pytest.mark.multirank
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_sharded_region_reads(hf_folders, tmp_path):
    """FSDP 2 x TP 2 (Llama: FSDP over TP is `_StridedShard`; DeepSeek with MTP under SP) and
    an FP8 block-quantized DeepSeek folder under FSDP 2 x TP 2: region reads are exact."""
    from tests.helpers import torchrun
    from tests.hf_builders import quantize_hf_folder_fp8

    fp8, twin = quantize_hf_folder_fp8(hf_folders["deepseek"], tmp_path / "fp8", block=(32, 24))
    common = ["--training.seq_len", str(SEQ), "--training.local_batch_size", "2", "--job.dump_folder",
              str(tmp_path / "dump"), "--metrics.enable_tensorboard", "false",
              "--parallelism.data_parallel_shard_degree", "2", "--parallelism.tensor_parallel_degree", "2"]
    cases = [
        {"name": "llama_fsdp2xtp2", "hf": str(hf_folders["llama"]), "args": common},
        {"name": "deepseek_mtp_fsdp2xtp2", "hf": str(hf_folders["deepseek"]),
         "args": [*common, "--model.mtp_depth", "1"]},
        {"name": "deepseek_fp8_fsdp2xtp2", "hf": str(fp8), "same_as": str(twin), "args": common},
    ]
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    torchrun(4, [str(tmp_path / "cases.json"), str(tmp_path)], module="tests.test_hf_train", timeout=580)
    for case in cases:
        assert int((tmp_path / f"{case['name']}.ok").read_text()) > 0


if __name__ == "__main__":
    from tests.helpers import run_worker_cases

    from trainer.distributed import exit_process
    exit_process(run_worker_cases(_run_case, "HF_TRAIN_ONLY"))
