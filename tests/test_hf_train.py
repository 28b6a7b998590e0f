"""HF import in real training runs: 1 rank in-process; FSDP 2, TP 2, PP 2, FSDP 2 x TP 2 and
(DeepSeek) EP 2 under torchrun.

Each run starts from a random HF checkpoint (checkpoint.initial_load_in_hf) and
must (a) give the same logits as transformers on fixed tokens, (b) have a first
training loss equal to transformers' loss on the very batch the trainer drew, and
(c) with last_save_in_hf, export weights whose transformers logits equal the
trained model's.

Loss alignment: the trainer's (inputs, labels) are a window of S+1 tokens split as
inputs = w[:-1], labels = w[1:], and its loss is summed CE / global token count,
i.e. the mean over every label. transformers shifts internally, so the same window
is `input_ids = labels = w` (its last position predicts nothing, and causal
attention keeps it out of the others); over equal-length rows (no ignored labels in
our data) HF's mean is the same number.

The file doubles as the torchrun worker: `python -m tests.test_hf_train OUT HF -- ARGS`.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

VOCAB = 2048  # the debug tokenizer's size: the trainer refuses a smaller model vocab
SEQ = 32
TOL = 1e-4


def _fixed_tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(7))


def _train_args(dump: Path, hf: Path, steps: int = 1, extra: list[str] | None = None) -> list[str]:
    return ["--training.seq_len", str(SEQ), "--training.local_batch_size", "2", "--training.steps", str(steps),
            "--lr_scheduler.warmup_steps", "1", "--optimizer.lr", "1e-3", "--metrics.log_freq", "1",
            "--metrics.enable_tensorboard", "false", "--job.dump_folder", str(dump),
            "--checkpoint.enable", "true", "--checkpoint.initial_load_path", str(hf),
            "--checkpoint.initial_load_in_hf", "true", "--checkpoint.last_save_in_hf", "true",
            *(extra or [])]


def _local_logits(model, tokens):
    from torch.distributed.tensor import DTensor

    was_training = model.training
    model.eval()
    with torch.no_grad():
        out = model(tokens)
    model.train(was_training)
    return out.full_tensor() if isinstance(out, DTensor) else out


def _check_region_reads(model_parts, hf: Path) -> int:
    """Every sharded parameter read region by region equals the whole tensor read and then
    distributed, and equals what the trainer loaded; returns how many DTensors were checked."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.tensor import DTensor

    from models.hf_config import read_hf_config
    from trainer.hf_io import HFReader, _local_region, _materialize, spec_for_model

    spec = spec_for_model(model_parts[0])
    recipes = spec.state_dict_adapter(model_parts[0].args, read_hf_config(hf)).recipes()
    reader = HFReader(hf)
    checked = 0
    for part in model_parts:
        for k, v in get_model_state_dict(part).items():
            if isinstance(v, DTensor):
                fast = _materialize(recipes[k], v, reader.get)
                slow = _materialize(recipes[k], v, reader.get, force_full=True)
                assert fast.placements == v.placements and torch.equal(fast.to_local(), slow.to_local()), k
                assert torch.equal(fast.to_local(), v.to_local()), k
                checked += 1
                _PLACEMENTS.add((repr(v.placements), _local_region(v) is not None))
    reader.close()
    return checked


_PLACEMENTS: set = set()  # (placements, read by region) seen by _check_region_reads


