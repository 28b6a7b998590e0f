"""On-disk cache of tokenized corpora, safe for many ranks at once.

A corpus is stored as one flat .npy token array (uint16 when the vocabulary fits,
else uint32) under ``$TITAN_DATA_CACHE`` (default ``~/.cache/titanlite``). The
first process to get an advisory lock builds it; the rest wait and then read it.
Writes go to a unique temporary file that is renamed into place, so a reader
never sees a partial file even where locks do not work (e.g. some network file
systems, where every rank may then build its own copy and the last rename wins).
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
from collections.abc import Callable, Iterator

import numpy as np

from configuration.environment import env_value

logger = logging.getLogger(__name__)


def cache_dir() -> str:
    return env_value("TITAN_DATA_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "titanlite")


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


@contextlib.contextmanager
def _file_lock(f) -> Iterator[None]:
    """Exclusive advisory lock on the open file `f`, where the OS and file system allow."""
    try:
        import fcntl

        fcntl.flock(f, fcntl.LOCK_EX)
    except (ImportError, OSError):  # not POSIX, or no locks on this file system: rely on atomic rename
        yield
        return
    try:
        yield
    finally:
        fcntl.flock(f, fcntl.LOCK_UN)


def save_atomic(path: str, array: np.ndarray) -> None:
    """np.save to a temporary file in the same folder, then rename into place."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=os.path.basename(path) + ".", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            np.save(f, array)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _load(path: str) -> np.ndarray | None:
    try:
        return np.load(path, mmap_mode="r")
    except (OSError, ValueError) as e:
        logger.warning("data cache: ignoring unreadable %s (%s); rebuilding", path, e)
        return None


def cached_tokens(name: str, build: Callable[[], np.ndarray]) -> tuple[np.ndarray, str, bool]:
    """Returns (tokens, path, built): the array cached as `name`.npy, calling `build()`
    once if no valid cache exists. The array is memory-mapped read-only."""
    folder = cache_dir()
    path = os.path.join(folder, name + ".npy")
    if os.path.exists(path):
        arr = _load(path)
        if arr is not None:
            return arr, path, False
    try:
        os.makedirs(folder, exist_ok=True)
        lock_file = open(path + ".lock", "a+")
    except OSError as e:
        logger.warning("data cache: cannot write to %s (%s); building in memory without caching "
                       "(set TITAN_DATA_CACHE to a writable folder)", folder, e)
        return build(), path, True
    with lock_file, _file_lock(lock_file):
        if os.path.exists(path):  # another rank built it while we waited
            arr = _load(path)
            if arr is not None:
                return arr, path, False
        save_atomic(path, build())
    arr = _load(path)
    if arr is None:
        raise RuntimeError(f"data cache: could not read back {path}")
    return arr, path, True
