"""[validation]: val/loss equals a hand-computed loss on the same windows; the held-out split
is disjoint from training; the value is the same under FSDP and PP as on one rank."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import TINY, read_metrics, run_in_process, tiny_seed_checkpoint, torchrun
from configuration.fields import ConfigError


@pytest.fixture(autouse=True)
def _cache_in_tmp(tmp_path, monkeypatch):
    monkeypatch.setenv("TITAN_DATA_CACHE", str(tmp_path / "cache"))


def test_validation_loss_equals_hand_computed_loss(tmp_path):
    args = TINY + ["--training.steps", "2", "--validation.enable", "--validation.freq", "2", "--validation.steps", "3",
                   "--validation.holdout", "0.02", "--job.dump_folder", str(tmp_path)]
    _, trainer = run_in_process(args)
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows if "val/loss" in r] == [2]
    logged = next(r for r in rows if "val/loss" in r)
    total = count = 0.0
    model = trainer.model_parts[0]
    with torch.no_grad():
        for inputs, labels in trainer.validator.batches():
            logits = model(inputs)
            total += F.cross_entropy(logits.flatten(0, 1).double(), labels.flatten(), reduction="sum").item()
            count += labels.numel()
    assert count == 3 * 2 * 64
    assert abs(logged["val/loss"] - total / count) <= 1e-6 * total / count
    assert abs(logged["val/perplexity"] - math.exp(logged["val/loss"])) <= 1e-9 * logged["val/perplexity"]
    # the held-out windows are the tail that training never draws
    train_src, val_src = trainer.dataloader.dataset.sources[0], trainer.validator.loader.dataset.sources[0]
    assert train_src.base.num_windows == val_src.base.num_windows and train_src.lo == 0
    assert val_src.lo == train_src.num_windows + 1 and val_src.lo + val_src.num_windows == train_src.base.num_windows
    assert logged["data/tokens/builtin"] == 2 * 2 * 64


@pytest.mark.parametrize("n_tokens,fraction", [(64 * 50 + 1, 0.02), (64 * 50 + 40, 0.1), (64 * 3 + 1, 0.3)])
def test_holdout_shares_no_token_with_training(n_tokens, fraction):
    """Consecutive windows share a boundary token; the splits must not: no token position is in
    both a training window (as input or label) and a validation window."""
    import numpy as np

    from trainer.data.loader import split_holdout
    from trainer.data.windows import ArrayWindows

    positions = ArrayWindows(np.arange(n_tokens), 64, "positions")  # token value = its position
    train, val = (split_holdout(positions, fraction, part) for part in ("train", "val"))
    train_pos = set(train.rows(np.arange(train.num_windows)).ravel().tolist())
    val_pos = set(val.rows(np.arange(val.num_windows)).ravel().tolist())
    assert val.num_windows == max(1, int(positions.num_windows * fraction))
    assert train_pos.isdisjoint(val_pos), sorted(train_pos & val_pos)
    assert train.num_windows + val.num_windows == positions.num_windows - 1  # one window left out, no more
    with pytest.raises(ConfigError, match="validation.holdout: 0.5 leaves no training windows"):
        split_holdout(ArrayWindows(np.arange(64 * 2 + 1), 64, "two"), 0.5, "train")


def test_validation_config_errors(tmp_path):
    from trainer.config import load_config

    with pytest.raises(ConfigError, match="validation.holdout: 0 with no validation.sources"):
        load_config(["--validation.enable", "--validation.holdout", "0"])
    bad = tmp_path / "bad.toml"
    bad.write_text('[validation]\nenable = true\n[[validation.sources]]\ntype = "webtext"\npath = "x"\n')
    with pytest.raises(ConfigError, match=r"validation.sources\[0\].type: unknown source type 'webtext'"):
        load_config(["--config", str(bad)])


@pytest.mark.multirank
@pytest.mark.slow
def test_validation_same_under_fsdp_pp_and_cp(tmp_path):
    """One step from a seed checkpoint, then val/loss: one rank = FSDP over 2 = PP over 2 = CP over 2."""
    common = TINY + tiny_seed_checkpoint(tmp_path / "seed") + [
        "--training.steps", "1", "--training.global_batch_size", "4", "--validation.enable", "--validation.freq", "1"]
    # dp 1 evaluates 2 batches of 2; dp 2 one step of 2 per rank: the same 4 windows
    run_in_process(common + ["--validation.steps", "2", "--job.dump_folder", str(tmp_path / "one")])
    cases = [{"name": "fsdp2", "args": common + ["--validation.steps", "1", "--job.dump_folder",
                                                 str(tmp_path / "fsdp2")]},
             {"name": "pp2", "args": common + ["--validation.steps", "2", "--parallelism.pipeline_parallel_degree",
                                               "2", "--parallelism.pipeline_parallel_microbatch_size", "1",
                                               "--job.dump_folder", str(tmp_path / "pp2")]},
             {"name": "cp2", "args": common + ["--validation.steps", "2", "--parallelism.context_parallel_degree", "2",
                                               "--job.dump_folder", str(tmp_path / "cp2")]}]
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    torchrun(2, [str(tmp_path / "cases.json"), str(tmp_path / "dumps")], timeout=500, module="tests.parallel_worker")
    ref = next(r for r in read_metrics(tmp_path / "one") if "val/loss" in r)["val/loss"]
    for name in ("fsdp2", "pp2", "cp2"):
        got = next(r for r in read_metrics(tmp_path / name) if "val/loss" in r)["val/loss"]
        assert abs(got - ref) <= 1e-5 * ref, (name, got, ref)
