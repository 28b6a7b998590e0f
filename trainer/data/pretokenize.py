"""Offline tokenization into token shards (the engine behind scripts/tokenize_data.py).

Flow: the main process streams records out of the input files, groups them into chunks
of about `chunk_chars` characters, and hands the chunks to a process pool (at most
2 x workers in flight, so memory stays flat); results come back in input order and
are appended to the open shard, which is closed at the first chunk boundary past
`shard_tokens`. The output depends only on the inputs and these two sizes, never on
the number of workers or on timing.

Resume: after each shard is durable, ``progress.json`` records the shard list and the
input position where the next shard starts. A rerun of the same command deletes
temporaries, skips the input to that position and carries on; since chunking restarts
at a shard boundary exactly as it did the first time, the result is byte-identical to
an uninterrupted run. ``manifest.json`` is written last (see trainer/data/shards.py).

Testing hook: ``TITAN_TOKENIZE_KILL=POINT:N`` SIGKILLs the process group the N-th time
it reaches POINT (chunk, shard, progress, manifest), so tests can kill at exact points.
"""

from __future__ import annotations

import collections
import glob
import json
import logging
import os
import signal
import time
from concurrent.futures import ProcessPoolExecutor

import numpy as np

from configuration.fields import ConfigError
from configuration.environment import env_value
from trainer.data.cache import token_dtype
from trainer.data.documents import iter_records, list_input_files
from trainer.data.shards import FORMAT, MANIFEST, VERSION, ShardWriter, tokenizer_hash, write_json_atomic

logger = logging.getLogger(__name__)
PROGRESS = "progress.json"
KILL_ENV = "TITAN_TOKENIZE_KILL"
_kill_counts: collections.Counter = collections.Counter()


def kill_point(point: str) -> None:
    """SIGKILLs this run at the configured point (see the module docstring); no-op otherwise."""
    spec = env_value(KILL_ENV)
    if not spec:
        return
    name, _, count = spec.partition(":")
    if name != point:
        return
    _kill_counts[point] += 1
    if _kill_counts[point] == int(count or 1):
        if os.getpgid(0) == os.getpid():  # group leader: take the pool workers down too
            os.killpg(os.getpid(), signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)


# ---- workers ----
_worker_tokenizer = None


def _init_worker(tokenizer_path: str) -> None:
    global _worker_tokenizer
    from trainer.data.tokenizer import build_tokenizer

    _worker_tokenizer = build_tokenizer(tokenizer_path)


def encode_chunk(texts: list[str], tokenizer=None) -> tuple[np.ndarray, np.ndarray]:
    """([BOS] text [EOS] for each text, concatenated; the per-document token counts)."""
    tok = tokenizer or _worker_tokenizer
    dtype = token_dtype(tok.vocab_size)
    ids = [tok.encode(t, bos=True, eos=True) for t in texts]
    lengths = np.fromiter((len(x) for x in ids), dtype=np.int64, count=len(ids))
    flat = np.fromiter((i for x in ids for i in x), dtype=dtype, count=int(lengths.sum()))
    return flat, lengths


# ---- the job ----
def _chunks(files, text_field, start, chunk_chars, skipped):
    """(texts, position after the chunk, characters, records skipped so far) from `start` on;
    records without text are counted and dropped."""
    texts, chars = [], 0
    for fi, ri, text in iter_records(files, text_field, start):
        if text is not None:  # documents.usable_text decided
            texts.append(text)
            chars += len(text)
        else:
            skipped += 1
        if chars >= chunk_chars:
            yield texts, (fi, ri + 1), chars, skipped
            texts, chars = [], 0
    yield texts, (len(files), 0), chars, skipped


def job_config(inputs, files, tokenizer_path, tok, text_field, split, shard_tokens, chunk_chars) -> dict:
    """What the output depends on; a resumed run must match it exactly."""
    return {"inputs": list(inputs), "files": [[os.path.normpath(f), os.path.getsize(f)] for f in files],
            "text_field": text_field, "split": split, "tokenizer_sha256": tokenizer_hash(tokenizer_path),
            "dtype": token_dtype(tok.vocab_size).name, "shard_tokens": shard_tokens, "chunk_chars": chunk_chars}


def _prepare_output(output: str, config: dict) -> dict:
    """Returns the progress to resume from (fresh if none); refuses a folder holding another job."""
    os.makedirs(output, exist_ok=True)
    progress_path = os.path.join(output, PROGRESS)
    fresh = {"config": config, "shards": [], "position": [0, 0], "skipped_records": 0}
    if os.path.isfile(progress_path):
        with open(progress_path) as f:
            progress = json.load(f)
        if progress["config"] != config:
            changed = sorted(k for k in config if progress["config"].get(k) != config[k])
            raise ConfigError(f"config error: --output: {output} holds an unfinished run with other settings "
                              f"({', '.join(changed)} differ); rerun it with the same arguments, or use a new --output")
    elif os.listdir(output):
        raise ConfigError(f"config error: --output: {output} is not empty and holds no tokenize_data run; "
                          "use an empty or new folder")
    else:
        progress = fresh
    done = {s["file"] for s in progress["shards"]} | {s["index"] for s in progress["shards"]}
    for path in glob.glob(os.path.join(output, "shard-*")):  # temporaries and shards past the last durable one
        if os.path.basename(path) not in done:
            os.unlink(path)
    return progress


