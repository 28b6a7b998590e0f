"""DeepSeek V3 multi-token prediction (models/deepseek_v3/mtp.py).

1. The training loss with MTP (trainer/loss.py TokenNormalizedLoss) against an independent computation: the MTP chain run on
   truncated windows (depth k sees only the positions whose target t_{i+k+1} exists,
   exact under causal attention) instead of the model's rolled, masked full windows;
   loss value and gradients must agree.
2. MTP composes with FSDP 2, TP 2 (sequence parallel) and PP 2: one optimizer step gives
   the gradients of one rank (all runs load the same HF folder with an MTP layer).
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import run_in_process

DEPTH, WEIGHT = 2, 0.3


def _model():
    from models.deepseek_v3 import DEEPSEEK_V3_FLAVORS, DeepSeekV3

    args = dataclasses.replace(DEEPSEEK_V3_FLAVORS["debug"], vocab_size=512, dim=64, n_layers=3, n_heads=4,
                               q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
                               v_head_dim=16, inter_dim=128, moe_inter_dim=32, mtp_depth=DEPTH)
    torch.manual_seed(0)
    model = DeepSeekV3(args)
    model.init_weights()
    with torch.no_grad():  # unit-variance embedding, as in training; sharper output head
        model.output.weight.mul_(8.0)
    return model


def _reference_loss(model, window: torch.Tensor) -> torch.Tensor:
    """main mean CE + WEIGHT / DEPTH * sum_k mean CE of depth k, with no rolling: depth k
    runs on the first S - k positions, embedding t_{i+k} and predicting t_{i+k+1}."""
    s = window.shape[1] - 1
    rope = model.rope_cache
    h = model.tok_embeddings(window[:, :s])
    for block in model.layers.values():
        h = block(h, rope[:s])
    hidden = model.norm(h)
    loss = F.cross_entropy(model.output(hidden).flatten(0, 1), window[:, 1:].flatten())
    mtp = 0.0
    for k, layer in enumerate(model.mtp.values(), start=1):
        n = s - k
        emb = model.tok_embeddings(window[:, k:k + n])
        hidden = layer(hidden[:, :n], emb, rope[:n])
        mtp = mtp + F.cross_entropy(model.output(hidden).flatten(0, 1), window[:, k + 1:k + 1 + n].flatten())
    return loss + WEIGHT / DEPTH * mtp


def test_mtp_loss_matches_an_independent_computation():
    from trainer.loss import TokenNormalizedLoss, count_tokens

    model = _model()
    window = torch.randint(0, 512, (3, 17), generator=torch.Generator().manual_seed(1))
    inputs, labels = window[:, :-1], window[:, 1:]
    loss_fn = TokenNormalizedLoss(mtp_depth=DEPTH, mtp_weight=WEIGHT)
    counts = count_tokens(labels, DEPTH)
    assert counts.tolist() == [48.0, 45.0, 42.0]  # 3 x 16 positions, minus k per row at depth k
    with loss_fn.normalized_by(counts):
        ours = loss_fn(model(inputs, mtp_labels=labels), labels)
    ours.backward()
    ours_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    ref = _reference_loss(model, window)
    ref.backward()
    print(f"\nMTP loss {ours.item():.6f} vs reference {ref.item():.6f}; terms {ours.token_terms.tolist()}")
    torch.testing.assert_close(ours, ref, rtol=0, atol=2e-6)
    for n, p in model.named_parameters():
        torch.testing.assert_close(ours_grads[n], p.grad, rtol=1e-5, atol=1e-7, msg=n)
    # MTP matters: the mtp modules get gradients, and the depths' losses are their own.
    assert all(ours_grads[n].abs().max() > 0 for n in ours_grads if n.startswith("mtp."))
    assert len(set(round(t, 4) for t in ours.token_terms.tolist())) == 3
    # Without mtp_labels (sampling, eval) the model is the plain next-token model.
    with torch.no_grad():
        assert torch.equal(model(inputs), model(inputs, mtp_labels=labels)[:3])


LAYOUTS = {
    "fsdp2": (2, ["--parallelism.data_parallel_shard_degree", "2"]),
    "tp2_sp": (4, ["--parallelism.tensor_parallel_degree", "2"]),
    "pp2": (4, ["--parallelism.pipeline_parallel_degree", "2"]),
}


@pytest.mark.multirank
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_mtp_training_is_layout_invariant(tmp_path):
    import transformers  # noqa: F401  (the dev extra installs it: missing, this fails, not skips)
    from tests.hf_builders import add_hf_mtp_layers, build_hf_deepseek
    from tests.test_moe_balance import _grads, _max_diff, layout_grads

    folder = add_hf_mtp_layers(build_hf_deepseek(tmp_path / "ds", vocab=2048, tokenizer=True))

    def args(dump, local, extra=()):
        return ["--config", "llama_debug.toml", "--model.hf_path", str(folder), "--model.mtp_depth", "1",
                "--training.seq_len", "32", "--training.local_batch_size", str(local), "--training.global_batch_size",
                "4", "--training.steps", "1", "--training.max_norm", "0", "--optimizer.lr", "0",
                "--lr_scheduler.warmup_steps", "1", "--metrics.enable_tensorboard", "false", "--metrics.log_freq", "1",
                "--job.dump_folder", str(dump), *extra]

    _, trainer = run_in_process(args(tmp_path / "ref", 4))
    ref = _grads(trainer)
    assert any(k.startswith("mtp.0.") and ref[k].abs().max() > 0 for k in ref)
    ref_mtp = json.loads((tmp_path / "ref" / "metrics.jsonl").read_text().splitlines()[0])["mtp_loss"]
    layouts = {name: args(tmp_path / name, local, extra) for name, (local, extra) in LAYOUTS.items()}
    for name, grads in layout_grads(layouts, tmp_path).items():
        mtp_loss = json.loads((tmp_path / name / "metrics.jsonl").read_text().splitlines()[0])["mtp_loss"]
        diff = _max_diff(grads, ref)
        print(f"{name}: max |grad - 1 rank| {diff:.2g}, mtp_loss {mtp_loss:.6f} vs {ref_mtp:.6f}")
        assert diff < 1e-5 and abs(mtp_loss - ref_mtp) < 1e-5, name
