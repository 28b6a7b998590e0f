"""Chunked linear cross entropy: same loss and gradients as the plain path, less memory,
and the same training run in the trainer (1 rank, and 2-rank FSDP == 1 rank)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from parallelisms.ac_measure import SavedActivationCounter
from tests.helpers import TINY, losses_by_step, run_in_process, torchrun
from configuration.fields import ConfigError
from trainer.loss import (
    IGNORE_INDEX,
    LinearCrossEntropyHead,
    chunked_ce_loss_sum,
    chunked_linear_cross_entropy,
    cross_entropy_sum,
    install_chunked_ce_head,
)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _problem(batch=3, seq=37, dim=48, vocab=500, ignore_every=5, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(batch, seq, dim, generator=g, dtype=dtype).requires_grad_()
    w = (torch.randn(vocab, dim, generator=g) * 0.2).to(dtype).requires_grad_()
    y = torch.randint(0, vocab, (batch, seq), generator=g)
    if ignore_every:
        y[:, ::ignore_every] = IGNORE_INDEX
    return h, w, y


def _plain(h, w, y, scale):
    loss = cross_entropy_sum(F.linear(h, w), y) / scale
    return (loss, *torch.autograd.grad(loss, (h, w)))


def _chunked(h, w, y, scale, chunk):
    loss = chunked_linear_cross_entropy(h, w, y, chunk) / scale
    return (loss, *torch.autograd.grad(loss, (h, w)))


# 111 tokens: 7, 16, 50 and 64 do not divide it; 111 and 4096 give a single chunk.
@pytest.mark.parametrize("chunk", [1, 7, 16, 50, 64, 111, 4096])
def test_chunked_ce_matches_plain_loss_and_grads(chunk):
    h, w, y = _problem()
    scale = torch.tensor(float((y != IGNORE_INDEX).sum()) * 1.7)  # a "global" count larger than the local one
    ref = _plain(h, w, y, scale)
    got = _chunked(h, w, y, scale, chunk)
    for name, a, b in zip(("loss", "grad_hidden", "grad_weight"), got, ref):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert _rel(a, b) <= 1e-6, (name, chunk, _rel(a, b))
    if chunk >= h.shape[0] * h.shape[1]:
        # One chunk runs exactly the plain path's kernels: bitwise.
        for name, a, b in zip(("loss", "grad_hidden", "grad_weight"), got, ref):
            assert torch.equal(a, b), name
    # Ignored tokens get exactly zero gradient.
    ignored = y == IGNORE_INDEX
    assert torch.count_nonzero(got[1][ignored]) == 0


def test_chunked_ce_all_ignored_and_single_token():
    h, w, y = _problem(batch=1, seq=9)
    y[:] = IGNORE_INDEX
    loss, gh, gw = _chunked(h, w, y, 1.0, 4)
    ref = _plain(h, w, y, 1.0)
    assert loss.item() == 0.0 == ref[0].item()
    assert torch.count_nonzero(gh) == 0 and torch.count_nonzero(gw) == 0
    h, w, y = _problem(batch=1, seq=1, ignore_every=0)
    for a, b in zip(_chunked(h, w, y, 1.0, 8), _plain(h, w, y, 1.0)):
        assert _rel(a, b) <= 1e-6


def test_chunked_ce_bf16_and_autocast_close_to_plain():
    # bf16 params (FSDP mixed precision): fp32 grad_weight accumulator, bf16 results.
    h, w, y = _problem(dtype=torch.bfloat16)
    ref, got = _plain(h, w, y, 100.0), _chunked(h, w, y, 100.0, 16)
    assert [t.dtype for t in got] == [t.dtype for t in ref]
    for a, b in zip(got, ref):
        assert _rel(a, b) <= 1e-2
    # autocast (no FSDP): fp32 params, bf16 matmuls; grads come back in fp32.
    h, w, y = _problem()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss_ref = cross_entropy_sum(F.linear(h, w), y)
        loss = chunked_linear_cross_entropy(h, w, y, 16)
    assert loss.item() == loss_ref.item()  # single-token rows: same bf16 logits, same fp32 CE
    ga, gb = torch.autograd.grad(loss, (h, w)), torch.autograd.grad(loss_ref, (h, w))
    assert all(a.dtype == torch.float32 for a in ga)
    assert _rel(ga[0], gb[0]) <= 1e-6 and _rel(ga[1], gb[1]) <= 1e-2  # plain rounds grad_weight to bf16


def test_chunked_ce_drops_saved_bytes_by_the_logits():
    tokens, vocab = 256, 2048
    h, w, y = _problem(batch=2, seq=tokens // 2, dim=32, vocab=vocab)
    counts = {}
    for name, fn in (("plain", lambda: cross_entropy_sum(F.linear(h, w), y)),
                     ("chunked", lambda: chunked_linear_cross_entropy(h, w, y, 64))):
        with SavedActivationCounter([w]) as counter:
            loss = fn()
        counts[name] = counter.total_bytes
        loss.backward()
    logits_bytes = tokens * vocab * 4
    assert counts["plain"] - counts["chunked"] >= logits_bytes, counts


def test_head_keeps_state_dict_and_returns_logits_without_labels():
    from models import get_model_spec
    from trainer.loss import LossConfig

    spec = get_model_spec("llama3")
    torch.manual_seed(0)
    model = spec.model_cls(spec.flavors["debug_small"])
    model.init_weights()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    weight = model.output.weight
    assert install_chunked_ce_head(model, LossConfig(chunked_ce=True, ce_chunk_size=48))
    assert isinstance(model.output, LinearCrossEntropyHead) and model.output.weight is weight
    after = model.state_dict()
    assert list(after) == list(before) and all(torch.equal(after[k], before[k]) for k in before)
    tokens = torch.randint(0, 2048, (2, 40))
    labels = torch.randint(0, 2048, (2, 40))
    logits = model(tokens)  # no labels: plain logits
    assert logits.shape == (2, 40, 2048)
    loss = chunked_ce_loss_sum(model, tokens, labels)
    assert loss.dim() == 0 and _rel(loss, cross_entropy_sum(logits, labels)) <= 1e-6
    assert not install_chunked_ce_head(model, LossConfig(chunked_ce=False))


def test_chunked_ce_refuses_tp_and_pp_in_one_line():
    from trainer.config import load_config

    for key in ("tensor_parallel_degree", "pipeline_parallel_degree"):
        with pytest.raises(ConfigError) as e:
            load_config(["--loss.chunked_ce", "true", f"--parallelism.{key}", "2"])
        msg = str(e.value)
        assert "\n" not in msg and "loss.chunked_ce" in msg and key in msg


def test_trainer_chunked_ce_matches_plain(tmp_path):
    # 2 x 64 = 128 tokens per microbatch, chunks of 48 (not a divisor); 2 microbatches.
    common = TINY + ["--training.steps", "4", "--data.type", "synthetic", "--training.global_batch_size", "4"]
    plain, _ = run_in_process(common + ["--job.dump_folder", str(tmp_path / "plain")])
    chunked, trainer = run_in_process(common + ["--job.dump_folder", str(tmp_path / "chunked"), "--loss.chunked_ce",
                                                "true", "--loss.ce_chunk_size", "48"])
    assert isinstance(trainer.model_parts[0].output, LinearCrossEntropyHead)
    assert len(plain) == len(chunked) == 4
    for a, b in zip(chunked, plain):
        assert abs(a - b) <= 1e-6 * abs(b), (chunked, plain)


@pytest.mark.multirank
@pytest.mark.timeout(400)
def test_two_rank_fsdp_chunked_ce_matches_one_rank(tmp_path):
    seed = tmp_path / "seed"
    common = TINY + ["--training.steps", "3", "--training.global_batch_size", "4",
                     "--loss.chunked_ce", "true", "--loss.ce_chunk_size", "48",
                     "--checkpoint.initial_load_path", str(seed / "checkpoint" / "step-0")]
    run_in_process(TINY + ["--checkpoint.enable",
                           "--checkpoint.create_seed_checkpoint", "--job.dump_folder", str(seed)])
    ref, _ = run_in_process(common + ["--training.local_batch_size", "4", "--job.dump_folder", str(tmp_path / "one"),
                                      "--checkpoint.enable", "--checkpoint.folder", str(tmp_path / "ck1")])
    torchrun(2, common + ["--job.dump_folder", str(tmp_path / "two"), "--checkpoint.enable",
                          "--checkpoint.folder", str(tmp_path / "ck2")])
    two = losses_by_step(tmp_path / "two")
    assert sorted(two) == [1, 2, 3]
    for step, loss in enumerate(ref, start=1):
        assert abs(two[step] - loss) <= 1e-5 * abs(loss), (step, two[step], loss)
