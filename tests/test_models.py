"""Model shapes: exact parameter counts, causality, dry-run."""

import pytest
import torch

from models.llama3 import LLAMA3_FLAVORS, Llama3
from trainer.config import load_config
from trainer.config import print_model_summary


@pytest.mark.parametrize("flavor, expected", [
    ("8B", 8_030_261_248), ("70B", 70_553_706_496), ("405B", 405_853_388_800)])
def test_llama3_param_counts(flavor, expected):
    with torch.device("meta"):
        model = Llama3(LLAMA3_FLAVORS[flavor])
    assert sum(p.numel() for p in model.parameters()) == expected


def test_dry_run_prints_counts_without_allocating(capsys):
    summary = print_model_summary(load_config(["--config", "llama405b.toml"]))
    out = capsys.readouterr().out
    assert "parameters: 405,853,388,800" in out
    assert summary["flops_per_token"] > 6 * 405e9
    assert "[parallelism]" in out and "tensor_parallel_degree = 8" in out


def test_llama3_is_causal_and_deterministic():
    torch.manual_seed(0)
    model = Llama3(LLAMA3_FLAVORS["debug_small"])
    model.init_weights()
    tokens = torch.randint(0, 2048, (2, 16))
    logits = model(tokens)
    assert logits.shape == (2, 16, 2048)
    changed = tokens.clone()
    changed[:, 10] = (changed[:, 10] + 1) % 2048
    logits2 = model(changed)
    torch.testing.assert_close(logits[:, :10], logits2[:, :10], rtol=0, atol=0)
    assert not torch.allclose(logits[:, 10:], logits2[:, 10:])


def test_llama3_rope_scaling_matches_closed_form():
    from models.common.rope import RopeScaling, llama3_inv_freq

    inv = llama3_inv_freq(128, 500000.0, RopeScaling())
    base = 1.0 / (500000.0 ** (torch.arange(0, 128, 2, dtype=torch.float64) / 128))
    wavelen = 2 * torch.pi / base
    # High frequencies (short wavelengths) are untouched; the lowest are divided by the factor.
    assert torch.allclose(inv[wavelen < 8192 / 4], base[wavelen < 8192 / 4].float())
    assert torch.allclose(inv[wavelen > 8192], (base[wavelen > 8192] / 8).float())
