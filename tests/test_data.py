"""Data pipeline: packing, global shuffle, dp sharding, exact resume (also on another dp
degree and worker count), mixtures, file inputs, builtin corpus, cache."""

from __future__ import annotations

import gzip
import json
import multiprocessing as mp
import os
import pickle
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import trainer.data.datasets as datasets_mod
from configuration.fields import ConfigError
from trainer.data import DataConfig, build_dataloader, build_tokenizer
from trainer.data.builtin_corpus import builtin_documents, file_docstrings, stdlib_root, stdlib_source_files
from trainer.data.cache import cached_tokens
from trainer.data.config import parse_sources
from trainer.data.datasets import tokenize_documents
from trainer.data.sampling import Mixture, Permutation, derive_keys
from trainer.data.shards import tokenizer_hash
from trainer.data.stream import DataLoader, MixtureStream
from trainer.data.windows import ArrayWindows

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


def _loader(tok, data=None, **kw):
    args = dict(tokenizer=tok, tokenizer_path=DEBUG_TOKENIZER, seq_len=16, local_batch_size=2, dp_rank=0,
                dp_world_size=1, seed=0)
    args.update(kw)
    return build_dataloader(data or DataConfig(), **args)


def _array_loader(tokens, *, seq=4, bs=2, rank=0, world=1, seed=0, workers=0, sources=None, weights=None):
    sources = sources or [ArrayWindows(tokens, seq, "arr")]
    stream = MixtureStream(sources, weights or [1.0] * len(sources), seq_len=seq, local_batch_size=bs,
                           dp_rank=rank, dp_world_size=world, seed=seed)
    return DataLoader(stream, num_workers=workers)


def _take(it, n):
    return [next(it) for _ in range(n)]


def _same(a, b):
    return len(a) == len(b) and all(torch.equal(x[0], y[0]) and torch.equal(x[1], y[1]) for x, y in zip(a, b))


