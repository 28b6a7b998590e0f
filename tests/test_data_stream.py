"""Raw-text streaming: tokenized on the fly in DataLoader workers, packed like the shards,
exact resume, readers disjoint across dp ranks and workers."""

from __future__ import annotations

import itertools
import json
import pickle
import re

import pytest
import torch

from tests.helpers import REPO
from configuration.fields import ConfigError
from trainer.data import DataConfig, build_dataloader, build_tokenizer

TOKENIZER = str(REPO / "assets" / "tokenizer" / "tokenizer.model")


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(TOKENIZER)


def _corpus(folder, files=4, docs=40):
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder.mkdir(parents=True, exist_ok=True)
    texts = {}
    for f in range(files):
        body = [f"file {f} document {d}: " + "word " * (d % 17 + 3) for d in range(docs)]
        if f == files - 1:  # one parquet file with 2 row groups
            pq.write_table(pa.table({"text": body}), folder / f"f{f}.parquet", row_group_size=docs // 2)
        else:
            (folder / f"f{f}.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in body))
        texts[f] = body
    return texts


def _loader(tok, path, *, rank=0, world=1, workers=0, seq=16, bs=2):
    return build_dataloader(DataConfig(type="stream", path=str(path), num_workers=workers), tokenizer=tok,
                            tokenizer_path=TOKENIZER, seq_len=seq, local_batch_size=bs, dp_rank=rank,
                            dp_world_size=world, seed=3)


def _take(it, n):
    return [next(it) for _ in range(n)]


def _rows(batches):
    return [torch.cat([x, y[:, -1:]], dim=1) for x, y in batches]


def test_stream_packs_documents_of_its_files_in_order(tmp_path, tok):
    texts = _corpus(tmp_path / "c", files=2, docs=30)
    seq = 16
    rows = torch.cat(_rows(_take(iter(_loader(tok, tmp_path / "c", seq=seq)), 20)))
    stream = torch.cat([rows[0]] + [r[1:] for r in rows[1:]]).tolist()  # windows overlap by one token
    ids = [tok.encode(t, bos=True, eos=True) for f in range(2) for t in texts[f]]
    # one reader, 3 units (the jsonl, the parquet's 2 row groups) in the epoch's shuffled order
    units = [sum(ids[:30], []), sum(ids[30:45], []), sum(ids[45:], [])]
    orders = [sum((units[u] for u in order), []) for order in itertools.permutations(range(3))]
    assert sum(stream == o[:len(stream)] for o in orders) == 1 and len(stream) > len(units[0])


@pytest.mark.parametrize("workers", [0, 2])
def test_stream_resume_exact(tmp_path, tok, workers):
    _corpus(tmp_path / "c")
    for rank in range(2):
        dl = _loader(tok, tmp_path / "c", rank=rank, world=2, workers=workers)
        it = iter(dl)
        _take(it, 9)  # mid-file: the carry and the record index matter
        state = pickle.loads(pickle.dumps(dl.state_dict()))
        expected = _take(it, 30)  # past the end of the epoch
        fresh = _loader(tok, tmp_path / "c", rank=rank, world=2, workers=workers)
        fresh.load_state_dict(state)
        got = _take(iter(fresh), 30)
        assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(got, expected))


def test_stream_readers_are_disjoint(tmp_path, tok):
    _corpus(tmp_path / "c", files=4, docs=10)
    seen = []
    for rank in range(2):
        rows = torch.cat(_rows(_take(iter(_loader(tok, tmp_path / "c", rank=rank, world=2, workers=2)), 4)))
        text = tok.decode(rows.flatten().tolist())
        seen.append(set(re.findall(r"file (\d+) document (\d+)", text)))
    assert seen[0] and seen[1] and not seen[0] & seen[1]  # 4 readers (2 ranks x 2 workers), own units each


def test_stream_other_layout_is_approximate_and_too_few_files_is_an_error(tmp_path, tok, caplog):
    _corpus(tmp_path / "c")
    dl = _loader(tok, tmp_path / "c", world=2)
    _take(iter(dl), 5)
    other = _loader(tok, tmp_path / "c", world=1, workers=2)
    other.load_state_dict(dl.state_dict())
    assert len(_take(iter(other), 3)) == 3 and "streaming sources were read by" in caplog.text
    with pytest.raises(ConfigError, match="5 files/row groups for 8 readers"):
        next(iter(_loader(tok, tmp_path / "c", world=8)))


def test_stream_state_survives_dcp_into_a_fresh_template(tmp_path, tok):
    """The Checkpointer loads into the state_dict() of a fresh loader (no readers yet): all
    reader states must still come back."""
    import torch.distributed.checkpoint as dcp

    _corpus(tmp_path / "c")
    dl = _loader(tok, tmp_path / "c", workers=2)
    it = iter(dl)
    _take(it, 5)
    with pytest.warns(UserWarning):  # one process, no process group
        dcp.save({"dl": dl.state_dict()}, checkpoint_id=str(tmp_path / "ck"))
    expected = _take(it, 8)
    fresh = _loader(tok, tmp_path / "c", workers=2)
    template = {"dl": fresh.state_dict()}
    with pytest.warns(UserWarning):
        dcp.load(template, checkpoint_id=str(tmp_path / "ck"))
    fresh.load_state_dict(template["dl"])
    got = _take(iter(fresh), 8)
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(got, expected))


def test_trainer_resume_bitwise_on_a_stream_mixture_with_workers(tmp_path, monkeypatch):
    """Through the trainer and its DCP checkpoint: a mixture of a streamed jsonl/parquet folder and
    the builtin corpus, read by 2 workers, resumed mid-run, gives the uninterrupted losses."""
    from tests.helpers import TINY, run_in_process

    monkeypatch.setenv("TITAN_DATA_CACHE", str(tmp_path / "cache"))
    _corpus(tmp_path / "c", files=3, docs=60)
    cfg = tmp_path / "mix.toml"
    cfg.write_text(f'[data]\nnum_workers = 2\n[[data.sources]]\ntype = "stream"\npath = "{tmp_path / "c"}"\n'
                   'weight = 3\nname = "raw"\n[[data.sources]]\ntype = "builtin"\nweight = 1\n')
    common = TINY + ["--config", str(cfg), "--training.steps", "6", "--checkpoint.enable", "--checkpoint.interval", "3"]
    straight, _ = run_in_process(common + ["--job.dump_folder", str(tmp_path / "straight")])
    first, _ = run_in_process(common + ["--job.dump_folder", str(tmp_path / "resumed")], stop_after=3)
    second, trainer = run_in_process(common + ["--job.dump_folder", str(tmp_path / "resumed")])
    assert first + second == straight
    tokens = trainer.dataloader.metrics()
    assert tokens["data/tokens/raw"] + tokens["data/tokens/builtin"] == 6 * 2 * 64 and tokens["data/tokens/raw"] > 0
