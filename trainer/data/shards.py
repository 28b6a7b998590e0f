"""The on-disk token format written by scripts/tokenize_data.py and memory-mapped by the reader.

A dataset is a folder::

    manifest.json        written last: dtype, tokenizer hash, counts, source, the shard list
    shard-00000.bin      flat tokens (uint16 if the vocabulary fits, else uint32), native little-endian
    shard-00000.idx      uint64 document start offsets into the .bin, plus the total at the end
    ...

Documents are stored as ``[BOS] text [EOS]`` back to back, exactly what in-memory
tokenization packs. Why this shape: a flat token file can be memory-mapped and sliced
without parsing, so a reader's start-up and memory do not grow with the corpus; the
index keeps document boundaries (for document masking and inspection) without scanning.

Crash safety: every file is written under a temporary name, fsynced and renamed; the
manifest appears only when all shards are complete, and a reader accepts a folder only
through its manifest and checks each shard's size against it. A half-written shard is
therefore never read.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import mmap
import os
from dataclasses import dataclass

import numpy as np

from configuration.fields import ConfigError

FORMAT = "titanlite-token-shards"
VERSION = 1
MANIFEST = "manifest.json"
INDEX_DTYPE = np.dtype("<u8")


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
                   "vocab.json", "merges.txt")


def tokenizer_hash(path: str) -> str:
    """sha256 of the tokenizer file's bytes (for a model folder: of its TOKENIZER_FILES, by name)."""
    h = hashlib.sha256()
    if os.path.isdir(path):  # a model folder: only its tokenizer files, never the weights
        for name in sorted(os.listdir(path)):
            full = os.path.join(path, name)
            if os.path.isfile(full) and name in TOKENIZER_FILES:
                h.update(name.encode() + b"\0")
                with open(full, "rb") as f:
                    h.update(f.read())
        return h.hexdigest()
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def fsync_dir(folder: str) -> None:
    with contextlib.suppress(OSError):  # not every OS/file system lets a folder be fsynced
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def write_json_atomic(path: str, obj: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(os.path.abspath(path)))


def shard_names(index: int) -> tuple[str, str]:
    return f"shard-{index:05d}.bin", f"shard-{index:05d}.idx"


class ShardWriter:
    """Appends documents' tokens to one shard under temporary names; `finish()` makes it durable."""

    def __init__(self, folder: str, index: int, dtype: np.dtype):
        self.folder, self.index, self.dtype = folder, index, np.dtype(dtype)
        self.bin_name, self.idx_name = shard_names(index)
        self._bin = open(os.path.join(folder, self.bin_name + ".tmp"), "wb")
        self._lengths: list[np.ndarray] = []
        self.tokens = 0
        self.docs = 0

    def add(self, tokens: np.ndarray, doc_lengths: np.ndarray) -> None:
        self._bin.write(np.ascontiguousarray(tokens, dtype=self.dtype.newbyteorder("<")).tobytes())
        self._lengths.append(np.asarray(doc_lengths, dtype=np.int64))
        self.tokens += int(len(tokens))
        self.docs += int(len(doc_lengths))

    def finish(self) -> dict:
        self._bin.flush()
        os.fsync(self._bin.fileno())
        self._bin.close()
        lengths = np.concatenate(self._lengths) if self._lengths else np.zeros(0, np.int64)
        starts = np.concatenate([[0], np.cumsum(lengths)]).astype(INDEX_DTYPE)
        idx_tmp = os.path.join(self.folder, self.idx_name + ".tmp")
        with open(idx_tmp, "wb") as f:
            f.write(starts.tobytes())
            f.flush()
            os.fsync(f.fileno())
        os.replace(idx_tmp, os.path.join(self.folder, self.idx_name))
        os.replace(os.path.join(self.folder, self.bin_name + ".tmp"), os.path.join(self.folder, self.bin_name))
        fsync_dir(self.folder)
        return {"file": self.bin_name, "index": self.idx_name, "tokens": self.tokens, "docs": self.docs}

    def abort(self) -> None:
        with contextlib.suppress(OSError):
            self._bin.close()
            os.unlink(os.path.join(self.folder, self.bin_name + ".tmp"))


def is_token_folder(path: str) -> bool:
    return os.path.isdir(path) and (os.path.isfile(os.path.join(path, MANIFEST))
                                    or os.path.isfile(os.path.join(path, "progress.json")))


@dataclass
class Shard:
    path: str
    index_path: str
    tokens: int
    docs: int


def _advise_random(arr: np.ndarray) -> None:
    """Windows are read in shuffled order: tell the kernel not to read ahead around each one
    (readahead would fetch, and map into this process, pages no window asks for)."""
    mm = getattr(arr, "_mmap", None)
    if mm is not None and hasattr(mm, "madvise") and hasattr(mmap, "MADV_RANDOM"):
        with contextlib.suppress(OSError):
            mm.madvise(mmap.MADV_RANDOM)