def _progress_bar(total_bytes: int, enabled: bool):
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total_bytes, unit="B", unit_scale=True, disable=not enabled, smoothing=0.1,
                desc="tokenizing", dynamic_ncols=True)


def tokenize_to_shards(inputs: list[str], output: str, tokenizer_path: str, *, text_field: str = "text",
                       split: str | None = None, workers: int = 1, shard_tokens: int = 1 << 28,
                       chunk_chars: int = 1 << 20, progress_bar: bool = True) -> dict:
    """Tokenizes `inputs` into a token folder at `output` (resuming a killed run); returns the manifest."""
    from trainer.data.tokenizer import build_tokenizer

    tok = build_tokenizer(tokenizer_path)
    files = [f for inp in inputs for f in list_input_files(inp, split=split, what="--input")]
    config = job_config(inputs, files, tokenizer_path, tok, text_field, split, shard_tokens, chunk_chars)
    manifest_path = os.path.join(output, MANIFEST)
    if os.path.isfile(manifest_path):
        with open(manifest_path) as f:
            manifest = json.load(f)
        if manifest.get("job") == config:
            logger.info("%s is already complete", output)
            return manifest
        raise ConfigError(f"config error: --output: {output} already holds a finished dataset made with other "
                          "settings; use a new --output")
    progress = _prepare_output(output, config)
    dtype = token_dtype(tok.vocab_size)
    stats = {"skipped_records": progress["skipped_records"], "docs": 0, "tokens": 0}
    sizes = [s for _, s in config["files"]]
    start = tuple(progress["position"])
    bar = _progress_bar(sum(sizes), progress_bar)
    t0 = time.perf_counter()

    pool = ProcessPoolExecutor(workers, initializer=_init_worker, initargs=(tokenizer_path,)) if workers > 1 else None
    writer = ShardWriter(output, len(progress["shards"]), dtype)
    pending: collections.deque = collections.deque()

    file_chars = [start[0], 0]  # (file, text characters read from it): the bar's position

    def drain_one():
        nonlocal writer
        future, end, chars, skipped = pending.popleft()
        flat, lengths = future.result() if pool is not None else future
        writer.add(flat, lengths)
        stats["docs"] += len(lengths)
        stats["tokens"] += len(flat)
        stats["skipped_records"] = skipped
        kill_point("chunk")
        writer = _maybe_close_shard(writer, output, progress, stats, end, shard_tokens, dtype)
        if bar is not None:
            file_chars[:] = [end[0], 0] if end[0] != file_chars[0] else [end[0], file_chars[1] + chars]
            elapsed = max(time.perf_counter() - t0, 1e-9)
            bar.set_postfix_str(f"{stats['docs'] / elapsed:,.0f} docs/s, {stats['tokens'] / elapsed:,.0f} tokens/s",
                                refresh=False)
            bar.update(sum(sizes[:end[0]]) + min(file_chars[1], sum(sizes[end[0]:end[0] + 1])) - bar.n)

    try:
        for texts, end, chars, skipped in _chunks(files, text_field, start, chunk_chars, stats["skipped_records"]):
            job = pool.submit(encode_chunk, texts) if pool is not None else encode_chunk(texts, tok)
            pending.append((job, end, chars, skipped))
            while pending and (pool is None or len(pending) >= 2 * workers):
                drain_one()
        while pending:
            drain_one()
        if not writer.tokens and not progress["shards"]:
            raise ConfigError(f"config error: --text-field: none of the {stats['skipped_records']:,} records of "
                              f"{', '.join(inputs)} has a non-empty {text_field!r} text; pass the field that holds "
                              "the text")
        if writer.tokens:
            progress["shards"].append(writer.finish())
        else:
            writer.abort()
    except BaseException:
        writer.abort()
        raise
    finally:
        if pool is not None:
            pool.shutdown(cancel_futures=True)
        if bar is not None:
            bar.close()
    kill_point("manifest")
    manifest = {
        "format": FORMAT, "version": VERSION, "dtype": dtype.name, "job": config,
        "tokenizer": {"sha256": config["tokenizer_sha256"], "vocab_size": tok.vocab_size, "bos_id": tok.bos_id,
                      "eos_id": tok.eos_id, "path": tokenizer_path},
        "source": {"inputs": list(inputs), "files": len(files), "bytes": sum(sizes), "text_field": text_field,
                   "split": split},
        "shards": progress["shards"], "tokens": sum(s["tokens"] for s in progress["shards"]),
        "docs": sum(s["docs"] for s in progress["shards"]), "skipped_records": stats["skipped_records"],
    }
    write_json_atomic(manifest_path, manifest)
    if os.path.exists(os.path.join(output, PROGRESS)):
        os.unlink(os.path.join(output, PROGRESS))
    elapsed = time.perf_counter() - t0
    manifest["_run"] = {"seconds": elapsed, "docs": stats["docs"], "tokens": stats["tokens"], "workers": workers}
    return manifest


def _maybe_close_shard(writer, output, progress, stats, position, shard_tokens, dtype):
    """Closes the shard at this chunk boundary once it holds shard_tokens; records the resume point."""
    if writer.tokens < shard_tokens:
        return writer
    progress["shards"].append(writer.finish())
    kill_point("shard")
    progress["position"] = list(position)
    progress["skipped_records"] = stats["skipped_records"]
    write_json_atomic(os.path.join(output, PROGRESS), progress)
    kill_point("progress")
    return ShardWriter(output, len(progress["shards"]), dtype)
