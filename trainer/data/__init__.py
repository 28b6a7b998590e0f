"""Data pipeline: sources -> one global, shuffled, mixed sample stream -> per-rank batches.

`build_dataloader(cfg.data, ...)` returns a `DataLoader` whose ``iter()`` yields
``(inputs, labels)`` int64 batches of shape [local_batch_size, seq_len], ``labels`` =
``inputs`` shifted left by one, forever (epochs roll over). ``state_dict()`` /
``load_state_dict()`` resume exactly, also on another dp degree or worker count
(trainer/data/stream.py explains why). ``metrics()`` gives the tokens drawn per source.

Sources (trainer/data/config.py): builtin and files are tokenized at start-up and cached
(trainer/data/datasets.py); tokens are folders of memory-mapped shards made once by
scripts/tokenize_data.py (shards.py); stream tokenizes jsonl/parquet on the fly
(streaming.py); synthetic is random tokens.
"""

# Exports resolve lazily so that tools such as scripts/tokenize_data.py import the package
# without paying for torch.
_EXPORTS = {
    "DataConfig": "trainer.data.config", "SOURCE_TYPES": "trainer.data.config",
    "DataLoader": "trainer.data.stream", "build_dataloader": "trainer.data.loader",
    "build_sources": "trainer.data.loader", "build_tokenizer": "trainer.data.tokenizer",
    "tokenize_documents": "trainer.data.datasets",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'trainer.data' has no attribute {name!r}")
