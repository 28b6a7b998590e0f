"""Data pipeline: packing, DP sharding, epochs, exact resume, file loading, builtin corpus, cache."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import pickle
import sys

import numpy as np
import pytest
import torch

import trainer.data.datasets as datasets_mod
from trainer.configurable import ConfigError
from trainer.data import build_dataloader, build_dataset, build_tokenizer
from trainer.data.builtin_corpus import builtin_documents, file_docstrings, stdlib_root, stdlib_source_files
from trainer.data.cache import cached_tokens
from trainer.data.datasets import PackedWindowDataset, SyntheticDataset, tokenize_documents

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEBUG_TOKENIZER = os.path.join(REPO, "assets", "tokenizer", "tokenizer.model")

DOCS = [
    "The quick brown fox jumps over the lazy dog.",
    "Ünïcödé text: 你好，世界 🎉",
    "def f(x):\n    return x + 1\n",
    "A fourth, longer document. " * 30,
    "short",
]


@pytest.fixture(autouse=True)
def _cache_in_tmp(tmp_path, monkeypatch):
    monkeypatch.setenv("TITAN_DATA_CACHE", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(DEBUG_TOKENIZER)


def _loader(tok, **kw):
    args = dict(dataset="files", dataset_path=None, tokenizer=tok, seq_len=16, local_batch_size=2,
                dp_rank=0, dp_world_size=1, seed=0)
    args.update(kw)
    return build_dataloader(**args)


def _take(it, n):
    return [next(it) for _ in range(n)]


def _same(a, b):
    return len(a) == len(b) and all(torch.equal(x[0], y[0]) and torch.equal(x[1], y[1]) for x, y in zip(a, b))


def _write_corpus(folder, n_docs=60):
    """A small folder: a .txt, a .jsonl, a nested .jsonl, and files to ignore."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "a.txt").write_text(DOCS[0])
    with open(folder / "b.jsonl", "w") as f:
        for i in range(n_docs):
            f.write(json.dumps({"text": f"{DOCS[i % len(DOCS)]} #{i}", "id": i}) + "\n")
    (folder / "sub").mkdir(exist_ok=True)
    with open(folder / "sub" / "c.jsonl", "w") as f:
        f.write(json.dumps({"text": DOCS[1]}) + "\n\n")
        f.write(json.dumps({"meta": "no text field"}) + "\n")
    (folder / "notes.md").write_text("ignored")
    (folder / ".hidden.txt").write_text("ignored")
    return folder


# ----------------------------------------------------------------------------- packing


def test_pack_documents_bos_eos(tok):
    tokens, n = tokenize_documents(tok, DOCS + [""])
    assert n == len(DOCS)
    expected = [i for d in DOCS for i in tok.encode(d, bos=True, eos=True)]
    assert tokens.dtype == np.uint16
    assert tokens.tolist() == expected
    assert tok.decode(tokens.tolist()) == "".join(f"<|begin_of_text|>{d}<|end_of_text|>" for d in DOCS)


def test_windows_and_shifted_labels():
    seq = 8
    tokens = np.arange(1000, dtype=np.uint16)
    ds = PackedWindowDataset(tokens, seq_len=seq, local_batch_size=4, dp_rank=0, dp_world_size=1, seed=3)
    assert ds.num_windows == (1000 - 1) // seq
    it = iter(ds)
    for _ in range(ds.batches_per_epoch + 3):
        x, y = next(it)
        assert x.shape == y.shape == (4, seq) and x.dtype == y.dtype == torch.int64
        assert x.is_contiguous() and y.is_contiguous()
        assert torch.equal(y, x + 1)  # labels are inputs shifted by one
        assert torch.all(x[:, 0] % seq == 0)  # windows start on multiples of seq_len


def test_files_loader_packs_documents(tmp_path, tok):
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS * 4))
    dl = _loader(tok, dataset_path=str(path), seq_len=32, seed=1)
    ds = dl.dataset
    expected = np.array([i for d in DOCS * 4 for i in tok.encode(d, bos=True, eos=True)])
    assert np.array_equal(np.asarray(ds.tokens), expected)
    x, y = next(iter(dl))
    assert x.shape == (2, 32) and torch.equal(x[:, 1:], y[:, :-1])
    for row_x, row_y, w in zip(x, y, ds.windows(0)):  # each row is window w of the packed stream
        full = torch.cat([row_x, row_y[-1:]])
        assert torch.equal(full, torch.from_numpy(expected[int(w) * 32:int(w) * 32 + 33]))


# ----------------------------------------------------------------------------- sharding and epochs


