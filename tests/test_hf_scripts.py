"""scripts/convert_checkpoint.py (DCP <-> HF) and scripts/generate.py."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

import transformers  # noqa: F401  (the dev extra installs it: missing, this fails, not skips)

from tests.helpers import REPO, TINY, run_in_process  # noqa: E402
from tests.hf_builders import (add_hf_mtp_layers, build_hf_deepseek, build_hf_llama, hf_logits,  # noqa: E402
                                  load_hf_model, tokens_for)
from trainer.hf_io import HFReader  # noqa: E402

sys.path.insert(0, str(REPO / "scripts"))
import convert_checkpoint  # noqa: E402
import generate as gen_script  # noqa: E402


@pytest.mark.timeout(120)
def test_hf_to_dcp_to_hf_roundtrip_is_exact(tmp_path):
    """An HF folder with an MTP layer -> DCP (with the MTP layer) -> HF via --model.hf_path:
    the same tensors (MTP copies of the embedding and head included), tokenizer files copied."""
    src = add_hf_mtp_layers(build_hf_deepseek(tmp_path / "hf", q_lora=True, yarn=True, vocab=512, tokenizer=True))
    assert convert_checkpoint.main(["hf-to-dcp", str(src), str(tmp_path / "dcp"), "--model.mtp_depth", "1"]) == 0
    assert (tmp_path / "dcp" / ".metadata").is_file()
    assert convert_checkpoint.main(["dcp-to-hf", str(tmp_path / "dcp"), str(tmp_path / "back"),
                                    "--model.hf_path", str(src)]) == 0
    a, b = HFReader(src), HFReader(tmp_path / "back")
    assert sorted(a.keys()) == sorted(b.keys()) and any(".layers.3.eh_proj." in k for k in a.keys())
    for k in a.keys():
        assert torch.equal(a.full(k), b.full(k)), k
    assert (tmp_path / "back" / "tokenizer.json").is_file() and (tmp_path / "back" / "tokenizer_config.json").is_file()
    tokens = tokens_for(256)
    assert (hf_logits(src, tokens) - hf_logits(tmp_path / "back", tokens)).abs().max() == 0
    # Without --model.hf_path no flavor has these shapes: one line saying what to pass.
    assert convert_checkpoint.main(["dcp-to-hf", str(tmp_path / "dcp"), str(tmp_path / "x")]) == 2


@pytest.mark.timeout(180)
def test_training_checkpoint_to_hf_loads_in_transformers(tmp_path):
    """A full training checkpoint (model + optimizer + ...) -> HF, flavor inferred from shapes;
    transformers' logits equal ours from the DCP weights. Also the CLI runs as a script."""
    run_in_process([*TINY, "--training.steps", "1", "--job.dump_folder", str(tmp_path),
                    "--checkpoint.enable", "true", "--metrics.enable_tensorboard", "false"])
    step = tmp_path / "checkpoint" / "step-1"
    out = tmp_path / "hf"
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "convert_checkpoint.py"), "dcp-to-hf", str(step),
                           str(out), "--dtype", "float32"], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    assert "llama3 debug_small" in proc.stdout
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "llama" and cfg["num_hidden_layers"] == 3 and cfg["num_key_value_heads"] == 2

    model = gen_script.load_model(str(step))
    tokens = tokens_for(2048)
    with torch.no_grad():
        ours = model(tokens)
    diff = (ours - hf_logits(out, tokens)).abs().max().item()
    print(f"\ndcp-to-hf (trained debug_small): max|diff| {diff:.3g}")
    assert diff < 1e-4


def test_convert_errors_are_one_line(tmp_path, capsys):
    assert convert_checkpoint.main(["dcp-to-hf", str(tmp_path), str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip()
    assert "not a DCP checkpoint folder" in err and "\n" not in err
    assert convert_checkpoint.main(["hf-to-dcp", str(tmp_path), str(tmp_path / "x")]) == 2
    assert "config.json not found" in capsys.readouterr().err


@pytest.mark.timeout(120)
def test_generate_greedy_matches_transformers_and_sampling(tmp_path, capsys):
    src = build_hf_llama(tmp_path / "hf", vocab=2048)
    model = gen_script.load_model(str(src))
    prompt = [2032, 17, 400, 1200, 9]
    ours = gen_script.generate(model, prompt, 12, temperature=0)
    hf = load_hf_model(src)
    ref = hf.generate(torch.tensor([prompt]), max_new_tokens=12, min_new_tokens=12, do_sample=False,
                      pad_token_id=0)[0, len(prompt):].tolist()
    assert ours == ref

    # top_k=1 is greedy at any temperature; sampling is reproducible from the seed and stays in the top k.
    assert gen_script.generate(model, prompt, 12, temperature=1.5, top_k=1,
                               generator=torch.Generator().manual_seed(0)) == ours
    s1 = gen_script.generate(model, prompt, 12, temperature=0.9, top_k=5, generator=torch.Generator().manual_seed(3))
    s2 = gen_script.generate(model, prompt, 12, temperature=0.9, top_k=5, generator=torch.Generator().manual_seed(3))
    assert s1 == s2
    ctx = list(prompt)
    for t in s1:
        with torch.no_grad():
            top5 = torch.topk(model(torch.tensor([ctx]))[0, -1], 5).indices.tolist()
        assert t in top5
        ctx.append(t)

    # The CLI, with the repo's tokenizer.
    assert gen_script.main(["--checkpoint", str(src), "--prompt", "def main(", "--max_new_tokens", "5",
                            "--temperature", "0.7", "--top_k", "20", "--num_samples", "2"]) == 0
    out = capsys.readouterr().out
    assert out.count("--- sample") == 2 and "def main(" in out


@pytest.mark.timeout(120)
def test_generate_from_hf_path_with_its_tokenizer(tmp_path, capsys):
    """--model.hf_path: model, weights and tokenizer (tokenizer.json) from the folder; a
    tokenizer too large for the model is refused with the --tokenizer to use."""
    src = build_hf_llama(tmp_path / "hf", vocab=512, tokenizer=True)
    assert gen_script.main(["--model.hf_path", str(src), "--prompt", "Hello", "--max_new_tokens", "4",
                            "--temperature", "0"]) == 0
    out = capsys.readouterr().out
    assert "--- sample 0 (4 tokens) ---\nHello" in out
    # The repo's debug tokenizer (2048 ids) does not fit this 512-id model.
    assert gen_script.main(["--model.hf_path", str(src), "--tokenizer", str(REPO / "assets" / "tokenizer"),
                            "--prompt", "x"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "2048 tokens but the model only 512" in err and f"--tokenizer {src}" in err
