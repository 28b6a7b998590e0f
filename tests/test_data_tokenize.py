"""scripts/tokenize_data.py and the shard reader: round trip, worker independence, kill/rerun
byte-identity, partial folders refused, tokenizer mismatch refused."""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.helpers import REPO, run_killing_group
from configuration.fields import ConfigError
from trainer.data import DataConfig, build_dataloader, build_tokenizer, tokenize_documents
from trainer.data.pretokenize import KILL_ENV, tokenize_to_shards
from trainer.data.shards import TokenShards
from trainer.data.windows import ArrayWindows, ShardWindows

TOKENIZER = str(REPO / "assets" / "tokenizer" / "tokenizer.model")
WORDS = "alpha beta gamma delta tokens shard memory map ünï 你好 🎉 the of and".split()


def _docs(n, seed):
    rng = random.Random(seed)
    return [" ".join(rng.choices(WORDS, k=rng.randint(3, 120))) for _ in range(n)]


def _corpus(folder: Path) -> list[str]:
    """A .jsonl (with blank and text-less lines), a .jsonl.gz and a .parquet; returns the documents in order."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder.mkdir(parents=True, exist_ok=True)
    a, b, c = _docs(400, 1), _docs(150, 2), _docs(120, 3)
    with open(folder / "a.jsonl", "w") as f:
        for i, d in enumerate(a):
            f.write(json.dumps({"text": d}) + "\n")
            if i % 50 == 0:
                f.write("\n" + json.dumps({"other": 1}) + "\n")
    with gzip.open(folder / "b.jsonl.gz", "wt") as f:
        f.writelines(json.dumps({"text": d}) + "\n" for d in b)
    pq.write_table(pa.table({"text": c}), folder / "c.parquet", row_group_size=50)
    return a + b + c


def _digest(folder: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(folder.iterdir()):
        h.update(p.name.encode() + b"\0" + p.read_bytes())
    return h.hexdigest()


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(TOKENIZER)


def test_round_trip_equals_in_memory_tokenization(tmp_path, tok):
    docs = _corpus(tmp_path / "in")
    expected, n_docs = tokenize_documents(tok, docs)
    outs = {}
    for workers in (1, 2):
        out = tmp_path / f"out{workers}"
        m = tokenize_to_shards([str(tmp_path / "in")], str(out), TOKENIZER, workers=workers, shard_tokens=5000,
                               chunk_chars=3000, progress_bar=False)
        assert m["docs"] == n_docs and m["tokens"] == len(expected) and m["skipped_records"] == 2 * 8
        outs[workers] = out
    assert _digest(outs[1]) == _digest(outs[2])  # the worker count does not change a byte
    shards = TokenShards(str(outs[2]))
    assert len(shards.shards) > 5 and shards.dtype == np.uint16
    flat = np.concatenate([np.asarray(shards.tokens(k)) for k in range(len(shards.shards))])
    assert np.array_equal(flat, expected)
    # the index gives every document back: [BOS] text [EOS]
    texts = []
    for k in range(len(shards.shards)):
        starts, toks = np.asarray(shards.doc_starts(k)), np.asarray(shards.tokens(k))
        assert starts[-1] == len(toks)
        texts += [tok.decode(toks[s:e].tolist()) for s, e in zip(starts[:-1], starts[1:])]
    assert texts == [f"<|begin_of_text|>{d}<|end_of_text|>" for d in docs]
    # windows: shard by shard, each equal to windowing that shard's tokens in memory
    seq = 32
    windows = ShardWindows(shards, seq, "t")
    rows = windows.rows(np.arange(windows.num_windows))
    reference = np.concatenate([ArrayWindows(np.asarray(shards.tokens(k)), seq, "a").rows(
        np.arange((shards.shards[k].tokens - 1) // seq)) for k in range(len(shards.shards))])
    assert np.array_equal(rows, reference)
    # through the loader: a tokens source reads the same windows
    dl = build_dataloader(DataConfig(type="tokens", path=str(outs[2])), tokenizer=tok, tokenizer_path=TOKENIZER,
                          seq_len=seq, local_batch_size=4, dp_rank=0, dp_world_size=1, seed=0)
    x, y = next(iter(dl))
    full_rows = np.concatenate([x.numpy(), y.numpy()[:, -1:]], axis=1)
    assert all((reference == r).all(axis=1).any() for r in full_rows)


def _run_script(inp, out, env_kill=None):
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    env.pop(KILL_ENV, None)
    if env_kill:
        env[KILL_ENV] = env_kill
    cmd = [sys.executable, str(REPO / "scripts" / "tokenize_data.py"), "--input", str(inp), "--output", str(out),
           "--workers", "2", "--shard-tokens", "4000", "--chunk-chars", "2500", "--no-progress"]
    return run_killing_group(cmd, cwd=REPO, env=env, timeout=120)


def test_killed_runs_resume_byte_identical(tmp_path, tok):
    _corpus(tmp_path / "in")
    clean = tmp_path / "clean"
    assert _run_script(tmp_path / "in", clean).returncode == 0
    rng = random.Random(14)
    # each rerun resumes, then dies at the next point (counted from its own start); the last dies
    # with every shard durable, just before the manifest
    points = [("chunk", rng.randint(1, 20)), ("shard", rng.randint(1, 4)), ("progress", rng.randint(1, 4)),
              ("chunk", rng.randint(1, 10)), ("manifest", 1)]
    out = tmp_path / "killed"
    for point, count in points:
        proc = _run_script(tmp_path / "in", out, f"{point}:{count}")
        assert proc.returncode == -9, (point, count, proc.stdout, proc.stderr)
        assert not (out / "manifest.json").exists()
        with pytest.raises(ConfigError, match="only partly tokenized"):  # a reader never takes a partial folder
            TokenShards(str(out))
    assert _run_script(tmp_path / "in", out).returncode == 0
    assert _digest(out) == _digest(clean)
    assert _run_script(tmp_path / "in", out).returncode == 0 and _digest(out) == _digest(clean)  # a no-op
    # a rerun with other settings into the same folder is refused, in one line
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    bad = subprocess.run([sys.executable, str(REPO / "scripts" / "tokenize_data.py"), "--input", str(tmp_path / "in"),
                          "--output", str(out), "--shard-tokens", "999", "--no-progress"], env=env,
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "already holds a finished dataset" in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1


def test_reader_refuses_damage_and_other_tokenizers(tmp_path, tok):
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in _docs(50, 5)))
    out = tmp_path / "out"
    tokenize_to_shards([str(tmp_path / "in.jsonl")], str(out), TOKENIZER, workers=1, progress_bar=False)
    with pytest.raises(ConfigError, match="another tokenizer"):
        TokenShards(str(out), expect_tokenizer_hash="0" * 64)
    with open(out / "shard-00000.bin", "ab") as f:
        f.write(b"\0\0")
    with pytest.raises(ConfigError, match="damaged"):
        TokenShards(str(out))
    with pytest.raises(ConfigError, match="no manifest.json"):
        TokenShards(str(tmp_path))
    with pytest.raises(ConfigError, match="does not exist"):
        TokenShards(str(tmp_path / "missing"))
    with pytest.raises(ConfigError, match="none of the 50 records .* has a non-empty 'body' text"):
        tokenize_to_shards([str(tmp_path / "in.jsonl")], str(tmp_path / "wrong"), TOKENIZER, text_field="body",
                           progress_bar=False)


def test_token_folder_with_other_bos_eos_ids_is_refused_before_launch(tmp_path, tok, capsys):
    """Same tokenizer file (hash), other BOS/EOS ids in the manifest (as a model folder's
    generation_config.json can give): refused by the loader and by the pre-launch check, in
    one line naming the folder, both id pairs and the fix, exit 2."""
    from trainer.preflight import main as preflight

    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in _docs(30, 7)))
    out = tmp_path / "out"
    tokenize_to_shards([str(tmp_path / "in.jsonl")], str(out), TOKENIZER, workers=1, progress_bar=False)
    args = ["--data.type", "tokens", "--data.path", str(out), "--model.tokenizer_path", TOKENIZER,
            "--job.dump_folder", str(tmp_path / "run")]
    assert preflight(["--check-config", *args]) == 0  # the folder as written passes
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["tokenizer"]["eos_id"] = tok.eos_id + 3
    (out / "manifest.json").write_text(json.dumps(manifest))
    want = (f"config error: data source 'out' path: {out} was tokenized with BOS/EOS ids {tok.bos_id}/"
            f"{tok.eos_id + 3} (manifest.json), but this run's tokenizer has {tok.bos_id}/{tok.eos_id}; "
            "retokenize it with this tokenizer (scripts/tokenize_data.py) or set model.tokenizer_path to the one "
            "it was made with")
    with pytest.raises(ConfigError) as e:
        build_dataloader(DataConfig(type="tokens", path=str(out)), tokenizer=tok, tokenizer_path=TOKENIZER,
                         seq_len=16, local_batch_size=2, dp_rank=0, dp_world_size=1, seed=0)
    assert str(e.value) == want
    capsys.readouterr()
    assert preflight(["--check-config", *args]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [want]


def test_non_utf8_bytes_are_counted_and_named_once(tmp_path, caplog):
    """Bytes that are not UTF-8 (a Latin-1 file) are read as U+FFFD, as before, but counted and
    named in one warning per file, by the trainer's reader and by scripts/tokenize_data.py."""
    from trainer.data.documents import file_records

    inp = tmp_path / "in"
    inp.mkdir()
    (inp / "latin.txt").write_bytes("café olé naïve".encode("latin-1"))  # 3 bad bytes
    (inp / "latin.jsonl").write_bytes(b'{"text": "fine"}\n{"text": "gar\xe7on \xff"}\n')  # 2 bad bytes
    (inp / "clean.jsonl").write_text(json.dumps({"text": "ünï 你好"}) + "\n")
    with caplog.at_level("WARNING", logger="trainer.data.documents"):
        for _ in range(2):  # a second pass (an epoch) warns no more
            assert list(file_records(str(inp / "latin.txt"))) == ["caf\ufffd ol\ufffd na\ufffdve"]
            assert list(file_records(str(inp / "latin.jsonl"))) == ["fine", "gar\ufffdon \ufffd"]
            assert list(file_records(str(inp / "clean.jsonl"))) == ["ünï 你好"]
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 2
    assert "latin.txt: 3 bytes are not valid UTF-8" in warnings[0]
    assert "latin.jsonl: 2 bytes are not valid UTF-8" in warnings[1]
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "tokenize_data.py"), "--input", str(inp),
                           "--output", str(tmp_path / "out"), "--workers", "1", "--no-progress"],
                          env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    named = [ln for ln in proc.stderr.splitlines() if "not valid UTF-8" in ln]
    assert len(named) == 2 and "latin.jsonl: 2 bytes" in named[0] and "latin.txt: 3 bytes" in named[1], proc.stderr