def _starts(batches, seq):
    """Window index of every row (the tokens are np.arange, so row start / seq_len)."""
    return [int(v) for x, _ in batches for v in x[:, 0] // seq]


def _write_corpus(folder, n_docs=60):
    """A small folder: a .txt, a .jsonl, a nested .jsonl.gz, and files to ignore."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "a.txt").write_text(DOCS[0])
    with open(folder / "b.jsonl", "w") as f:
        for i in range(n_docs):
            f.write(json.dumps({"text": f"{DOCS[i % len(DOCS)]} #{i}", "id": i}) + "\n")
    (folder / "sub").mkdir(exist_ok=True)
    with gzip.open(folder / "sub" / "c.jsonl.gz", "wt") as f:
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
    dl = _array_loader(np.arange(1000, dtype=np.uint16), seq=seq, bs=4, seed=3)
    for x, y in _take(iter(dl), 40):
        assert x.shape == y.shape == (4, seq) and x.dtype == y.dtype == torch.int64
        assert x.is_contiguous() and y.is_contiguous()
        assert torch.equal(y, x + 1)  # labels are inputs shifted by one
        assert torch.all(x[:, 0] % seq == 0)  # windows start on multiples of seq_len


def test_permutation_is_a_bijection_and_keyed():
    for n in (1, 2, 3, 5, 64, 1000, 4097):
        y = Permutation(n, derive_keys(0, 1))(np.arange(n))
        assert sorted(y.tolist()) == list(range(n))
    a = Permutation(10**9, derive_keys(7, 0, 0))(np.arange(1000))
    b = Permutation(10**9, derive_keys(7, 0, 1))(np.arange(1000))
    assert len(set(a.tolist())) == 1000 and a.max() > 9 * 10**8 and not np.array_equal(a, b)


# ----------------------------------------------------------------------------- epochs and sharding


def test_epochs_cover_every_window_and_reshuffle():
    seq, n = 4, 64
    tokens = np.arange(seq * n + 1, dtype=np.uint16)
    order = _starts(_take(iter(_array_loader(tokens, seq=seq, bs=4, seed=5)), 3 * n // 4), seq)
    e0, e1, e2 = order[:n], order[n:2 * n], order[2 * n:]
    assert sorted(e0) == sorted(e1) == sorted(e2) == list(range(n))  # every window once per epoch
    assert e0 != e1 and e1 != e2
    assert _starts(_take(iter(_array_loader(tokens, seq=seq, bs=4, seed=5)), 3 * n // 4), seq) == order
    assert _starts(_take(iter(_array_loader(tokens, seq=seq, bs=4, seed=6)), n // 4), seq) != e0


@pytest.mark.parametrize("world", [2, 3])
def test_dp_ranks_split_the_global_stream(world):
    """dp rank r's batch k holds global samples [k*D*B + r*B, ... + B): the same stream as one rank."""
    seq, bs = 4, 3
    tokens = np.arange(seq * 100 + 1, dtype=np.uint16)
    reference = _starts(_take(iter(_array_loader(tokens, seq=seq, bs=bs * world, seed=7)), 40), seq)
    per_rank = [_starts(_take(iter(_array_loader(tokens, seq=seq, bs=bs, rank=r, world=world, seed=7)), 40), seq)
                for r in range(world)]
    interleaved = [w for k in range(40) for r in range(world) for w in per_rank[r][k * bs:(k + 1) * bs]]
    assert interleaved == reference
    first_epoch = interleaved[:100]
    assert len(set(first_epoch)) == 100  # no window twice within an epoch, across ranks


# ----------------------------------------------------------------------------- resume


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("workers", [0, 2])
def test_resume_mid_epoch_exact(world, workers):
    tokens = np.arange(4 * 50 + 1, dtype=np.uint16)  # 50 windows: 20 steps cross epochs
    for rank in range(world):
        kw = dict(seq=4, bs=2, rank=rank, world=world, seed=11, workers=workers)
        dl = _array_loader(tokens, **kw)
        it = iter(dl)
        _take(it, 7)
        state = pickle.loads(pickle.dumps(dl.state_dict()))
        expected = _take(it, 20)
        fresh = _array_loader(tokens, **kw)
        fresh.load_state_dict(state)
        assert _same(_take(iter(fresh), 20), expected)
        assert not _same(_take(iter(_array_loader(tokens, **kw)), 20), expected)  # without the state: other data


def test_resume_dp2_to_dp4_continues_the_global_stream():
    """Ranks of a larger dp all load dp rank 0's state (trainer/checkpoint.py): exact continuation."""
    seq, bs = 4, 2
    tokens = np.arange(seq * 90 + 1, dtype=np.uint16)
    reference = _starts(_take(iter(_array_loader(tokens, seq=seq, bs=1, seed=3)), 200), seq)  # the global stream
    old = [_array_loader(tokens, seq=seq, bs=bs, rank=r, world=2, seed=3) for r in range(2)]
    consumed = [_take(iter(dl), 5) for dl in old]
    assert [w for k in range(5) for r in range(2) for w in _starts(consumed[r][k:k + 1], seq)] == reference[:20]
    state = pickle.loads(pickle.dumps(old[0].state_dict()))
    new = [_array_loader(tokens, seq=seq, bs=bs, rank=r, world=4, seed=3, workers=2 if r == 1 else 0)
           for r in range(4)]
    for dl in new:
        dl.load_state_dict(state)
    resumed = [_starts(_take(iter(dl), 6), seq) for dl in new]
    assert [w for k in range(6) for r in range(4) for w in resumed[r][k * bs:(k + 1) * bs]] == reference[20:68]


def test_changed_sources_resume_approximately(caplog):
    tokens = np.arange(4 * 120 + 1, dtype=np.uint16)
    old = _array_loader(tokens)
    _take(iter(old), 3)
    new = _array_loader(tokens[:300])
    new.load_state_dict(old.state_dict())
    assert new.position["sample"] == 6 and "resuming approximately" in caplog.text


# ----------------------------------------------------------------------------- mixtures


def test_mixture_weights_within_2_percent_and_metrics(tok):
    weights = [0.6, 0.3, 0.1]
    for seed in (0, 1):
        counts = np.bincount(Mixture(weights, seed).sources(12345, 10_000), minlength=3) / 10_000
        assert np.all(np.abs(counts - weights) <= 0.02 * np.array(weights)), counts
    arrays = [np.arange(k * 1000, k * 1000 + 4 * 40 + 1, dtype=np.int64) for k in range(3)]
    sources = [ArrayWindows(a, 4, f"s{k}") for k, a in enumerate(arrays)]
    dl = _array_loader(None, seq=4, bs=10, sources=sources, weights=weights)
    batches = _take(iter(dl), 1000)  # 10k windows
    drawn = np.bincount([int(v) // 1000 for x, _ in batches for v in x[:, 0]], minlength=3) / 10_000
    assert np.all(np.abs(drawn - weights) <= 0.02 * np.array(weights)), drawn
    m = dl.metrics()
    assert [m[f"data/tokens/s{k}"] for k in range(3)] == [float(c * 10_000 * 4) for c in drawn]
    # resume keeps the per-source positions: the continuation equals the uninterrupted run
    dl2 = _array_loader(None, seq=4, bs=10, sources=sources, weights=weights)
    it = iter(dl2)
    _take(it, 500)
    fresh = _array_loader(None, seq=4, bs=10, sources=sources, weights=weights, workers=2)
    fresh.load_state_dict(dl2.state_dict())
    assert _same(_take(iter(fresh), 500), batches[500:])


def test_source_config_errors(tmp_path):
    (tmp_path / "x.jsonl").write_text('{"text": "hi"}\n')
    bad = [
        ([{"type": "c4", "path": "x"}], "data.sources[0].type: unknown source type 'c4'"),
        ([{"type": "tokens"}], "data.sources[0].path: a tokens source needs a path"),
        ([{"path": str(tmp_path), "weight": 0}], "data.sources[0].weight: expected a positive number"),
        ([{"path": str(tmp_path), "wieght": 2}], "unknown key(s) ['wieght']"),
        ([str(tmp_path), str(tmp_path)], "more than once"),
        ([3], "expected a table"),
    ]
    for items, fragment in bad:
        with pytest.raises(ConfigError) as e:
            parse_sources(items, "data.sources")
        assert fragment in str(e.value) and "\n" not in str(e.value)
    specs = parse_sources([{"path": str(tmp_path / "x.jsonl"), "weight": 2}, {"type": "builtin"}], "data.sources")
    assert [(s.type, s.name, s.weight) for s in specs] == [("files", "x.jsonl", 2.0), ("builtin", "builtin", 1.0)]


# ----------------------------------------------------------------------------- synthetic


def test_synthetic_deterministic_and_resumable(tok):
    data = DataConfig(type="synthetic")
    kw = dict(seq_len=8, local_batch_size=2, seed=4)
    r0 = _take(iter(_loader(tok, data, dp_rank=0, dp_world_size=2, **kw)), 6)
    r0b = _take(iter(_loader(tok, data, dp_rank=0, dp_world_size=2, **kw)), 6)
    r1 = _take(iter(_loader(tok, data, dp_rank=1, dp_world_size=2, **kw)), 6)
    assert _same(r0, r0b) and not torch.equal(r0[0][0], r1[0][0])
    for x, y in r0:
        assert x.shape == (2, 8) and x.dtype == torch.int64 and torch.equal(x[:, 1:], y[:, :-1])
        assert int(x.min()) >= 0 and int(x.max()) < tok.vocab_size
    dl = _loader(tok, data, dp_rank=0, dp_world_size=2, **kw)
    it = iter(dl)
    _take(it, 2)
    fresh = _loader(tok, data, dp_rank=0, dp_world_size=2, **kw)
    fresh.load_state_dict(dl.state_dict())
    assert _same(_take(iter(fresh), 4), r0[2:])


# ----------------------------------------------------------------------------- files


def _files_tokens(tok, path, **kw):
    dl = _loader(tok, DataConfig(type="files", path=str(path), **kw), seq_len=4, local_batch_size=1)
    return np.asarray(dl.dataset.sources[0].tokens).tolist()


def _expected(tok, docs):
    return [i for d in docs for i in tok.encode(d, bos=True, eos=True)]


def test_files_source_reads_every_format(tmp_path, tok):
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    data = _write_corpus(tmp_path / "data", n_docs=3)
    # a.txt, then b.jsonl, then sub/c.jsonl.gz; .md, hidden files and text-less records are skipped
    assert _files_tokens(tok, data) == _expected(tok, [DOCS[0]] + [f"{DOCS[i]} #{i}" for i in range(3)] + [DOCS[1]])
    assert _files_tokens(tok, data / "a.txt") == _expected(tok, DOCS[:1])  # a .txt file is one document
    with open(tmp_path / "z.jsonl.zst", "wb") as f:
        f.write(zstandard.ZstdCompressor().compress("".join(json.dumps({"body": d}) + "\n" for d in DOCS).encode()))
    assert _files_tokens(tok, tmp_path / "z.jsonl.zst", text_field="body") == _expected(tok, DOCS)
    table = pa.table({"content": DOCS, "n": list(range(len(DOCS)))})
    pq.write_table(table, tmp_path / "p.parquet", row_group_size=2)
    assert _files_tokens(tok, tmp_path / "p.parquet", text_field="content") == _expected(tok, DOCS)
    # a datasets.save_to_disk DatasetDict folder: arrow IPC streams listed in state.json
    split = tmp_path / "hf" / "train"
    split.mkdir(parents=True)
    for k, part in enumerate((DOCS[:2], DOCS[2:])):
        with pa.OSFile(str(split / f"data-0000{k}-of-00002.arrow"), "wb") as sink, \
                pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(pa.table({"content": part, "n": list(range(len(part)))}))
    (split / "state.json").write_text(json.dumps({"_data_files": [{"filename": f"data-0000{k}-of-00002.arrow"}
                                                                  for k in range(2)]}))
    (tmp_path / "hf" / "dataset_dict.json").write_text(json.dumps({"splits": ["train"]}))
    assert _files_tokens(tok, tmp_path / "hf", text_field="content") == _expected(tok, DOCS)


def test_whitespace_only_records_are_skipped_by_every_source(tmp_path, tok):
    """files, tokens (scripts/tokenize_data.py) and stream read the same documents from the same
    corpus: a whitespace-only record is no document in any of them (documents.usable_text)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from trainer.data.pretokenize import tokenize_to_shards
    from trainer.data.shards import TokenShards
    from trainer.data.streaming import TextStreamSource

    records = [DOCS[0], "   ", DOCS[1], "\n\t\n", "", DOCS[2], " \u3000 "]  # U+3000: ideographic space
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.jsonl").write_text("".join(json.dumps({"text": r}) + "\n" for r in records))
    pq.write_table(pa.table({"text": records[::-1]}), tmp_path / "in" / "b.parquet", row_group_size=4)
    (tmp_path / "in" / "c.txt").write_text(" \n\t ")  # a whole .txt file of whitespace
    docs = [r for r in records if r.strip()]
    expected = _expected(tok, docs + docs[::-1])

    assert _files_tokens(tok, tmp_path / "in") == expected
    manifest = tokenize_to_shards([str(tmp_path / "in")], str(tmp_path / "tokens"), DEBUG_TOKENIZER,
                                  progress_bar=False)
    shards = TokenShards(str(tmp_path / "tokens"))
    assert manifest["docs"] == 2 * len(docs) and manifest["skipped_records"] == 2 * (len(records) - len(docs)) + 1
    assert np.concatenate([np.asarray(shards.tokens(k)) for k in range(len(shards.shards))]).tolist() == expected

    seq = 8
    reader = TextStreamSource(str(tmp_path / "in"), DEBUG_TOKENIZER, seq_len=seq, seed=0, text_field="text",
                              name="s").reader(0, 1, None)
    rows = reader.take(-(-(len(expected) - 1) // seq))  # one epoch: windows share a boundary token
    stream = (rows[0].tolist() + rows[1:, 1:].ravel().tolist())[:len(expected)]
    bos = [i for i, t in enumerate(stream) if t == tok.bos_id] + [len(stream)]
    got = [tuple(stream[a:b]) for a, b in zip(bos[:-1], bos[1:])]  # the epoch's documents, in unit order
    assert sorted(got) == sorted(tuple(tok.encode(d, bos=True, eos=True)) for d in docs + docs[::-1])


def test_missing_text_column_is_one_message_for_files_and_stream(tmp_path, tok):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from trainer.data.streaming import TextStreamSource

    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "p.parquet")
    files_msg = _err(tok, str(tmp_path / "p.parquet"))
    reader = TextStreamSource(str(tmp_path / "p.parquet"), DEBUG_TOKENIZER, seq_len=8, seed=0, text_field="text",
                              name="s").reader(0, 1, None)
    with pytest.raises(ConfigError) as e:
        reader.take(1)
    assert files_msg == str(e.value) and "no column 'text' (columns: ['body'])" in files_msg


def _err(tok, path, seq_len=8, **kw):
    with pytest.raises(ConfigError) as e:
        _loader(tok, DataConfig(type="files", path=path, **kw), seq_len=seq_len, local_batch_size=1)
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def test_file_errors(tmp_path, tok):
    msg = _err(tok, str(tmp_path / "missing"))
    assert "data source" in msg and "does not exist" in msg
    (tmp_path / "empty").mkdir()
    assert "no supported files" in _err(tok, str(tmp_path / "empty"))
    (tmp_path / "x.csv").write_text("a,b")
    assert "not a supported file" in _err(tok, str(tmp_path / "x.csv"))
    (tmp_path / "notext.jsonl").write_text('{"body": "x"}\n{"text": ""}\n')
    assert "no usable text" in _err(tok, str(tmp_path / "notext.jsonl"))
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{"text": broken\n')
    msg = _err(tok, str(tmp_path / "bad.jsonl"))
    assert "bad.jsonl:2" in msg and "not valid JSON" in msg
    (tmp_path / "tiny.txt").write_text("tiny")
    assert "training.seq_len" in _err(tok, str(tmp_path / "tiny.txt"), seq_len=64)
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "p.parquet")
    assert "no column 'text'" in _err(tok, str(tmp_path / "p.parquet"))


def test_files_cache_invalidated_on_change(tmp_path, tok):
    path = tmp_path / "d.txt"
    path.write_text("first version of the text " * 10)
    a = _files_tokens(tok, path)
    path.write_text("second, different text " * 12)
    os.utime(path, ns=(1, 1))
    b = _files_tokens(tok, path)
    assert tok.decode(b).startswith("<|begin_of_text|>second") and a != b


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
    kw = dict(seq_len=32, local_batch_size=2, dp_rank=1, dp_world_size=2)
    a = _loader(tok, DataConfig(type="builtin"), **kw)
    b = _loader(tok, DataConfig(type="builtin"), **kw)
    assert len(calls) == 1  # second build read the cache
    cache = tmp_path / "cache"
    names = os.listdir(cache)
    npy = [n for n in names if n.endswith(".npy")]
    assert len(npy) == 1 and npy[0].startswith("builtin-py%d.%d." % sys.version_info[:2])
    assert tokenizer_hash(DEBUG_TOKENIZER)[:16] in npy[0]
    assert not [n for n in names if n.endswith(".tmp")]
    arr = np.load(cache / npy[0])
    assert arr.dtype == np.uint16 and len(arr) == len(a.dataset.sources[0].tokens) > 1000
    assert arr[0] == tok.bos_id and arr[-1] == tok.eos_id
    assert _same(_take(iter(a), 3), _take(iter(b), 3))


def _build_in_child(path_env: str, log: str, result: str) -> None:
    os.environ["TITAN_DATA_CACHE"] = path_env
    import time

    def build():
        with open(log, "a") as f:
            f.write("built\n")
        time.sleep(0.3)
        return np.arange(1000, dtype=np.uint16)

    arr, _, _ = cached_tokens("concurrent", build)
    Path(result).write_text(str(int(arr.sum())))


@pytest.mark.timeout(300)
def test_cache_concurrent_builders_build_once(tmp_path):
    log = tmp_path / "builds.txt"
    # Plain spawned processes, results in files: a forked Pool can deadlock on its queue lock in a
    # process (pytest + torch) that has other threads.
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_build_in_child, args=(str(tmp_path / "cache"), str(log), str(tmp_path / f"sum{i}")))
             for i in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=240)
        assert p.exitcode == 0, p.exitcode
    sums = [int((tmp_path / f"sum{i}").read_text()) for i in range(3)]
    assert sums == [sum(range(1000))] * 3
    assert log.read_text().count("built") == 1
    assert not [n for n in os.listdir(tmp_path / "cache") if n.endswith(".tmp")]


def test_cache_unwritable_falls_back_to_memory(tmp_path, monkeypatch):
    blocker = tmp_path / "file_not_dir"
    blocker.write_text("x")
    monkeypatch.setenv("TITAN_DATA_CACHE", str(blocker / "cache"))
    arr, _, built = cached_tokens("x", lambda: np.arange(5, dtype=np.uint16))
    assert built and arr.tolist() == [0, 1, 2, 3, 4]