def run_and_record(hf: Path, args: list[str]) -> dict:
    """Builds a trainer on the HF folder's own args, records logits before / after
    training and the batches drawn; returns them (used in-process and by the worker)."""
    from trainer.config import load_config
    from trainer.hf_io import register_hf_flavor
    from trainer.train import Trainer

    name, flavor = register_hf_flavor(hf, "hf_import_test")
    trainer = Trainer(load_config(["--model.name", name, "--model.flavor", flavor, *args]))
    rec: dict = {"dp_rank": trainer.dp_rank, "batches": []}
    try:
        rec["sharded_checked"] = _check_region_reads(trainer.model_parts, hf)
        rec["placements"] = sorted(_PLACEMENTS)
        pp = trainer.dims.pp_enabled
        if not pp:
            rec["logits_before"] = _local_logits(trainer.model_parts[0], _fixed_tokens())
        draw = trainer.next_microbatches

        def record():
            batches = draw()
            rec["batches"].extend((i.clone(), l.clone()) for i, l in batches)
            return batches

        trainer.next_microbatches = record
        rec["losses"] = trainer.train()
        if not pp:
            model = trainer.model_parts[0]
            rec["logits_after"] = _local_logits(model, _fixed_tokens())
            inputs, labels = rec["batches"][0]
            rec["first_batch_loss_after"] = torch.nn.functional.cross_entropy(
                _local_logits(model, inputs).flatten(0, 1), labels.flatten()).item()
        rec["export"] = str(trainer.checkpointer.folder / f"step-{trainer.step}-hf")
    finally:
        trainer.close()
    return rec


def _worker(argv: list[str]) -> None:
    import os

    out, hf, *args = argv
    rec = run_and_record(Path(hf), [a for a in args if a != "--"])
    torch.save(rec, Path(out) / f"rank{os.environ['RANK']}.pt")


# --------------------------------------------------------------------------- HF side


def _hf_model(folder):
    from tests.test_hf_models import load_hf_model

    return load_hf_model(folder)


def _hf_loss(model, batches) -> float:
    inputs = torch.cat([i for i, _ in batches])
    labels = torch.cat([l for _, l in batches])
    assert torch.equal(inputs[:, 1:], labels[:, :-1])  # one window, shifted by one
    window = torch.cat([inputs, labels[:, -1:]], dim=1)
    with torch.no_grad():
        return model(input_ids=window, labels=window).loss.item()


@pytest.fixture(scope="module")
def hf_folders(tmp_path_factory):
    pytest.importorskip("transformers")
    from tests.test_hf_models import build_hf_deepseek, build_hf_llama

    root = tmp_path_factory.mktemp("hf_train")
    return {"llama": build_hf_llama(root / "llama", vocab=VOCAB, layers=3),
            "deepseek": build_hf_deepseek(root / "deepseek", vocab=VOCAB)}


def _check_record(rec: dict, hf_dir: Path, first_loss: float, label: str) -> dict[str, float]:
    hf = _hf_model(hf_dir)
    out = {}
    if "logits_before" in rec:
        with torch.no_grad():
            ref = hf(_fixed_tokens()).logits
        out["import logits"] = (rec["logits_before"] - ref).abs().max().item()
    out["first loss"] = abs(first_loss - _hf_loss(hf, rec["batches"]))
    if "logits_after" in rec:
        with torch.no_grad():
            back = _hf_model(rec["export"])(_fixed_tokens()).logits
        out["export logits"] = (rec["logits_after"] - back).abs().max().item()
    print(f"\n{label}: " + ", ".join(f"{k} max|diff| {v:.3g}" for k, v in out.items()))
    for k, v in out.items():
        assert v < TOL, (label, k, v)
    return out


# --------------------------------------------------------------------------- tests


@pytest.mark.timeout(180)
@pytest.mark.parametrize("model", ["llama", "deepseek"])
def test_one_rank_run_from_hf(model, hf_folders, tmp_path):
    from models import get_model_spec

    try:
        rec = run_and_record(hf_folders[model], _train_args(tmp_path, hf_folders[model], steps=4))
    finally:
        get_model_spec("llama3" if model == "llama" else "deepseek_v3").flavors.pop("hf_import_test", None)
    losses = rec["losses"]
    # It trains: finite losses, and the first batch's loss went down.
    assert all(torch.isfinite(torch.tensor(losses))), losses
    assert rec["first_batch_loss_after"] < losses[0] - 0.05, (losses[0], rec["first_batch_loss_after"])
    # First loss: the loss of the first batch alone.
    _check_record({**rec, "batches": rec["batches"][:1]}, hf_folders[model], losses[0], f"{model} 1 rank")


