"""Tokenizers: HF `tokenizer.json` files and tiktoken-format BPE files, one API.

`build_tokenizer(path)` takes a file or a model folder and returns an object with
`encode(text, bos=, eos=)`, `encode_batch`, `decode`, `vocab_size`, `bos_id`,
`eos_id`, `pad_id`, `stop_ids`, `path` and `file_hash`:

* ``tokenizer.json`` (what Hugging Face folders ship) is read with the `tokenizers`
  library (`HFTokenizer`). Special-token strings inside the text are encoded as plain
  text, and the template BOS that the file's post-processor would add is not added:
  BOS/EOS come only from `bos=` / `eos=`, as for the tiktoken files.
* A tiktoken file has one line per base token: ``base64(token bytes) rank``. Ranks
  must be 0..N-1 and every single byte must be a token, so any text can be encoded.
  Special tokens get the ids right after the base ranks: a file with exactly 128000
  ranks is taken to be Llama 3's ``original/tokenizer.model`` and gets Llama 3's 256
  special tokens, so that ids match the released models; any other file gets 16 with
  the same leading names (``<|begin_of_text|>`` = N, ``<|end_of_text|>`` = N+1, ...).
  Text is split with Llama 3's pre-tokenizer regex before the merges are applied. The
  file is parsed here rather than by ``tiktoken.load``, so nothing is copied into
  tiktoken's download cache (``TIKTOKEN_CACHE_DIR``) for a local path.

In a model folder, BOS / EOS / pad are taken from ``tokenizer_config.json``
(`bos_token`, `eos_token`, `pad_token`), then ``generation_config.json`` (the ids,
whose EOS list also gives `stop_ids` for sampling), then ``config.json``; a folder's
``original/tokenizer.model`` uses its parent folder's files. A folder is searched for
``tokenizer.json``, then ``original/tokenizer.model``, then ``tokenizer.model``.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import os
from typing import Any

import tiktoken

from configuration.fields import ConfigError

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


class _SpecialIds:
    """BOS / EOS / pad handling shared by both tokenizer kinds. `bos_id` may be None (a
    tokenizer without BOS: `bos=True` then adds nothing); `stop_ids` are the ids that end
    a sampled continuation (EOS plus generation_config's other end tokens)."""

    bos_id: int | None
    eos_id: int
    pad_id: int | None = None
    stop_ids: frozenset = frozenset()

    def _wrap(self, ids: list[int], bos: bool, eos: bool) -> list[int]:
        if bos and self.bos_id is not None:
            ids.insert(0, self.bos_id)
        if eos:
            ids.append(self.eos_id)
        return ids

    def set_special_ids(self, specials: dict[str, Any]) -> None:
        """Overrides bos/eos/pad/stops with those a model folder declares (`folder_special_ids`)."""
        for key in ("bos_id", "eos_id", "pad_id"):
            if specials.get(key) is not None:
                setattr(self, key, specials[key])
        self.stop_ids = frozenset({self.eos_id, *specials.get("stop_ids", ())})

    def _describe(self, kind: str, extra: str = "") -> str:
        return (f"{kind}(path={self.path!r}, vocab_size={self.vocab_size}{extra}, bos_id={self.bos_id}, "
                f"eos_id={self.eos_id}, pad_id={self.pad_id})")


class Tokenizer(_SpecialIds):
    """Byte-level BPE (tiktoken) with Llama 3's regex and special tokens.

    Attributes: ``vocab_size`` (base ranks + special tokens), ``num_base_tokens``,
    ``bos_id``, ``eos_id``, ``pad_id``, ``stop_ids``, ``special_tokens`` (name -> id),
    ``path``, ``file_hash`` (sha256 hex of the file's bytes, and of the folder's
    special-token files when they set the ids).
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
        self.stop_ids = frozenset({self.eos_id})
        self._enc = tiktoken.Encoding(name=name, pat_str=LLAMA3_PATTERN, mergeable_ranks=ranks,
                                      special_tokens=self.special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.special_tokens.get(token)

    def encode(self, text: str, *, bos: bool = False, eos: bool = False) -> list[int]:
        """Encodes `text`. Special-token strings inside `text` are encoded as plain
        text (training data may contain them); use `bos`/`eos` to add the ids."""
        return self._wrap(self._enc.encode_ordinary(text), bos, eos)

    def encode_batch(self, texts: list[str], *, bos: bool = False, eos: bool = False,
                     num_threads: int = 2) -> list[list[int]]:
        """`encode` over many texts, using tiktoken's threads."""
        return [self._wrap(ids, bos, eos) for ids in self._enc.encode_ordinary_batch(texts, num_threads=num_threads)]

    def decode(self, ids: list[int]) -> str:
        """Decodes ids; special ids become their names, invalid UTF-8 becomes U+FFFD."""
        return self._enc.decode(list(ids))

    def token_bytes(self, token_id: int) -> bytes:
        return self._enc.decode_single_token_bytes(token_id)

    def __repr__(self) -> str:
        return self._describe("Tokenizer", f", base={self.num_base_tokens}")


class HFTokenizer(_SpecialIds):
    """A Hugging Face `tokenizer.json`, through the `tokenizers` library.

    `vocab_size` is the largest id + 1 (added tokens included). Special-token strings
    in the text are encoded as plain text, like `Tokenizer.encode`, and the file's
    post-processor (which may insert its own BOS) is not applied."""

    def __init__(self, path: str, specials: dict[str, Any], file_hash: str):
        from tokenizers import Tokenizer as RustTokenizer

        self.path, self.file_hash = os.path.abspath(path), file_hash
        self._tok = RustTokenizer.from_file(path)
        self._tok.encode_special_tokens = True  # "<|eot_id|>" in a document is text, not the special id
        vocab = self._tok.get_vocab(with_added_tokens=True)
        self.vocab_size = max(vocab.values()) + 1
        self.bos_id, self.eos_id = None, None
        self.set_special_ids(specials)
        if self.eos_id is None:
            raise ValueError("no EOS token: the folder's tokenizer_config.json (eos_token) or "
                             "generation_config.json (eos_token_id) must name one")

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def encode(self, text: str, *, bos: bool = False, eos: bool = False) -> list[int]:
        return self._wrap(self._tok.encode(text, add_special_tokens=False).ids, bos, eos)

    def encode_batch(self, texts: list[str], *, bos: bool = False, eos: bool = False,
                     num_threads: int = 2) -> list[list[int]]:
        """`encode` over many texts (the library's own thread pool; `num_threads` is ignored)."""
        return [self._wrap(e.ids, bos, eos) for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)

    def __repr__(self) -> str:
        return self._describe("HFTokenizer")


# ----------------------------------------------------------------------------- model folders

_SPECIAL_FILES = ("tokenizer_config.json", "generation_config.json", "config.json")


def _read_json(path: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            data = json.loads(f.read())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _as_list(v) -> list[int]:
    return [int(x) for x in v] if isinstance(v, list) else ([] if v is None else [int(v)])


def folder_special_ids(folder: str, token_to_id) -> dict[str, Any]:
    """bos_id / eos_id / pad_id / stop_ids that a model folder declares (keys missing when
    none does). Token strings of tokenizer_config.json win over the ids of
    generation_config.json, which win over config.json's."""
    found: dict[str, Any] = {}
    tok_cfg = _read_json(os.path.join(folder, "tokenizer_config.json"))
    for key in ("bos", "eos", "pad"):
        tok = tok_cfg.get(f"{key}_token")
        if isinstance(tok, dict):  # {"content": "<s>", "lstrip": false, ...}
            tok = tok.get("content")
        if isinstance(tok, str) and token_to_id(tok) is not None:
            found[f"{key}_id"] = token_to_id(tok)
    stops: list[int] = []
    for name in _SPECIAL_FILES[1:]:
        cfg = _read_json(os.path.join(folder, name))
        for key in ("bos", "eos", "pad"):
            ids = _as_list(cfg.get(f"{key}_token_id"))
            if ids and f"{key}_id" not in found:
                found[f"{key}_id"] = ids[0]
            if key == "eos":
                stops += ids
    found["stop_ids"] = stops
    return found


def _hash_files(paths: list[str]) -> str:
    h = hashlib.sha256()
    for i, p in enumerate(paths):
        if i == 0 or os.path.isfile(p):
            with open(p, "rb") as f:
                data = f.read()
            h.update(data if i == 0 else hashlib.sha256(data).digest())
    return h.hexdigest()


def _folder_of(path: str) -> str:
    """The model folder whose special-token files apply to a tokenizer file."""
    folder = os.path.dirname(os.path.abspath(path))
    return os.path.dirname(folder) if os.path.basename(folder) == "original" else folder


def resolve_tokenizer_file(path: str) -> str | None:
    """The tokenizer file a path means: itself, or the one a folder holds (None if none)."""
    if os.path.isfile(path):
        return path
    if os.path.isdir(path):
        for name in ("tokenizer.json", os.path.join("original", "tokenizer.model"), "tokenizer.model"):
            if os.path.isfile(os.path.join(path, name)):
                return os.path.join(path, name)
    return None


_FIX = ("point it at an HF tokenizer.json, a tiktoken BPE file (base64 token + rank per line, "
        "e.g. Llama 3's original/tokenizer.model), or a folder holding one")


# The tokenizers the shipped GPU configs name, which the repo does not hold (licences): the
# folder -> (Hub repo, file in it) that `scripts/download_tokenizer.py` fetches it from.
SHIPPED_TOKENIZERS = {
    "assets/tokenizer/llama3": ("meta-llama/Llama-3.1-8B", "original/tokenizer.model"),
    "assets/tokenizer/deepseek_v2": ("deepseek-ai/DeepSeek-V2-Lite", "tokenizer.json"),
    "assets/tokenizer/deepseek_v3": ("deepseek-ai/DeepSeek-V3", "tokenizer.json"),
    "assets/tokenizer/qwen3": ("Qwen/Qwen3-8B-Base", "tokenizer.json"),  # every Qwen3 size shares it
}
_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def missing_tokenizer_fix(path: str | None) -> str:
    """How to get the tokenizer at `path`: the exact download command for a shipped config's
    folder, else the general ways."""
    if path:
        rel = os.path.relpath(os.path.abspath(path), _REPO_ROOT).replace(os.sep, "/")
        for folder, (repo, filename) in SHIPPED_TOKENIZERS.items():
            if rel == folder or rel.startswith(folder + "/"):
                name = "" if filename == "original/tokenizer.model" else f" --filename {filename}"
                return (f"fetch it with `python scripts/download_tokenizer.py --repo_id {repo}{name} --local_dir "
                        f"{folder} --hf_token <token>`, or set --model.hf_path to a downloaded HF model folder")
    return ("build the debug one with `python scripts/train_tokenizer.py`, use an HF model folder, or fetch one with "
            "`python scripts/download_tokenizer.py --repo_id <hf repo> --hf_token <token>`")


def build_tokenizer(path: str, *, field: str = "model.tokenizer_path"):
    """Loads a tokenizer file or a model folder's tokenizer (see the module docstring);
    a missing or malformed one raises ConfigError in one line naming `field` (the option
    that gave the path)."""
    file = resolve_tokenizer_file(path) if path else None
    if file is None:
        what = "no tokenizer file or folder" if not (path and os.path.isdir(path)) else \
            "no tokenizer.json, original/tokenizer.model or tokenizer.model in the folder"
        raise ConfigError(f"config error: {field}: {what} at {path!r}; {missing_tokenizer_fix(path)}")
    folder = _folder_of(file)
    hashed = [file] + [os.path.join(folder, n) for n in _SPECIAL_FILES]
    if file.endswith(".json"):
        try:
            from tokenizers import Tokenizer as RustTokenizer

            probe = RustTokenizer.from_file(file)
            return HFTokenizer(file, folder_special_ids(folder, probe.token_to_id), _hash_files(hashed))
        except ImportError:
            raise ConfigError(f"config error: {field}: {file} needs the `tokenizers` library; "
                              "pip install tokenizers") from None
        except Exception as e:  # noqa: BLE001 - the Rust library raises its own exception types
            raise ConfigError(f"config error: {field}: {file} is not a valid tokenizer.json "
                              f"({' '.join(str(e).split())[:160]}); {_FIX}") from None
    with open(file, "rb") as f:
        data = f.read()
    try:
        ranks = parse_tiktoken_file(data, source=file)
    except ValueError as e:
        raise ConfigError(f"config error: {field}: {e}; {_FIX} (a sentencepiece .model is not "
                          "supported: use the folder's tokenizer.json)") from None
    name = os.path.splitext(os.path.basename(file))[0] or "tokenizer"
    tok = Tokenizer(ranks, name=name, path=os.path.abspath(file), file_hash=hashlib.sha256(data).hexdigest())
    specials = folder_special_ids(folder, tok.token_to_id)
    if any(specials.get(k) is not None for k in ("bos_id", "eos_id", "pad_id")) or specials["stop_ids"]:
        tok.set_special_ids(specials)
        tok.file_hash = _hash_files(hashed)
    return tok
