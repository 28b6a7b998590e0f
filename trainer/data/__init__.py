"""Data pipeline: tokenizer, token sources, and a resumable data-parallel loader.

`build_dataloader(...)` returns a torchdata StatefulDataLoader over an infinite
stream of ``(inputs, labels)`` int64 batches of shape [local_batch_size, seq_len],
with ``labels`` = ``inputs`` shifted left by one. Its ``state_dict()`` /
``load_state_dict()`` resume exactly, across epoch boundaries too. The stream
object is ``loader.dataset`` (``describe()`` gives a one-line summary).
"""

from __future__ import annotations

import logging
import warnings

from torchdata.stateful_dataloader import StatefulDataLoader

from trainer.configurable import ConfigError
from trainer.data.datasets import (
    BatchStream,
    PackedWindowDataset,
    SyntheticDataset,
    builtin_tokens,
    files_tokens,
)
from trainer.data.tokenizer import Tokenizer, build_tokenizer

__all__ = ["Tokenizer", "build_tokenizer", "build_dataset", "build_dataloader", "DATASETS"]

DATASETS = ("builtin", "synthetic", "files")

logger = logging.getLogger(__name__)


def _keep_batch(batch):
    """Identity collate: the stream already yields (inputs, labels) tuples of tensors."""
    return batch


def build_dataset(*, dataset: str, dataset_path: str | None, tokenizer: Tokenizer, seq_len: int,
                  local_batch_size: int, dp_rank: int, dp_world_size: int, seed: int) -> BatchStream:
    """The batch stream behind `build_dataloader` (same arguments, minus num_workers)."""
    if dp_world_size < 1 or not 0 <= dp_rank < dp_world_size:
        raise ValueError(f"dp_rank={dp_rank} is not in [0, dp_world_size={dp_world_size})")
    if seq_len < 1 or local_batch_size < 1:
        raise ValueError(f"seq_len={seq_len} and local_batch_size={local_batch_size} must be >= 1")
    if dataset == "synthetic":
        ds: BatchStream = SyntheticDataset(vocab_size=tokenizer.vocab_size, seq_len=seq_len,
                                           local_batch_size=local_batch_size, dp_rank=dp_rank, seed=seed)
    elif dataset in ("builtin", "files"):
        tokens = builtin_tokens(tokenizer) if dataset == "builtin" else files_tokens(tokenizer, dataset_path)
        ds = PackedWindowDataset(tokens, seq_len=seq_len, local_batch_size=local_batch_size, dp_rank=dp_rank,
                                 dp_world_size=dp_world_size, seed=seed, name=dataset)
    else:
        raise ConfigError(f"config error: training.dataset: unknown dataset {dataset!r}; use one of "
                          f"{', '.join(DATASETS)}")
    logger.info("data: %s", ds.describe())
    return ds


def build_dataloader(*, dataset: str, dataset_path: str | None, tokenizer: Tokenizer, seq_len: int,
                     local_batch_size: int, dp_rank: int, dp_world_size: int, seed: int,
                     num_workers: int = 0) -> StatefulDataLoader:
    """An infinite, resumable loader of (inputs, labels) for one data-parallel rank.

    Every rank gets the same number of batches per epoch and, within an epoch, a
    disjoint set of windows. The batch sequence does not depend on num_workers.
    Resume needs the same num_workers as the saved state.
    """
    ds = build_dataset(dataset=dataset, dataset_path=dataset_path, tokenizer=tokenizer, seq_len=seq_len,
                       local_batch_size=local_batch_size, dp_rank=dp_rank, dp_world_size=dp_world_size, seed=seed)
    kwargs = {"prefetch_factor": 2} if num_workers > 0 else {}
    # batch_size=None: the stream yields whole batches (that keeps the order independent of workers).
    with warnings.catch_warnings():  # torchdata calls the deprecated torch.set_vital in __init__
        warnings.filterwarnings("ignore", message=".*set_vital.*")
        return StatefulDataLoader(ds, batch_size=None, num_workers=num_workers, collate_fn=_keep_batch, **kwargs)
