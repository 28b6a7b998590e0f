"""Random-access window sources: a source has `num_windows` windows of seq_len+1 tokens and
returns any of them by index, so the stream can shuffle and resume by arithmetic alone.

Packing: window i of a token array is ``tokens[i*seq_len : i*seq_len + seq_len + 1]``;
consecutive windows share one boundary token, so every token after the first is a label
exactly once per epoch. Token shards are windowed shard by shard (a window never spans
two shards; at most seq_len tokens per shard go unused).
"""

from __future__ import annotations

import numpy as np

from trainer.data.shards import TokenShards


class WindowSource:
    name: str = "source"
    num_windows: int | None = None  # None: infinite (synthetic)
    kind: str = "windows"

    def rows(self, idx: np.ndarray) -> np.ndarray:
        """[len(idx), seq_len + 1] tokens of the windows `idx`."""
        raise NotImplementedError

    def describe(self) -> str:
        raise NotImplementedError


class ArrayWindows(WindowSource):
    """Windows over one flat token array (an in-memory or memory-mapped corpus)."""

    def __init__(self, tokens: np.ndarray, seq_len: int, name: str):
        self.tokens, self.seq_len, self.name = tokens, seq_len, name
        self.num_windows = max(0, (len(tokens) - 1) // seq_len)

    def rows(self, idx: np.ndarray) -> np.ndarray:
        L = self.seq_len + 1
        return np.stack([self.tokens[s:s + L] for s in np.asarray(idx, dtype=np.int64) * self.seq_len])

    def describe(self) -> str:
        return f"{self.name}: {len(self.tokens):,} tokens, {self.num_windows:,} windows of {self.seq_len + 1}"


class ShardWindows(WindowSource):
    """Windows over a token folder; a window index maps to (shard, window in shard)."""

    def __init__(self, shards: TokenShards, seq_len: int, name: str):
        self.shards, self.seq_len, self.name = shards, seq_len, name
        per_shard = np.array([max(0, (s.tokens - 1) // seq_len) for s in shards.shards], dtype=np.int64)
        self.first = np.concatenate([[0], np.cumsum(per_shard)])  # [shards + 1]
        self.num_windows = int(self.first[-1])

    def rows(self, idx: np.ndarray) -> np.ndarray:
        idx = np.asarray(idx, dtype=np.int64)
        shard = np.searchsorted(self.first, idx, side="right") - 1
        start = (idx - self.first[shard]) * self.seq_len
        L = self.seq_len + 1
        return np.stack([self.shards.tokens(int(k))[s:s + L] for k, s in zip(shard, start)])

    def describe(self) -> str:
        return (f"{self.name}: {self.shards.num_tokens:,} tokens in {len(self.shards.shards)} shards "
                f"({self.shards.dtype.name}, memory-mapped), {self.num_windows:,} windows of {self.seq_len + 1}")


class WindowRange(WindowSource):
    """Windows lo .. hi-1 of another source: a held-out validation split, or the training rest."""

    def __init__(self, base: WindowSource, lo: int, hi: int, name: str):
        self.base, self.lo, self.name = base, lo, name
        self.num_windows = hi - lo

    def rows(self, idx: np.ndarray) -> np.ndarray:
        return self.base.rows(np.asarray(idx, dtype=np.int64) + self.lo)

    def describe(self) -> str:
        return f"{self.name}: windows {self.lo:,}..{self.lo + self.num_windows - 1:,} of [{self.base.describe()}]"


class SyntheticWindows(WindowSource):
    """Uniform random tokens; window i comes from a generator seeded with (seed, i)."""

    def __init__(self, vocab_size: int, seq_len: int, seed: int, name: str = "synthetic"):
        self.vocab_size, self.seq_len, self.seed, self.name = vocab_size, seq_len, seed, name

    def rows(self, idx: np.ndarray) -> np.ndarray:
        return np.stack([np.random.default_rng([self.seed, int(i)]).integers(0, self.vocab_size, self.seq_len + 1)
                         for i in idx])

    def describe(self) -> str:
        return f"{self.name}: random tokens in [0, {self.vocab_size}), infinite"