@pytest.mark.parametrize("world", [2, 3])
def test_dp_sharding_disjoint_and_equal(world):
    seq, bs = 4, 3
    tokens = np.arange(4 * 100 + 1, dtype=np.uint16)  # 100 windows
    streams = [PackedWindowDataset(tokens, seq_len=seq, local_batch_size=bs, dp_rank=r, dp_world_size=world,
                                   seed=7) for r in range(world)]
    bpe = streams[0].batches_per_epoch
    assert bpe == 100 // (world * bs) and all(s.batches_per_epoch == bpe for s in streams)
    for epoch in range(2):
        seen = []
        for s in streams:
            it = iter(s)
            if epoch:
                _take(it, bpe)  # skip epoch 0
            rank_windows = [int(w) for x, _ in _take(it, bpe) for w in (x[:, 0] // seq)]
            assert len(rank_windows) == bpe * bs
            seen.append(rank_windows)
        union = [w for r in seen for w in r]
        assert len(union) == len(set(union)) == bpe * bs * world
        assert set(union) <= set(range(100))


def test_epochs_reshuffle_deterministically():
    tokens = np.arange(4 * 64 + 1, dtype=np.uint16)
    make = lambda seed: PackedWindowDataset(tokens, seq_len=4, local_batch_size=4, dp_rank=0, dp_world_size=1, seed=seed)
    a = make(5)
    order = [x[:, 0].tolist() for x, _ in _take(iter(a), 3 * a.batches_per_epoch)]
    e0, e1, e2 = (sum(order[i * 16:(i + 1) * 16], []) for i in range(3))
    assert sorted(e0) == sorted(e1) == sorted(e2) == list(range(0, 256, 4))  # 64 windows, none dropped
    assert e0 != e1 and e1 != e2
    again = [x[:, 0].tolist() for x, _ in _take(iter(make(5)), 3 * a.batches_per_epoch)]
    assert again == order
    other = [x[:, 0].tolist() for x, _ in _take(iter(make(6)), a.batches_per_epoch)]
    assert other != order[:a.batches_per_epoch]


# ----------------------------------------------------------------------------- resume


@pytest.mark.parametrize("where", ["start", "middle", "epoch_end"])
def test_resume_exact(tmp_path, tok, where):
    data = _write_corpus(tmp_path / "data")
    kw = dict(dataset_path=str(data), seq_len=32, local_batch_size=8, seed=11)
    dl = _loader(tok, **kw)
    bpe = dl.dataset.batches_per_epoch
    assert 3 < bpe < 20
    k = {"start": 0, "middle": 3, "epoch_end": bpe - 1}[where]
    it = iter(dl)
    _take(it, k)
    state = pickle.loads(pickle.dumps(dl.state_dict()))
    expected = _take(it, 20)  # spans into the next epoch
    fresh = _loader(tok, **kw)
    fresh.load_state_dict(state)
    assert _same(_take(iter(fresh), 20), expected)
    # a loader without the state starts from the beginning instead
    if k:
        assert not _same(_take(iter(_loader(tok, **kw)), 20), expected)


def test_resume_state_before_iteration(tmp_path, tok):
    data = _write_corpus(tmp_path / "data")
    dl = _loader(tok, dataset_path=str(data))
    state = dl.state_dict()
    first = _take(iter(_loader(tok, dataset_path=str(data))), 4)
    fresh = _loader(tok, dataset_path=str(data))
    fresh.load_state_dict(state)
    assert _same(_take(iter(fresh), 4), first)


def test_workers_same_stream_and_resume(tmp_path, tok):
    data = _write_corpus(tmp_path / "data")
    kw = dict(dataset_path=str(data), seq_len=32, local_batch_size=8, seed=2)
    reference = _take(iter(_loader(tok, **kw)), 20)
    dl = _loader(tok, num_workers=2, **kw)
    it = iter(dl)
    head = _take(it, 13)
    assert all(isinstance(b, tuple) for b in head)
    assert _same(head, reference[:13])  # worker count does not change the stream
    state = dl.state_dict()
    tail = _take(it, 7)
    assert _same(tail, reference[13:])
    fresh = _loader(tok, num_workers=2, **kw)
    fresh.load_state_dict(state)
    assert _same(_take(iter(fresh), 7), tail)


def test_resume_with_other_world_size_is_approximate(caplog):
    tokens = np.arange(4 * 120 + 1, dtype=np.uint16)
    old = PackedWindowDataset(tokens, seq_len=4, local_batch_size=2, dp_rank=0, dp_world_size=2, seed=0)
    state = {**old.state_dict(), "next_batch": old.batches_per_epoch + old.batches_per_epoch // 2}
    new = PackedWindowDataset(tokens, seq_len=4, local_batch_size=2, dp_rank=0, dp_world_size=3, seed=0)
    new.load_state_dict(state)
    assert new.state_dict()["next_batch"] == new.batches_per_epoch + new.batches_per_epoch // 2
    assert "resuming approximately" in caplog.text


# ----------------------------------------------------------------------------- synthetic


def test_synthetic_deterministic_and_resumable(tok):
    kw = dict(dataset="synthetic", dataset_path=None, tokenizer=tok, seq_len=8, local_batch_size=2, seed=4)
    r0 = _take(iter(build_dataloader(dp_rank=0, dp_world_size=2, **kw)), 6)
    r0b = _take(iter(build_dataloader(dp_rank=0, dp_world_size=2, **kw)), 6)
    r1 = _take(iter(build_dataloader(dp_rank=1, dp_world_size=2, **kw)), 6)
    assert _same(r0, r0b) and not torch.equal(r0[0][0], r1[0][0])
    assert all(isinstance(b, tuple) and len(b) == 2 for b in r0)
    for x, y in r0:
        assert x.shape == (2, 8) and x.dtype == torch.int64 and torch.equal(x[:, 1:], y[:, :-1])
        assert int(x.min()) >= 0 and int(x.max()) < tok.vocab_size
    ds = SyntheticDataset(vocab_size=tok.vocab_size, seq_len=8, local_batch_size=2, dp_rank=0, seed=4)
    assert torch.equal(ds.make_batch(5)[0], r0[5][0])  # batch = f(seed, rank, index)
    dl = build_dataloader(dp_rank=0, dp_world_size=2, **kw)
    it = iter(dl)
    _take(it, 2)
    state = dl.state_dict()
    fresh = build_dataloader(dp_rank=0, dp_world_size=2, **kw)
    fresh.load_state_dict(state)
    assert _same(_take(iter(fresh), 4), r0[2:])


# ----------------------------------------------------------------------------- files


def test_txt_jsonl_folder(tmp_path, tok):
    data = _write_corpus(tmp_path / "data", n_docs=3)
    ds = build_dataset(dataset="files", dataset_path=str(data), tokenizer=tok, seq_len=8, local_batch_size=1,
                       dp_rank=0, dp_world_size=1, seed=0)
    # a.txt, then b.jsonl, then sub/c.jsonl; .md, hidden files and text-less lines are skipped
    docs = [DOCS[0]] + [f"{DOCS[i]} #{i}" for i in range(3)] + [DOCS[1]]
    assert tok.decode(np.asarray(ds.tokens).tolist()) == "".join(
        f"<|begin_of_text|>{d}<|end_of_text|>" for d in docs)
    # a single .txt file is one document
    ds_txt = build_dataset(dataset="files", dataset_path=str(data / "a.txt"), tokenizer=tok, seq_len=4,
                           local_batch_size=1, dp_rank=0, dp_world_size=1, seed=0)
    assert np.asarray(ds_txt.tokens).tolist() == tok.encode(DOCS[0], bos=True, eos=True)


def _err(tok, path, **kw):
    with pytest.raises(ConfigError) as e:
        build_dataset(dataset="files", dataset_path=path, tokenizer=tok, seq_len=kw.get("seq_len", 8),
                      local_batch_size=1, dp_rank=0, dp_world_size=1, seed=0)
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def test_file_errors(tmp_path, tok):
    assert "training.dataset_path" in _err(tok, None)
    msg = _err(tok, str(tmp_path / "missing"))
    assert "training.dataset_path" in msg and "does not exist" in msg and "--training.dataset_path" in msg
    (tmp_path / "empty").mkdir()
    assert "no .txt or .jsonl files" in _err(tok, str(tmp_path / "empty"))
    (tmp_path / "x.csv").write_text("a,b")
    assert "not a .txt or .jsonl file" in _err(tok, str(tmp_path / "x.csv"))
    (tmp_path / "notext.jsonl").write_text('{"body": "x"}\n{"text": ""}\n')
    assert "no usable text" in _err(tok, str(tmp_path / "notext.jsonl"))
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{"text": broken\n')
    msg = _err(tok, str(tmp_path / "bad.jsonl"))
    assert "bad.jsonl:2" in msg and "not valid JSON" in msg
    (tmp_path / "tiny.txt").write_text("tiny")
    msg = _err(tok, str(tmp_path / "tiny.txt"), seq_len=64)
    assert "training.seq_len" in msg
    with pytest.raises(ConfigError, match="training.dataset"):
        build_dataset(dataset="c4", dataset_path=None, tokenizer=tok, seq_len=8, local_batch_size=1,
                      dp_rank=0, dp_world_size=1, seed=0)


def test_files_cache_invalidated_on_change(tmp_path, tok):
    path = tmp_path / "d.txt"
    path.write_text("first version of the text " * 10)
    a = build_dataset(dataset="files", dataset_path=str(path), tokenizer=tok, seq_len=4, local_batch_size=1,
                      dp_rank=0, dp_world_size=1, seed=0)
    path.write_text("second, different text " * 12)
    os.utime(path, ns=(1, 1))
    b = build_dataset(dataset="files", dataset_path=str(path), tokenizer=tok, seq_len=4, local_batch_size=1,
                      dp_rank=0, dp_world_size=1, seed=0)
    assert tok.decode(np.asarray(b.tokens).tolist()).startswith("<|begin_of_text|>second")
    assert not np.array_equal(np.asarray(a.tokens), np.asarray(b.tokens))


# ----------------------------------------------------------------------------- builtin corpus


def test_stdlib_file_selection():
    root = stdlib_root()
    files = [os.path.relpath(f, root) for f in stdlib_source_files()]
    assert files == sorted(files) and len(files) > 100
    assert "os.py" in files and "json/__init__.py" in files
    for rel in files:
        parts = rel.split(os.sep)
        assert not {"test", "tests", "idlelib", "site-packages", "__pycache__"} & set(parts), rel
        assert not parts[-1].startswith("test_"), rel


def test_docstrings_are_parsed_not_imported(tmp_path):
    src = tmp_path / "mod.py"
    src.write_text('"""Module doc."""\nimport sys\nsys.modules["_titan_side_effect"] = 1\n'
                   'class A:\n    """Class doc."""\n    def m(self):\n        """Method doc."""\n'
                   '        def inner():\n            """Inner doc."""\n'
                   'if True:\n    def g():\n        """Guarded doc."""\n'
                   'try:\n    pass\nexcept ImportError:\n    def h():\n        """Handler doc."""\n'
                   'def f():\n    """Func doc."""\n')
    assert file_docstrings(str(src)) == ["Module doc.", "Class doc.", "Method doc.", "Inner doc.", "Guarded doc.",
                                         "Handler doc.", "Func doc."]
    assert "_titan_side_effect" not in sys.modules
    (tmp_path / "broken.py").write_text("def (:\n")
    assert file_docstrings(str(tmp_path / "broken.py")) == []
    docs = builtin_documents(max_files=15)
    assert docs and docs == builtin_documents(max_files=15) and len(set(docs)) == len(docs)
    assert "antigravity" not in sys.modules and "this" not in sys.modules


def _small_builtin(monkeypatch):
    calls = []

    def docs():
        calls.append(1)
        return builtin_documents(max_files=30)

    monkeypatch.setattr(datasets_mod, "builtin_documents", docs)
    return calls


def test_builtin_cached(tmp_path, tok, monkeypatch):
    calls = _small_builtin(monkeypatch)
    kw = dict(dataset="builtin", dataset_path=None, tokenizer=tok, seq_len=32, local_batch_size=2,
              dp_rank=1, dp_world_size=2, seed=0)
    a = build_dataloader(**kw)
    b = build_dataloader(**kw)
    assert len(calls) == 1  # second build read the cache
    cache = tmp_path / "cache"
    names = os.listdir(cache)
    npy = [n for n in names if n.endswith(".npy")]
    assert len(npy) == 1 and npy[0].startswith("builtin-py%d.%d." % sys.version_info[:2])
    assert tok.file_hash[:16] in npy[0]
    assert not [n for n in names if n.endswith(".tmp")]
    arr = np.load(cache / npy[0])
    assert arr.dtype == np.uint16 and len(arr) == a.dataset.num_tokens > 1000
    assert arr[0] == tok.bos_id and arr[-1] == tok.eos_id
    assert _same(_take(iter(a), 3), _take(iter(b), 3))


def _build_in_child(args):
    path_env, out = args
    os.environ["TITAN_DATA_CACHE"] = path_env
    import time

    def build():
        with open(out, "a") as f:
            f.write("built\n")
        time.sleep(0.3)
        return np.arange(1000, dtype=np.uint16)

    arr, _, _ = cached_tokens("concurrent", build)
    return int(arr.sum())


def test_cache_concurrent_builders_build_once(tmp_path):
    log = tmp_path / "builds.txt"
    ctx = mp.get_context("fork")
    with ctx.Pool(3) as pool:
        sums = pool.map(_build_in_child, [(str(tmp_path / "cache"), str(log))] * 3)
    assert sums == [sum(range(1000))] * 3
    assert log.read_text().count("built") == 1
    assert not [n for n in os.listdir(tmp_path / "cache") if n.endswith(".tmp")]


def test_cache_unwritable_falls_back_to_memory(tmp_path, monkeypatch):
    blocker = tmp_path / "file_not_dir"
    blocker.write_text("x")
    monkeypatch.setenv("TITAN_DATA_CACHE", str(blocker / "cache"))
    arr, _, built = cached_tokens("x", lambda: np.arange(5, dtype=np.uint16))
    assert built and arr.tolist() == [0, 1, 2, 3, 4]
