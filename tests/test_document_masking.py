"""data.document_masking: a packed forward equals running each document alone (loss and
grads within 1e-6), for Llama (GQA) and DeepSeek (MLA + MoE); composes with TP, PP, FSDP."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import TINY, read_metrics, run_in_process, tiny_seed_checkpoint, torchrun
from trainer.data.masking import document_inputs

BOS = 7


def test_document_inputs_from_bos():
    x = torch.tensor([[BOS, 1, 2, BOS, 3, BOS], [4, 5, BOS, 6, 9, 8]])
    d = document_inputs(x, BOS)
    assert d["positions"].tolist() == [[0, 1, 2, 0, 1, 0], [0, 1, 0, 1, 2, 3]]
    assert d["document_ids"].tolist() == [[1, 1, 1, 2, 2, 3], [1, 1, 2, 2, 2, 2]]
    eos = 9  # a tokenizer without BOS: documents start after each EOS
    d = document_inputs(torch.tensor([[1, 2, eos, 3, eos, 4]]), None, eos)
    assert d["positions"].tolist() == [[0, 1, 2, 0, 1, 0]]


def _model(name: str, flavor: str):
    from models import get_model_spec

    spec = get_model_spec(name)
    torch.manual_seed(0)
    model = spec.model_cls(spec.flavors[flavor])
    model.init_weights()
    return model.double()


@pytest.mark.parametrize("name, flavor", [("llama3", "debug_small"), ("deepseek_v3", "debug")])
def test_packed_forward_equals_each_document_alone(name, flavor):
    model = _model(name, flavor)
    vocab = model.tok_embeddings.num_embeddings
    g = torch.Generator().manual_seed(1)
    lengths = [[13, 1, 20, 6], [7, 25, 8]]  # two packed rows of 40 tokens; a one-token document too
    docs = [[torch.cat([torch.tensor([BOS]), torch.randint(0, vocab, (n - 1,), generator=g)]) for n in row]
            for row in lengths]
    inputs = torch.stack([torch.cat(row) for row in docs])  # [2, 40]
    labels = torch.randint(0, vocab, inputs.shape, generator=g)

    logits = model(inputs, **document_inputs(inputs, BOS))
    packed_loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")
    packed_loss.backward()
    packed_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)

    alone_loss = torch.zeros((), dtype=torch.float64)
    for r, row in enumerate(docs):
        start = 0
        for doc in row:
            out = model(doc[None])  # plain causal attention, positions 0..n-1
            alone_loss = alone_loss + F.cross_entropy(out[0], labels[r, start:start + len(doc)], reduction="sum")
            start += len(doc)
    alone_loss.backward()
    assert abs(packed_loss.item() - alone_loss.item()) <= 1e-6 * abs(alone_loss.item())
    for n, p in model.named_parameters():
        if p.grad is None:
            continue
        assert torch.allclose(packed_grads[n], p.grad, rtol=1e-6, atol=1e-9), (n, (packed_grads[n] - p.grad).abs().max())
    # and without the mask the packed forward is a different function (documents see each other)
    with torch.no_grad():
        unmasked = F.cross_entropy(model(inputs).flatten(0, 1), labels.flatten(), reduction="sum")
    assert abs(unmasked.item() - alone_loss.item()) > 1e-3


def test_dense_and_flex_masks_agree_on_cpu_forward():
    """The flex BlockMask path (used on CUDA) computes what the dense SDPA mask does (forward, eager flex)."""
    import torch.nn.attention.flex_attention  # noqa: F401  (the dev extra installs it: missing, this fails, not skips)
    from torch.nn.attention.flex_attention import flex_attention

    from models.common.attention import SDPA, DocumentMask

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 32, 16, generator=g) for _ in range(3))
    tokens = torch.tensor([[BOS] + [1] * 9 + [BOS] + [2] * 21, [3] * 5 + [BOS] * 27])
    ids = document_inputs(tokens, BOS)["document_ids"]
    mask = DocumentMask(ids)
    dense = SDPA()(q, k, v, mask=mask)  # CPU: the dense SDPA mask
    assert mask.block is None and mask.dense.shape == (2, 1, 32, 32)
    with pytest.warns(UserWarning, match="without torch.compile"):  # eager flex: fine for a forward check
        flex = flex_attention(q, k, v, block_mask=DocumentMask(ids, backend="flex").block)
    assert torch.allclose(dense, flex, atol=1e-5)


@pytest.mark.parametrize("seq", [384, 300])  # whole tiles, and a ragged last tile
def test_block_mask_from_tile_ranges_equals_create_block_mask(seq):
    """The BlockMask is built from each 128-row tile's document range (no [S, S] tensor): the
    same partial and full tiles, in the same order, as create_block_mask over the mask_mod."""
    import torch.nn.attention.flex_attention  # noqa: F401  (the dev extra installs it: missing, this fails, not skips)
    from torch.nn.attention.flex_attention import create_block_mask

    from models.common.attention import DocumentMask

    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 50, (3, seq), generator=g)
    tokens[0, torch.randperm(seq, generator=g)[:3]] = BOS  # a few documents
    tokens[1] = 5  # one document over every tile: full tiles below the diagonal
    tokens[2, ::37] = BOS  # many short ones
    ids = document_inputs(tokens, BOS)["document_ids"]

    def block_causal(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (ids[b, q_idx] == ids[b, kv_idx])

    ref = create_block_mask(block_causal, 3, None, seq, seq, device="cpu")
    new = DocumentMask(ids, backend="flex").block
    assert new.seq_lengths == ref.seq_lengths and new.BLOCK_SIZE == ref.BLOCK_SIZE
    for num, idx in (("kv_num_blocks", "kv_indices"), ("full_kv_num_blocks", "full_kv_indices")):
        counts = getattr(ref, num)
        assert torch.equal(getattr(new, num), counts), num
        assert all(torch.equal(getattr(new, idx)[b, 0, i, :c], getattr(ref, idx)[b, 0, i, :c])
                   for b in range(3) for i, c in enumerate(counts[b, 0].tolist())), idx
    assert ref.full_kv_num_blocks[1].sum() > 0 == ref.full_kv_num_blocks[2].sum()  # both kinds of tile occur


def test_one_mask_per_forward_and_flex_gets_v_unpadded(monkeypatch):
    """The model builds the mask once per forward (not per layer); flex attention takes MLA's
    Dv < Dqk as is, with the dense path's result."""
    from torch.nn.attention.flex_attention import flex_attention

    import models.common.attention as attention

    builds = []
    dense_fn = attention._block_causal_dense
    monkeypatch.setattr(attention, "_block_causal_dense", lambda doc: builds.append(doc.shape) or dense_fn(doc))
    model = _model("deepseek_v3", "debug")
    assert len(model.layers) >= 2
    tokens = torch.randint(0, model.tok_embeddings.num_embeddings, (2, 40))
    tokens[:, [0, 17]] = BOS
    with torch.no_grad():
        model(tokens, **document_inputs(tokens, BOS))
    assert builds == [(2, 40)]

    seen_v = []

    def eager_flex(q, k, v, **kw):  # eager flex (CPU): fine for a forward check
        seen_v.append(v.shape)
        return flex_attention(q, k, v, **kw)

    monkeypatch.setattr(attention, "_compiled_flex", lambda: eager_flex)
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(2, 4, 40, 24, generator=g) for _ in range(2))
    v = torch.randn(2, 4, 40, 16, generator=g)
    ids = document_inputs(tokens, BOS)["document_ids"]
    dense = attention.SDPA()(q, k, v, mask=attention.DocumentMask(ids, backend="sdpa"))
    with warnings.catch_warnings():  # eager flex warns (once per process) that it is for debugging
        warnings.simplefilter("ignore", UserWarning)
        flex = attention.SDPA()(q, k, v, mask=attention.DocumentMask(ids, backend="flex"))
    assert seen_v == [(2, 4, 40, 16)] and flex.shape == dense.shape == (2, 4, 40, 16)
    assert torch.allclose(dense, flex, atol=1e-5)


