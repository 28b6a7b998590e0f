"""Index arithmetic for shuffling and mixing without materialising anything dataset-sized.

`Permutation(n, key)` is a keyed pseudo-random bijection of [0, n): a Feistel network on
the smallest even number of bits covering n, with cycle walking to stay inside [0, n).
Any element is computed in O(1) and nothing of size n is stored, so a corpus of 10^9
windows gets a full global shuffle per epoch (a new key per epoch) in constant memory,
and a resumed run can jump straight to any position. (A materialised permutation of
10^9 int64 would be 8 GB per rank; a shuffle buffer would make position k depend on
everything before it.)

`Mixture(weights, seed)` assigns global sample i to a source with a Weyl sequence: u_i =
(i * G + offset) mod 2^64, G = 2^64 / golden ratio, lands in source s's slice of
[0, 2^64) of width weight_s. The sequence is equidistributed with very low discrepancy,
so every prefix holds each source within a few samples of its weight (an i.i.d. draw
would be off by sqrt(n)), and integer arithmetic makes it identical on every machine.
"""

from __future__ import annotations

import numpy as np

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
GOLDEN = np.uint64(0x9E3779B97F4A7C15)
ROUNDS = 6


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: a strong 64-bit hash (wrapping uint64 arithmetic)."""
    x = x ^ (x >> np.uint64(30))
    x = x * _M1
    x = x ^ (x >> np.uint64(27))
    x = x * _M2
    return x ^ (x >> np.uint64(31))


def derive_keys(*parts: int, count: int = ROUNDS) -> np.ndarray:
    """`count` uint64 keys from integers (seed, source, epoch, ...)."""
    return np.random.default_rng([int(p) & 0xFFFFFFFF for p in parts] + [0x5EED]).integers(
        0, 2**63, size=count, dtype=np.uint64)


class Permutation:
    """A keyed bijection of [0, n), evaluated elementwise on uint64/int64 arrays."""

    def __init__(self, n: int, keys: np.ndarray):
        if n < 1:
            raise ValueError(f"cannot permute {n} elements")
        self.n = n
        bits = max(2, (n - 1).bit_length())
        self.half = np.uint64((bits + 1) // 2)
        self.mask = np.uint64((1 << int(self.half)) - 1)
        self.keys = np.asarray(keys, dtype=np.uint64)

    def _round_trip(self, x: np.ndarray) -> np.ndarray:
        left, right = x >> self.half, x & self.mask
        for k in self.keys:
            left, right = right, left ^ (_mix(right ^ k) & self.mask)
        return (left << self.half) | right

    def __call__(self, idx) -> np.ndarray:
        x = np.asarray(idx, dtype=np.uint64)
        if self.n == 1:
            return np.zeros(x.shape, dtype=np.int64)
        with np.errstate(over="ignore"):
            y = self._round_trip(x)
            out = y >= np.uint64(self.n)
            while out.any():  # cycle walking: at most a few rounds, the domain is < 4n
                y[out] = self._round_trip(y[out])
                out = y >= np.uint64(self.n)
        return y.astype(np.int64)


class Mixture:
    """Deterministic weighted assignment of global sample indices to sources."""

    def __init__(self, weights: list[float], seed: int):
        w = np.asarray(weights, dtype=np.float64)
        if len(w) == 0 or (w <= 0).any() or not np.isfinite(w).all():
            raise ValueError(f"weights must be positive and finite, got {weights}")
        cum = np.cumsum(w / w.sum())[:-1]
        self.thresholds = np.array([min(int(c * 2**64), 2**64 - 1) for c in cum], dtype=np.uint64)
        self.offset = derive_keys(seed, 0x313, count=1)[0]
        self.weights = (w / w.sum()).tolist()

    def sources(self, start: int, count: int) -> np.ndarray:
        """Source ids of global samples start .. start+count-1."""
        if len(self.thresholds) == 0:
            return np.zeros(count, dtype=np.int64)
        i = np.arange(start, start + count, dtype=np.uint64)
        with np.errstate(over="ignore"):
            u = i * GOLDEN + self.offset
        return np.searchsorted(self.thresholds, u, side="right").astype(np.int64)
