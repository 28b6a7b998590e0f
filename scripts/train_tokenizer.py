"""Trains the debug tokenizer: byte-level BPE on the builtin (stdlib docstring) corpus.

    python scripts/train_tokenizer.py                      # -> assets/tokenizer/tokenizer.model
    python scripts/train_tokenizer.py --num_ranks 4080 --output /tmp/tok.model

It writes exactly --num_ranks base ranks (default 2032: with the 16 special tokens
the tokenizer adds, that is a 2048-entry vocabulary, the debug model's). Ranks
0-255 are the single bytes in byte order; each later rank is one merge, in the
order learned. Text is split with Llama 3's pre-tokenizer regex, each distinct
chunk is counted once, and merges run over the counted chunks with incremental
pair counts and a lazy max-heap, so training takes seconds, not hours. Ties are
broken by the smaller (left, right) id pair, so the output is deterministic for a
given corpus (i.e. a given Python version).
"""

from __future__ import annotations

import argparse
import heapq
import os
import sys
import time
from collections import Counter, defaultdict

import regex

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from trainer.data.builtin_corpus import builtin_documents  # noqa: E402
from trainer.data.tokenizer import LLAMA3_PATTERN, build_tokenizer, write_tiktoken_file  # noqa: E402

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_OUTPUT = os.path.join(REPO_ROOT, "assets", "tokenizer", "tokenizer.model")


def count_chunks(docs: list[str]) -> Counter:
    """Distinct pre-tokenized chunks (as UTF-8 bytes) and how often each occurs."""
    pat = regex.compile(LLAMA3_PATTERN)
    counts: Counter = Counter()
    for doc in docs:
        counts.update(pat.findall(doc))
    return Counter({chunk.encode("utf-8"): n for chunk, n in counts.items()})


def _merge_word(word: list[int], a: int, b: int, new: int) -> list[int]:
    out, i, n = [], 0, len(word)
    while i < n:
        if i + 1 < n and word[i] == a and word[i + 1] == b:
            out.append(new)
            i += 2
        else:
            out.append(word[i])
            i += 1
    return out


def train_bpe(chunk_counts: Counter, num_ranks: int, log_every: int = 250) -> dict[bytes, int]:
    """Learns `num_ranks - 256` merges; returns {token bytes: rank} with ranks 0..num_ranks-1."""
    if num_ranks < 256:
        raise ValueError("num_ranks must be at least 256 (one per byte)")
    vocab: list[bytes] = [bytes([i]) for i in range(256)]
    ranks: dict[bytes, int] = {t: i for i, t in enumerate(vocab)}
    words: list[list[int]] = [list(chunk) for chunk in chunk_counts]
    freqs: list[int] = list(chunk_counts.values())

    pair_counts: dict[tuple[int, int], int] = defaultdict(int)
    where: dict[tuple[int, int], set[int]] = defaultdict(set)
    for wi, (word, f) in enumerate(zip(words, freqs)):
        for pair in zip(word, word[1:]):
            pair_counts[pair] += f
            where[pair].add(wi)
    heap = [(-c, p) for p, c in pair_counts.items()]
    heapq.heapify(heap)

    while len(ranks) < num_ranks:
        # Pop the most frequent pair whose heap entry is current.
        while heap:
            neg, pair = heapq.heappop(heap)
            if pair_counts.get(pair, 0) == -neg and -neg > 0:
                break
        else:
            raise RuntimeError(f"corpus too small: only {len(ranks)} ranks could be learned")
        a, b = pair
        token = vocab[a] + vocab[b]
        if token in ranks:  # same bytes reached by another split: reuse its id
            new = ranks[token]
        else:
            new = len(vocab)
            vocab.append(token)
            ranks[token] = new
        changed: set[tuple[int, int]] = set()
        for wi in sorted(where.pop(pair, ())):
            word, f = words[wi], freqs[wi]
            merged = _merge_word(word, a, b, new)
            if len(merged) == len(word):
                continue  # stale index entry
            for p in zip(word, word[1:]):
                pair_counts[p] -= f
                changed.add(p)
            for p in zip(merged, merged[1:]):
                pair_counts[p] += f
                where[p].add(wi)
                changed.add(p)
            words[wi] = merged
        pair_counts.pop(pair, None)
        for p in changed:
            c = pair_counts.get(p, 0)
            if c > 0:
                heapq.heappush(heap, (-c, p))
            else:
                pair_counts.pop(p, None)
        if log_every and len(ranks) % log_every == 0:
            print(f"  {len(ranks)} ranks, last merge {token!r} x{-neg}", flush=True)
    return ranks


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num_ranks", type=int, default=2032, help="base ranks to write (default 2032)")
    ap.add_argument("--output", default=DEFAULT_OUTPUT, help="output tiktoken file")
    ap.add_argument("--max_chars", type=int, default=0, help="train on the first N characters of the corpus only (0 = all)")
    args = ap.parse_args(argv)

    t0 = time.perf_counter()
    docs = builtin_documents()
    if args.max_chars:
        kept, total = [], 0
        for d in docs:
            if total >= args.max_chars:
                break
            kept.append(d)
            total += len(d)
        docs = kept
    n_chars = sum(map(len, docs))
    t1 = time.perf_counter()
    counts = count_chunks(docs)
    t2 = time.perf_counter()
    print(f"corpus: {len(docs)} docstrings, {n_chars:,} chars ({t1 - t0:.1f}s); {len(counts):,} distinct chunks, "
          f"{sum(counts.values()):,} in all ({t2 - t1:.1f}s)", flush=True)
    ranks = train_bpe(counts, args.num_ranks)
    t3 = time.perf_counter()
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    write_tiktoken_file(args.output, ranks)

    tok = build_tokenizer(args.output)
    sample = "\n\n".join(docs[:2000])
    n_tok = len(tok.encode(sample))
    assert tok.decode(tok.encode(sample)) == sample
    print(f"wrote {args.output}: {len(ranks)} ranks + {tok.vocab_size - len(ranks)} specials = vocab {tok.vocab_size}; "
          f"merges {t3 - t2:.1f}s, total {time.perf_counter() - t0:.1f}s; "
          f"{len(sample.encode()) / max(n_tok, 1):.2f} bytes/token on the first 2000 docstrings")


if __name__ == "__main__":
    main()
