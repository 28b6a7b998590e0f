"""Token sources and the batch streams the dataloader iterates.

Packing: documents are tokenized as ``[BOS] text [EOS]`` and concatenated into
one token array. Window ``i`` is ``tokens[i*seq_len : i*seq_len + seq_len + 1]``
(consecutive windows share one boundary token, so every token after the first is
a label exactly once per epoch); ``inputs = window[:-1]``, ``labels = window[1:]``.

Order and sharding: epoch ``e`` uses a permutation of all windows drawn from
``(seed, e)``. Its first ``batches_per_epoch * dp_world_size * local_batch_size``
entries are laid out as ``[batch, rank, row]``; the rest of the epoch is dropped,
so every rank gets the same number of batches and no window is repeated across
ranks within an epoch. The stream is infinite: global batch ``g`` is batch
``g % batches_per_epoch`` of epoch ``g // batches_per_epoch``.

Workers: with ``num_workers = K`` worker ``w`` produces global batches ``w, w+K,
...``; the DataLoader's in-order round robin therefore yields the same sequence as
with no workers. Each copy's state is just the index of the next batch it makes.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
import time
from collections.abc import Iterator

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from trainer.configurable import ConfigError
from trainer.data.builtin_corpus import builtin_documents
from trainer.data.cache import cached_tokens, token_dtype
from trainer.data.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

CACHE_FORMAT = 1  # bump when the packing or the corpus extraction changes
DATA_EXTENSIONS = (".txt", ".jsonl")
_PATH_FIX = "pass --training.dataset_path <a .txt or .jsonl file, or a folder of them>"


# ----------------------------------------------------------------------------- tokenizing


def tokenize_documents(tokenizer: Tokenizer, docs, *, chunk_chars: int = 4 << 20) -> tuple[np.ndarray, int]:
    """Tokenizes an iterable of strings as [BOS] doc [EOS], concatenated. Returns (tokens, n_docs)."""
    dtype = token_dtype(tokenizer.vocab_size)
    parts: list[np.ndarray] = []
    pending: list[str] = []
    pending_chars = 0
    n_docs = 0

    def flush():
        nonlocal pending, pending_chars
        if pending:
            for ids in tokenizer.encode_batch(pending, bos=True, eos=True):
                parts.append(np.asarray(ids, dtype=dtype))
        pending, pending_chars = [], 0

    for doc in docs:
        if not doc:
            continue
        pending.append(doc)
        pending_chars += len(doc)
        n_docs += 1
        if pending_chars >= chunk_chars:
            flush()
    flush()
    tokens = np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)
    return tokens, n_docs


def _cache_name(kind: str, tokenizer: Tokenizer, extra: str = "") -> str:
    py = "py{}.{}.{}".format(*sys.version_info[:3])
    return f"{kind}-{py}-tok{tokenizer.file_hash[:16]}{extra}-v{CACHE_FORMAT}"


def builtin_tokens(tokenizer: Tokenizer) -> np.ndarray:
    """The stdlib-docstring corpus, tokenized and cached (keyed by tokenizer hash and Python version)."""
    info: dict = {}

    def build() -> np.ndarray:
        t0 = time.perf_counter()
        docs = builtin_documents()
        tokens, info["docs"] = tokenize_documents(tokenizer, docs)
        info["secs"] = time.perf_counter() - t0
        return tokens

    tokens, path, built = cached_tokens(_cache_name("builtin", tokenizer), build)
    how = f"built from {info['docs']} stdlib docstrings in {info['secs']:.1f}s" if built else "loaded"
    logger.info("builtin corpus: %d tokens (%s, cache %s)", len(tokens), how, path)
    return tokens


# ----------------------------------------------------------------------------- files


def list_data_files(path: str | None) -> list[str]:
    """The .txt/.jsonl files named by `path` (a file, or a folder searched recursively, sorted)."""
    if not path:
        raise ConfigError(f"config error: training.dataset_path: dataset=files needs a path; {_PATH_FIX}")
    if not os.path.exists(path):
        raise ConfigError(f"config error: training.dataset_path: {path!r} does not exist; {_PATH_FIX}")
    if os.path.isfile(path):
        if not path.endswith(DATA_EXTENSIONS):
            raise ConfigError(f"config error: training.dataset_path: {path!r} is not a .txt or .jsonl file; {_PATH_FIX}")
        return [path]
    files = []
    for d, dirs, names in os.walk(path):
        dirs[:] = sorted(x for x in dirs if not x.startswith("."))
        files += [os.path.join(d, n) for n in names if n.endswith(DATA_EXTENSIONS) and not n.startswith(".")]
    if not files:
        raise ConfigError(f"config error: training.dataset_path: no .txt or .jsonl files under {path!r}; {_PATH_FIX}")
    return sorted(files, key=lambda p: os.path.relpath(p, path))


def iter_file_documents(files: list[str], stats: dict | None = None) -> Iterator[str]:
    """Documents of the files in order: a whole .txt file is one document; each
    .jsonl line is a JSON object whose "text" string is one document."""
    stats = stats if stats is not None else {}
    stats.setdefault("skipped_lines", 0)
    for path in files:
        if path.endswith(".txt"):
            with open(path, encoding="utf-8", errors="replace") as f:
                text = f.read()
            if text.strip():
                yield text
            continue
        with open(path, encoding="utf-8", errors="replace") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ConfigError(f"config error: training.dataset_path: {path}:{lineno} is not valid JSON "
                                      f"({e.msg}); fix or remove that line") from None
                text = obj.get("text") if isinstance(obj, dict) else None
                if isinstance(text, str) and text:
                    yield text
                else:
                    stats["skipped_lines"] += 1


def files_tokens(tokenizer: Tokenizer, path: str | None) -> np.ndarray:
    """Tokens of the .txt/.jsonl files under `path`, cached by file list, sizes and mtimes."""
    files = list_data_files(path)
    h = hashlib.sha256()
    for f in files:
        st = os.stat(f)
        h.update(f"{os.path.abspath(f)}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    info: dict = {}

    def build() -> np.ndarray:
        tokens, info["docs"] = tokenize_documents(tokenizer, iter_file_documents(files, info))
        if info["docs"] == 0:
            raise ConfigError(f"config error: training.dataset_path: no usable text in {path!r} (.jsonl lines need "
                              f"a non-empty \"text\" string); {_PATH_FIX}")
        if info["skipped_lines"]:
            logger.warning("files dataset: skipped %d .jsonl lines without a \"text\" string", info["skipped_lines"])
        return tokens

    tokens, cache_path, built = cached_tokens(_cache_name("files", tokenizer, "-" + h.hexdigest()[:16]), build)
    how = f"{info['docs']} documents" if built else "loaded"
    logger.info("files dataset: %d tokens from %d files (%s, cache %s)", len(tokens), len(files), how, cache_path)
    return tokens


# ----------------------------------------------------------------------------- streams


class BatchStream(IterableDataset):
    """An infinite, stateful stream of (inputs, labels) batches indexed by a global
    batch counter; subclasses define `make_batch(g)` and `meta()`."""

    def __init__(self):
        super().__init__()
        self._next: int | None = None  # global index of the next batch this copy makes

    def make_batch(self, g: int) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def meta(self) -> dict:
        """What a saved position depends on; a mismatch on load triggers a remap."""
        raise NotImplementedError

    def remap(self, g: int, old: dict) -> int:
        return g

    @staticmethod
    def _worker() -> tuple[int, int]:
        info = get_worker_info()
        return (info.id, info.num_workers) if info is not None else (0, 1)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        wid, nw = self._worker()
        if self._next is None:
            self._next = wid
        while True:
            g = self._next
            batch = self.make_batch(g)
            self._next = g + nw
            yield batch

    def state_dict(self) -> dict:
        return {"next_batch": self._next if self._next is not None else self._worker()[0], **self.meta()}

    def load_state_dict(self, state: dict) -> None:
        g = int(state["next_batch"])
        old = {k: v for k, v in state.items() if k != "next_batch"}
        if old != self.meta():
            new_g = self.remap(g, old)
            wid, nw = self._worker()
            new_g = new_g - new_g % nw + wid  # keep this worker's residue class
            logger.warning("dataloader state was saved with %s but now %s; resuming approximately at batch %d "
                           "instead of %d", old, self.meta(), new_g, g)
            g = new_g
        self._next = g


def _window_batch(rows: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    t = torch.from_numpy(rows.astype(np.int64, copy=False))
    return t[:, :-1].contiguous(), t[:, 1:].contiguous()


class PackedWindowDataset(BatchStream):
    """Windows of seq_len+1 tokens over a packed token array, shuffled per epoch and
    sharded over data-parallel ranks (see the module docstring)."""

    def __init__(self, tokens: np.ndarray, *, seq_len: int, local_batch_size: int, dp_rank: int,
                 dp_world_size: int, seed: int, name: str = "tokens"):
        super().__init__()
        self.tokens = tokens
        self.name = name
        self.seq_len = seq_len
        self.local_batch_size = local_batch_size
        self.dp_rank = dp_rank
        self.dp_world_size = dp_world_size
        self.seed = seed
        self.num_tokens = len(tokens)
        self.num_windows = max(0, (self.num_tokens - 1) // seq_len)
        self.batches_per_epoch = self.num_windows // (dp_world_size * local_batch_size)
        if self.batches_per_epoch == 0:
            raise ConfigError(
                f"config error: training.seq_len: the {name} dataset has {self.num_tokens} tokens = "
                f"{self.num_windows} windows of seq_len+1={seq_len + 1}, fewer than local_batch_size x dp = "
                f"{local_batch_size} x {dp_world_size}; lower training.seq_len or training.local_batch_size, or use more data")
        self._perm_epoch = -1
        self._perm: np.ndarray | None = None

    def epoch_layout(self, epoch: int) -> np.ndarray:
        """Window indices of `epoch` as [batches_per_epoch, dp_world_size, local_batch_size]."""
        if epoch != self._perm_epoch:
            rng = np.random.default_rng([self.seed, epoch, 0x7A7A])
            used = self.batches_per_epoch * self.dp_world_size * self.local_batch_size
            self._perm = rng.permutation(self.num_windows)[:used].reshape(
                self.batches_per_epoch, self.dp_world_size, self.local_batch_size)
            self._perm_epoch = epoch
        return self._perm

    def windows(self, g: int) -> np.ndarray:
        """Window indices of this rank's global batch `g`."""
        epoch, k = divmod(g, self.batches_per_epoch)
        return self.epoch_layout(epoch)[k, self.dp_rank]

    def make_batch(self, g: int) -> tuple[torch.Tensor, torch.Tensor]:
        L = self.seq_len + 1
        rows = np.stack([self.tokens[s:s + L] for s in self.windows(g) * self.seq_len])
        return _window_batch(rows)

    def meta(self) -> dict:
        return {"num_windows": self.num_windows, "batches_per_epoch": self.batches_per_epoch,
                "seq_len": self.seq_len, "local_batch_size": self.local_batch_size, "dp_rank": self.dp_rank,
                "dp_world_size": self.dp_world_size, "seed": self.seed}

    def remap(self, g: int, old: dict) -> int:
        # Same epoch, same fraction of it.
        old_bpe = int(old.get("batches_per_epoch") or 0)
        if old_bpe <= 0:
            return 0
        epoch, k = divmod(g, old_bpe)
        return epoch * self.batches_per_epoch + (k * self.batches_per_epoch) // old_bpe

    def describe(self) -> str:
        return (f"{self.name}: {self.num_tokens:,} tokens, {self.num_windows:,} windows of {self.seq_len + 1}, "
                f"{self.batches_per_epoch:,} batches/epoch per rank")


class SyntheticDataset(BatchStream):
    """Uniform random tokens in [0, vocab_size); batch g of rank r comes from the
    generator seeded with (seed, r, g), so any batch can be made directly."""

    def __init__(self, *, vocab_size: int, seq_len: int, local_batch_size: int, dp_rank: int, seed: int):
        super().__init__()
        self.vocab_size = vocab_size
        self.seq_len = seq_len
        self.local_batch_size = local_batch_size
        self.dp_rank = dp_rank
        self.seed = seed
        self.name = "synthetic"

    def make_batch(self, g: int) -> tuple[torch.Tensor, torch.Tensor]:
        rng = np.random.default_rng([self.seed, self.dp_rank, g])
        rows = rng.integers(0, self.vocab_size, size=(self.local_batch_size, self.seq_len + 1), dtype=np.int64)
        return _window_batch(rows)

    def meta(self) -> dict:
        return {"vocab_size": self.vocab_size, "seq_len": self.seq_len, "local_batch_size": self.local_batch_size,
                "dp_rank": self.dp_rank, "seed": self.seed}

    def describe(self) -> str:
        return f"synthetic: random tokens in [0, {self.vocab_size}), infinite"