class TokenShards:
    """A finished token folder, memory-mapped lazily: opening it reads only the manifest and
    stats the shard files, so start-up and memory do not depend on the number of tokens."""

    def __init__(self, folder: str, *, expect_tokenizer_hash: str | None = None,
                 expect_special_ids: tuple[int | None, int] | None = None, what: str = "data.path"):
        self.folder = folder
        fix = f"run `python scripts/tokenize_data.py --input <corpus> --output {folder}`"
        manifest = os.path.join(folder, MANIFEST)
        if not os.path.isdir(folder):
            raise ConfigError(f"config error: {what}: {folder} does not exist; {fix}")
        if not os.path.isfile(manifest):
            if os.path.isfile(os.path.join(folder, "progress.json")):
                raise ConfigError(f"config error: {what}: {folder} is only partly tokenized (no {MANIFEST} yet); "
                                  "rerun the same scripts/tokenize_data.py command to finish it")
            raise ConfigError(f"config error: {what}: {folder} has no {MANIFEST}; {fix}")
        with open(manifest) as f:
            try:
                m = json.load(f)
            except json.JSONDecodeError as e:
                raise ConfigError(f"config error: {what}: {manifest} is not valid JSON ({e.msg}); {fix}") from None
        if m.get("format") != FORMAT or m.get("version") != VERSION:
            raise ConfigError(f"config error: {what}: {manifest} is not a {FORMAT} v{VERSION} manifest; {fix}")
        self.manifest = m
        self.dtype = np.dtype(m["dtype"]).newbyteorder("<")
        tok = m["tokenizer"]
        if expect_tokenizer_hash is not None and tok["sha256"] != expect_tokenizer_hash:
            raise ConfigError(f"config error: {what}: {folder} was tokenized with another tokenizer (sha256 "
                              f"{tok['sha256'][:12]}..., this run's is {expect_tokenizer_hash[:12]}...); "
                              "retokenize it or set model.tokenizer_path to the one it was made with")
        self.bos_id, self.eos_id, self.vocab_size = tok["bos_id"], tok["eos_id"], tok["vocab_size"]
        # The hash covers the tokenizer files, not a model folder's generation_config/config.json,
        # which may set BOS/EOS; document masking and packing rely on these ids, so compare them too.
        if expect_special_ids is not None and (self.bos_id, self.eos_id) != tuple(expect_special_ids):
            bos, eos = expect_special_ids
            raise ConfigError(f"config error: {what}: {folder} was tokenized with BOS/EOS ids {self.bos_id}/"
                              f"{self.eos_id} ({MANIFEST}), but this run's tokenizer has {bos}/{eos}; retokenize "
                              "it with this tokenizer (scripts/tokenize_data.py) or set model.tokenizer_path to the "
                              "one it was made with")
        self.shards: list[Shard] = []
        for entry in m["shards"]:
            s = Shard(os.path.join(folder, entry["file"]), os.path.join(folder, entry["index"]),
                      int(entry["tokens"]), int(entry["docs"]))
            sizes = (s.tokens * self.dtype.itemsize, (s.docs + 1) * INDEX_DTYPE.itemsize)
            for p, size in zip((s.path, s.index_path), sizes):
                if not os.path.isfile(p) or os.path.getsize(p) != size:
                    raise ConfigError(f"config error: {what}: {p} is missing or not {size} bytes as {manifest} "
                                      f"says; the folder is damaged, {fix}")
            self.shards.append(s)
        self.num_tokens = sum(s.tokens for s in self.shards)
        self.num_docs = sum(s.docs for s in self.shards)
        self._maps: dict[int, np.ndarray] = {}

    def tokens(self, shard: int) -> np.ndarray:
        """The shard's tokens as a read-only memory map (opened once)."""
        arr = self._maps.get(shard)
        if arr is None:
            s = self.shards[shard]
            arr = (np.memmap(s.path, dtype=self.dtype, mode="r", shape=(s.tokens,)) if s.tokens
                   else np.zeros(0, self.dtype))
            _advise_random(arr)
            self._maps[shard] = arr
        return arr

    def doc_starts(self, shard: int) -> np.ndarray:
        """[docs + 1] start offsets of the shard's documents (the last one = its token count)."""
        s = self.shards[shard]
        return np.memmap(s.index_path, dtype=INDEX_DTYPE, mode="r", shape=(s.docs + 1,))

    def __getstate__(self):  # memory maps are reopened in DataLoader workers, not pickled
        state = dict(self.__dict__)
        state["_maps"] = {}
        return state
