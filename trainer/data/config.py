"""[data]: where training tokens come from, and how sources are declared.

A source is a table ``{type, path, weight, name, text_field, split}``. ``type`` is one of
SOURCE_TYPES; without it, a folder written by scripts/tokenize_data.py is ``tokens`` and
any other path is ``files``. One source is given by ``data.type`` / ``data.path``; a
mixture by ``[[data.sources]]`` tables (which then replace type/path). The same parser
reads ``validation.sources``, so every source error names its key in one line.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from configuration.fields import ConfigError, opt

SOURCE_TYPES = ("builtin", "synthetic", "files", "tokens", "stream")
NEEDS_PATH = ("files", "tokens", "stream")
SOURCE_KEYS = ("type", "path", "weight", "name", "text_field", "split")
TYPE_DOC = ("builtin (Python stdlib docstrings, offline), synthetic (random tokens), files (.txt/.jsonl/.parquet/"
            "datasets folder tokenized at start-up and cached; small corpora), tokens (a folder made by "
            "scripts/tokenize_data.py, memory-mapped), stream (jsonl/parquet tokenized on the fly in DataLoader "
            "workers)")


@dataclass
class SourceSpec:
    type: str
    path: str | None
    weight: float
    name: str
    text_field: str
    split: str | None


def _infer_type(path: str | None) -> str:
    from trainer.data.shards import is_token_folder

    return "tokens" if path and is_token_folder(path) else "files"


def parse_source(item: Any, key: str, defaults: "DataConfig | None" = None) -> SourceSpec:
    """One source table (or a bare path string) -> SourceSpec, or a one-line ConfigError."""
    if isinstance(item, str):
        item = {"path": item}
    if not isinstance(item, dict):
        raise ConfigError(f"config error: {key}: expected a table with path and weight, got {item!r}")
    unknown = sorted(set(item) - set(SOURCE_KEYS))
    if unknown:
        raise ConfigError(f"config error: {key}: unknown key(s) {unknown}; a source has {', '.join(SOURCE_KEYS)}")
    path = item.get("path")
    if path is not None and not isinstance(path, str):
        raise ConfigError(f"config error: {key}.path: expected a string, got {path!r}")
    typ = item.get("type") or _infer_type(path)
    if typ not in SOURCE_TYPES:
        raise ConfigError(f"config error: {key}.type: unknown source type {typ!r}; use one of "
                          f"{', '.join(SOURCE_TYPES)}")
    if typ in NEEDS_PATH and not path:
        raise ConfigError(f"config error: {key}.path: a {typ} source needs a path (file or folder)")
    weight = item.get("weight", 1.0)
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not weight > 0 or weight == float("inf"):
        raise ConfigError(f"config error: {key}.weight: expected a positive number, got {weight!r}")
    name = item.get("name") or (os.path.basename(os.path.normpath(path)) if path else typ)
    text_field = item.get("text_field") or (defaults.text_field if defaults else "text")
    split = item.get("split") or (defaults.split if defaults else None)
    return SourceSpec(typ, path, float(weight), str(name), str(text_field), split)


def parse_sources(items: list, key: str, defaults: "DataConfig | None" = None) -> list[SourceSpec]:
    specs = [parse_source(item, f"{key}[{i}]", defaults) for i, item in enumerate(items)]
    names = [s.name for s in specs]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ConfigError(f"config error: {key}: sources named {dup} more than once; give each a distinct name")
    return specs


@dataclass
class DataConfig:
    """[data]"""

    type: str = opt("builtin", "Source type when no data.sources are given: " + TYPE_DOC + ".",
                    choices=SOURCE_TYPES)
    path: str | None = opt(None, "File or folder for type files, tokens or stream.")
    text_field: str = opt("text", "JSON key / column with the text (jsonl, parquet, arrow, datasets folders).")
    split: str | None = opt(None, "Split of a datasets DatasetDict folder (default: train).")
    sources: list[Any] = opt([], "A weighted mixture: [[data.sources]] tables with path and weight (and optionally "
                             "type, name, text_field, split); replaces data.type/data.path. On the command line: "
                             "a TOML inline array (\"[{path='/d/a', weight=0.7}, {path='/d/b', weight=0.3}]\") "
                             "or comma-separated paths, weight 1 each.")
    num_workers: int = opt(0, "DataLoader worker processes per rank (streaming sources tokenize in them).", min=0)
    document_masking: bool = opt(False, "Block-causal attention inside each packed window (no attention across "
                                 "documents) and RoPE positions restarting at each document.")

    def source_specs(self) -> list[SourceSpec]:
        if self.sources:
            return parse_sources(self.sources, "data.sources", self)
        return [parse_source({"type": self.type, "path": self.path}, "data", self)]

    def validate(self, root) -> None:
        self.source_specs()
        if self.path and not self.sources and self.type not in NEEDS_PATH:
            # before: the path was ignored and the run trained on builtin text without a word
            raise ConfigError(f"config error: data.path: read only by data.type {', '.join(NEEDS_PATH)}, but "
                              f"data.type is {self.type}; set --data.type files (or tokens, stream) or drop "
                              "data.path")
        if self.document_masking and root.parallelism.context_parallel_degree > 1:
            raise ConfigError("config error: data.document_masking: not supported with "
                              "parallelism.context_parallel_degree > 1 yet (the CP attention takes no document "
                              "mask); turn one of them off")
