"""A byte-level BPE tokenizer read from a tiktoken-format file.

The file has one line per base token: ``base64(token bytes) rank``. Ranks must be
0..N-1 and every single byte must be a token, so any text can be encoded.
Special tokens get the ids right after the base ranks:

* a file with exactly 128000 ranks is taken to be Llama 3's ``tokenizer.model``
  and gets Llama 3's 256 special tokens, so that ids match the released models;
* any other file gets 16 special tokens with the same leading names
  (``<|begin_of_text|>`` = N, ``<|end_of_text|>`` = N+1, ...).

Text is split with Llama 3's pre-tokenizer regex before the merges are applied.
The file is parsed here rather than by ``tiktoken.load``, so nothing is copied
into tiktoken's download cache (``TIKTOKEN_CACHE_DIR``) for a local path.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import os

import tiktoken

from trainer.configurable import ConfigError

# Llama 3's pre-tokenizer: contractions, letter runs with one optional leading
# non-letter, numbers of up to 3 digits, punctuation runs, newlines, whitespace.
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

LLAMA3_NUM_BASE_RANKS = 128000
LLAMA3_NUM_SPECIAL = 256
SMALL_NUM_SPECIAL = 16

BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|end_of_text|>"


def special_token_names(num: int) -> list[str]:
    """Llama 3's special-token names, in id order, truncated/padded to `num`."""
    names = [
        BOS_TOKEN,
        EOS_TOKEN,
        "<|reserved_special_token_0|>",
        "<|reserved_special_token_1|>",
        "<|finetune_right_pad_id|>",
        "<|reserved_special_token_2|>",
        "<|start_header_id|>",
        "<|end_header_id|>",
        "<|eom_id|>",
        "<|eot_id|>",
        "<|python_tag|>",
    ]
    reserved = 3
    while len(names) < num:
        names.append(f"<|reserved_special_token_{reserved}|>")
        reserved += 1
    return names[:num]


def parse_tiktoken_file(data: bytes, source: str = "<bytes>") -> dict[bytes, int]:
    """Parses ``base64 rank`` lines; raises ValueError naming the bad line."""
    ranks: dict[bytes, int] = {}
    for lineno, line in enumerate(data.splitlines(), 1):
        if not line.strip():
            continue
        parts = line.split()
        if len(parts) != 2:
            raise ValueError(f"{source}:{lineno}: expected 'base64_token rank', got {line[:60]!r}")
        try:
            token = base64.b64decode(parts[0], validate=True)
            rank = int(parts[1])
        except (binascii.Error, ValueError):
            raise ValueError(f"{source}:{lineno}: bad base64 token or rank in {line[:60]!r}") from None
        if token in ranks:
            raise ValueError(f"{source}:{lineno}: token {token!r} appears twice")
        ranks[token] = rank
    n = len(ranks)
    if n == 0:
        raise ValueError(f"{source}: no tokens")
    if sorted(ranks.values()) != list(range(n)):
        raise ValueError(f"{source}: ranks must be exactly 0..{n - 1} with no gaps or repeats")
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:
        raise ValueError(f"{source}: {len(missing)} single bytes have no token (e.g. {missing[0]}); "
                         "a byte-level BPE file needs all 256")
    return ranks


def write_tiktoken_file(path: str, ranks: dict[bytes, int]) -> None:
    """Writes `ranks` in tiktoken format, sorted by rank, atomically."""
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "wb") as f:
        for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
            f.write(base64.b64encode(token) + b" " + str(rank).encode() + b"\n")
    os.replace(tmp, path)


class Tokenizer:
    """Byte-level BPE (tiktoken) with Llama 3's regex and special tokens.

    Attributes: ``vocab_size`` (base ranks + special tokens), ``num_base_tokens``,
    ``bos_id``, ``eos_id``, ``special_tokens`` (name -> id), ``path``, ``file_hash``
    (sha256 hex of the file's bytes).
    """

    def __init__(self, ranks: dict[bytes, int], *, name: str = "tokenizer", path: str | None = None,
                 file_hash: str | None = None):
        self.path = path
        if file_hash is None:  # built from a dict: hash the file it would be written as
            h = hashlib.sha256()
            for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
                h.update(base64.b64encode(token) + b" " + str(rank).encode() + b"\n")
            file_hash = h.hexdigest()
        self.file_hash = file_hash
        self.num_base_tokens = len(ranks)
        num_special = LLAMA3_NUM_SPECIAL if self.num_base_tokens == LLAMA3_NUM_BASE_RANKS else SMALL_NUM_SPECIAL
        self.special_tokens = {tok: self.num_base_tokens + i for i, tok in enumerate(special_token_names(num_special))}
        self.vocab_size = self.num_base_tokens + num_special
        self.bos_id = self.special_tokens[BOS_TOKEN]
        self.eos_id = self.special_tokens[EOS_TOKEN]
        self._enc = tiktoken.Encoding(name=name, pat_str=LLAMA3_PATTERN, mergeable_ranks=ranks,
                                      special_tokens=self.special_tokens)

    def encode(self, text: str, *, bos: bool = False, eos: bool = False) -> list[int]:
        """Encodes `text`. Special-token strings inside `text` are encoded as plain
        text (training data may contain them); use `bos`/`eos` to add the ids."""
        ids = self._enc.encode_ordinary(text)
        if bos:
            ids.insert(0, self.bos_id)
        if eos:
            ids.append(self.eos_id)
        return ids

    def encode_batch(self, texts: list[str], *, bos: bool = False, eos: bool = False,
                     num_threads: int = 2) -> list[list[int]]:
        """`encode` over many texts, using tiktoken's threads."""
        out = self._enc.encode_ordinary_batch(texts, num_threads=num_threads)
        for ids in out:
            if bos:
                ids.insert(0, self.bos_id)
            if eos:
                ids.append(self.eos_id)
        return out

    def decode(self, ids: list[int]) -> str:
        """Decodes ids; special ids become their names, invalid UTF-8 becomes U+FFFD."""
        return self._enc.decode(list(ids))

    def token_bytes(self, token_id: int) -> bytes:
        return self._enc.decode_single_token_bytes(token_id)

    def __repr__(self) -> str:
        return (f"Tokenizer(path={self.path!r}, vocab_size={self.vocab_size}, base={self.num_base_tokens}, "
                f"bos_id={self.bos_id}, eos_id={self.eos_id})")


def build_tokenizer(path: str) -> Tokenizer:
    """Loads a tiktoken-format file; a missing or malformed file raises ConfigError."""
    if not path or not os.path.isfile(path):
        raise ConfigError(f"config error: model.tokenizer_path: no tokenizer file at {path!r}; build the debug one with "
                          "`python scripts/train_tokenizer.py` or fetch Llama 3's with "
                          "`python scripts/download_tokenizer.py --repo_id <hf repo> --hf_token <token>`")
    with open(path, "rb") as f:
        data = f.read()
    try:
        ranks = parse_tiktoken_file(data, source=path)
    except ValueError as e:
        raise ConfigError(f"config error: model.tokenizer_path: {e}; point it at a tiktoken-format file "
                          "(base64 token + rank per line)") from None
    name = os.path.splitext(os.path.basename(path))[0] or "tokenizer"
    return Tokenizer(ranks, name=name, path=os.path.abspath(path), file_hash=hashlib.sha256(data).hexdigest())