@pytest.mark.multirank
@pytest.mark.slow
def test_document_masking_composes_with_tp_pp_fsdp(tmp_path, monkeypatch):
    """Two steps with document masking from a seed checkpoint: TP 2, PP 2 and FSDP 2 equal one rank."""
    monkeypatch.setenv("TITAN_DATA_CACHE", str(tmp_path / "cache"))
    common = TINY + tiny_seed_checkpoint(tmp_path / "seed") + [
        "--training.steps", "2", "--training.global_batch_size", "4", "--data.document_masking",
        "--lr_scheduler.warmup_steps", "0"]
    ref, _ = run_in_process(common + ["--job.dump_folder", str(tmp_path / "one")])
    layouts = {"tp2": ["--parallelism.tensor_parallel_degree", "2"],
               "pp2": ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_microbatch_size",
                       "1"],
               "fsdp2": []}
    cases = [{"name": n, "args": common + extra + ["--job.dump_folder", str(tmp_path / n)]} for n, extra in layouts.items()]
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    torchrun(2, [str(tmp_path / "cases.json"), str(tmp_path / "dumps")], timeout=500, module="tests.parallel_worker")
    for name in layouts:
        got = [r["loss"] for r in read_metrics(tmp_path / name)]
        assert len(got) == 2 and all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(got, ref)), (name, got, ref)
