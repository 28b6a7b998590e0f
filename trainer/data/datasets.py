"""In-memory token sources: the built-in corpus and small file corpora, tokenized at
start-up and cached on disk (trainer/data/cache.py) so later runs only memory-map them.

Packing: documents are tokenized as ``[BOS] text [EOS]`` and concatenated into one
token array (the same layout scripts/tokenize_data.py writes to shards).
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
import time

import numpy as np

from configuration.fields import ConfigError
from trainer.data.builtin_corpus import builtin_documents
from trainer.data.cache import cached_tokens, token_dtype
from trainer.data.documents import iter_records, list_input_files
from trainer.data.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

CACHE_FORMAT = 1  # bump when the packing or the corpus extraction changes


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
            batch = getattr(tokenizer, "encode_batch", None)  # threaded where the tokenizer offers it
            encoded = (batch(pending, bos=True, eos=True) if batch is not None
                       else [tokenizer.encode(t, bos=True, eos=True) for t in pending])
            for ids in encoded:
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


def _cache_name(kind: str, tokenizer_sha256: str, extra: str = "") -> str:
    py = "py{}.{}.{}".format(*sys.version_info[:3])
    return f"{kind}-{py}-tok{tokenizer_sha256[:16]}{extra}-v{CACHE_FORMAT}"


def builtin_tokens(tokenizer: Tokenizer, tokenizer_sha256: str) -> np.ndarray:
    """The stdlib-docstring corpus, tokenized and cached (keyed by tokenizer hash and Python version)."""
    info: dict = {}

    def build() -> np.ndarray:
        t0 = time.perf_counter()
        docs = builtin_documents()
        tokens, info["docs"] = tokenize_documents(tokenizer, docs)
        info["secs"] = time.perf_counter() - t0
        return tokens

    tokens, path, built = cached_tokens(_cache_name("builtin", tokenizer_sha256), build)
    how = f"built from {info['docs']} stdlib docstrings in {info['secs']:.1f}s" if built else "loaded"
    logger.info("builtin corpus: %d tokens (%s, cache %s)", len(tokens), how, path)
    return tokens


# ----------------------------------------------------------------------------- files


def files_tokens(tokenizer: Tokenizer, tokenizer_sha256: str, path: str, *, text_field: str = "text",
                 split: str | None = None, what: str = "data.path") -> np.ndarray:
    """Tokens of the documents under `path` (any documents.py input), tokenized once and
    cached by file list, sizes, mtimes and text field. For corpora that fit in memory;
    larger ones go through scripts/tokenize_data.py."""
    files = list_input_files(path, split=split, what=what)
    h = hashlib.sha256(text_field.encode() + b"\0")
    for f in files:
        st = os.stat(f)
        h.update(f"{os.path.abspath(f)}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    info: dict = {"skipped": 0}

    def texts():
        for _, _, text in iter_records(files, text_field):
            if text is not None:  # documents.usable_text decided
                yield text
            else:
                info["skipped"] += 1

    def build() -> np.ndarray:
        tokens, info["docs"] = tokenize_documents(tokenizer, texts())
        if info["docs"] == 0:
            raise ConfigError(f"config error: {what}: no usable text in {path!r} (records need a non-empty "
                              f"{text_field!r} string); point it at text files or set the text field")
        if info["skipped"]:
            logger.warning("files source: skipped %d records without a %r string", info["skipped"], text_field)
        return tokens

    tokens, cache_path, built = cached_tokens(_cache_name("files", tokenizer_sha256, "-" + h.hexdigest()[:16]), build)
    how = f"{info['docs']} documents" if built else "loaded"
    logger.info("files source: %d tokens from %d files (%s, cache %s)", len(tokens), len(files), how, cache_path)
    return tokens
