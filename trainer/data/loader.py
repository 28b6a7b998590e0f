"""Building sources and the per-rank loader from [data] (see trainer/data/__init__.py)."""


from __future__ import annotations

import logging

from configuration.fields import ConfigError
from trainer.data.config import SOURCE_TYPES, DataConfig, SourceSpec
from trainer.data.datasets import builtin_tokens, files_tokens
from trainer.data.shards import TokenShards, tokenizer_hash
from trainer.data.stream import DataLoader, MixtureStream
from trainer.data.windows import ArrayWindows, ShardWindows, SyntheticWindows, WindowRange

logger = logging.getLogger(__name__)


def open_token_folder(spec: SourceSpec, *, tokenizer, tokenizer_path: str) -> TokenShards:
    """A `tokens` source's folder, refused in one line unless it was made with this run's
    tokenizer: the same file hash and the same BOS/EOS ids."""
    return TokenShards(spec.path, expect_tokenizer_hash=tokenizer_hash(tokenizer_path),
                       expect_special_ids=(tokenizer.bos_id, tokenizer.eos_id), what=f"data source {spec.name!r} path")


def check_token_folders(specs: list[SourceSpec], *, tokenizer, tokenizer_path: str) -> None:
    """The pre-launch check of every `tokens` source (reads manifests only)."""
    for spec in specs:
        if spec.type == "tokens":
            open_token_folder(spec, tokenizer=tokenizer, tokenizer_path=tokenizer_path)


def build_source(spec: SourceSpec, *, tokenizer, tokenizer_path: str, seq_len: int, seed: int):
    key = f"data source {spec.name!r}"
    if spec.type == "synthetic":
        return SyntheticWindows(tokenizer.vocab_size, seq_len, seed, spec.name)
    if spec.type == "stream":
        from trainer.data.streaming import TextStreamSource

        return TextStreamSource(spec.path, tokenizer_path, seq_len=seq_len, seed=seed, text_field=spec.text_field,
                                name=spec.name, split=spec.split)
    sha = tokenizer_hash(tokenizer_path)
    if spec.type == "tokens":
        source = ShardWindows(open_token_folder(spec, tokenizer=tokenizer, tokenizer_path=tokenizer_path), seq_len,
                              spec.name)
    elif spec.type == "builtin":
        source = ArrayWindows(builtin_tokens(tokenizer, sha), seq_len, spec.name)
    elif spec.type == "files":
        source = ArrayWindows(files_tokens(tokenizer, sha, spec.path, text_field=spec.text_field, split=spec.split,
                                           what=f"{key} path"), seq_len, spec.name)
    else:  # parse_source already rejects these; this guards direct callers
        raise ConfigError(f"config error: {key}: unknown source type {spec.type!r}; use one of "
                          f"{', '.join(SOURCE_TYPES)}")
    if source.num_windows < 1:
        raise ConfigError(f"config error: training.seq_len: {key} has fewer than seq_len+1={seq_len + 1} tokens; "
                          "lower training.seq_len or use more data")
    return source


# Windows left out between the training rest and the held-out tail: consecutive windows share
# one boundary token (windows.py), so without a gap the last training label would be the first
# validation input.
HOLDOUT_GAP = 1


def split_holdout(source, fraction: float, part: str):
    """The training rest or the held-out tail (last `fraction` of the windows) of a source,
    HOLDOUT_GAP windows apart so that no token is in both."""
    if fraction <= 0 or source.num_windows is None:
        return source
    if source.kind == "stream":
        raise ConfigError(f"config error: validation.sources: data source {source.name!r} streams raw text and "
                          "cannot hold out a fraction; give validation its own sources")
    held = max(1, int(source.num_windows * fraction))
    if held + HOLDOUT_GAP >= source.num_windows:
        raise ConfigError(f"config error: validation.holdout: {fraction} leaves no training windows in "
                          f"{source.name!r} ({source.num_windows} windows); lower it")
    first_held = source.num_windows - held
    lo, hi = (0, first_held - HOLDOUT_GAP) if part == "train" else (first_held, source.num_windows)
    return WindowRange(source, lo, hi, source.name)


def build_sources(specs: list[SourceSpec], *, tokenizer, tokenizer_path: str, seq_len: int, seed: int,
                  holdout: float = 0.0, part: str = "train") -> list:
    return [split_holdout(build_source(s, tokenizer=tokenizer, tokenizer_path=tokenizer_path, seq_len=seq_len,
                                       seed=seed), holdout, part) for s in specs]


def build_dataloader(data: DataConfig, *, tokenizer, tokenizer_path: str, seq_len: int, local_batch_size: int,
                     dp_rank: int, dp_world_size: int, seed: int, specs: list[SourceSpec] | None = None,
                     holdout: float = 0.0, part: str = "train", num_workers: int | None = None) -> DataLoader:
    """The loader of one data-parallel rank. `specs` defaults to data's sources; `holdout`
    and `part` select the training rest or the held-out validation tail."""
    specs = specs if specs is not None else data.source_specs()
    sources = build_sources(specs, tokenizer=tokenizer, tokenizer_path=tokenizer_path, seq_len=seq_len, seed=seed,
                            holdout=holdout, part=part)
    if len(sources) == 1 and sources[0].num_windows is not None:
        need = local_batch_size * dp_world_size
        if sources[0].num_windows < need:
            raise ConfigError(
                f"config error: training.seq_len: data source {sources[0].name!r} has {sources[0].num_windows} "
                f"windows of seq_len+1={seq_len + 1}, fewer than local_batch_size x dp = {local_batch_size} x "
                f"{dp_world_size}; lower training.seq_len or training.local_batch_size, or use more data")
    stream = MixtureStream(sources, [s.weight for s in specs], seq_len=seq_len, local_batch_size=local_batch_size,
                           dp_rank=dp_rank, dp_world_size=dp_world_size, seed=seed)
    logger.info("data (%s): %s", part, stream.describe())
    return DataLoader(stream, num_workers=data.num_workers if num_workers is None else num_workers)