LAYOUTS = {  # layout -> (ranks, args)
    "fsdp2": (2, ["--parallelism.data_parallel_shard_degree", "2"]),
    "tp2": (2, ["--parallelism.tensor_parallel_degree", "2"]),
    "pp2": (2, ["--parallelism.pipeline_parallel_degree", "2"]),
    # FSDP over TP: FSDP shards TP-sharded weights with _StridedShard placements.
    "fsdp2xtp2": (4, ["--parallelism.data_parallel_shard_degree", "2", "--parallelism.tensor_parallel_degree", "2"]),
    # DeepSeek: routed experts sharded over EP (Shard(0) of the grouped tensors), the rest FSDP.
    "ep2": (2, ["--parallelism.expert_parallel_degree", "2"]),
}


@pytest.mark.multirank
@pytest.mark.timeout(300)
@pytest.mark.parametrize("model,layout", [
    ("llama", "fsdp2"), ("llama", "tp2"), ("deepseek", "ep2"),
    pytest.param("llama", "pp2", marks=pytest.mark.slow),
    pytest.param("llama", "fsdp2xtp2", marks=pytest.mark.slow),
    pytest.param("deepseek", "fsdp2", marks=pytest.mark.slow),
    pytest.param("deepseek", "tp2", marks=pytest.mark.slow),
])
def test_multi_rank_import_matches_hf(model, layout, hf_folders, tmp_path):
    from tests.helpers import losses_by_step, torchrun

    out = tmp_path / "out"
    out.mkdir()
    hf = hf_folders[model]
    ranks, extra = LAYOUTS[layout]
    torchrun(ranks, [str(out), str(hf), "--", *_train_args(tmp_path, hf, steps=1, extra=extra)],
             module="tests.test_hf_train", timeout=280)
    recs = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(ranks)]
    first_loss = losses_by_step(tmp_path)[1]
    # One copy of each data-parallel rank's batches.
    by_dp = {rec["dp_rank"]: rec["batches"] for rec in recs}
    merged = {**recs[0], "batches": [b for dp in sorted(by_dp) for b in by_dp[dp]]}
    _check_record(merged, hf, first_loss, f"{model} {layout}")
    if layout != "pp2":  # PP alone leaves plain tensors
        assert all(rec["sharded_checked"] > 0 for rec in recs)
    if "logits_before" in recs[1]:  # every rank sees the same full logits
        assert all(torch.equal(recs[0]["logits_before"], r["logits_before"]) for r in recs)


if __name__ == "__main__":
    _worker(sys.argv[1:])


@pytest.mark.timeout(120)
def test_trainer_reports_bad_hf_folder_in_one_line(hf_folders, tmp_path, capsys):
    """A flavor that does not match config.json, or a folder that is not an HF folder,
    stops the trainer with exit code 2 and one line naming the problem."""
    import logging

    from trainer.train import main as trainer_main

    def main(argv):  # main() points logging at the captured stdout: restore the handlers after
        root = logging.getLogger()
        saved = root.handlers[:]
        try:
            return trainer_main(argv)
        finally:
            root.handlers[:] = saved

    base = ["--model.flavor", "debug_small", "--training.seq_len", str(SEQ), "--training.steps", "1",
            "--job.dump_folder", str(tmp_path), "--checkpoint.enable", "true",
            "--checkpoint.initial_load_in_hf", "true", "--metrics.enable_tensorboard", "false"]
    assert main([*base, "--checkpoint.initial_load_path", str(hf_folders["llama"])]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "does not match the llama3 model" in err[0] and "n_layers" not in err[0]
    assert "ffn_hidden_dim: 160 != 192" in err[0]

    assert main([*base, "--checkpoint.initial_load_path", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "config.json not found" in err[0]
