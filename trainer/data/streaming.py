"""Raw-text streaming: .jsonl / .parquet (any documents.py input) tokenized on the fly.

For users who do not pre-tokenize. The files are split into units (a file; a parquet
file's row groups each count as one), and the Q = dp x num_workers readers of the job
take units u with ``u mod Q == q`` from a per-epoch shuffle of the unit list, so no two
readers tokenize the same text and tokenization runs in the DataLoader workers. A reader
packs its documents as ``[BOS] text [EOS]`` into windows of seq_len + 1 tokens that share
one boundary token, like the random-access sources.

State (per reader): epoch, position in its unit list, records consumed in the current
unit, and the tokens carried over to the next window (< seq_len + 1). Resuming reopens
the unit and skips that many records (read, not tokenized), so it is exact on the same
dp degree and worker count; on another layout each reader starts at the saved fraction
of the epoch instead (see DataLoader.load_state_dict).
"""

from __future__ import annotations

import os

import numpy as np

from configuration.fields import ConfigError
from trainer.data.documents import file_records, list_input_files, row_group_records
from trainer.data.sampling import Permutation, derive_keys


def _units(files: list[str]) -> list[tuple[str, int]]:
    """(file, row group or -1 for the whole file)."""
    out = []
    for f in files:
        if f.endswith(".parquet"):
            import pyarrow.parquet as pq

            out += [(f, g) for g in range(pq.ParquetFile(f).num_row_groups)]
        else:
            out.append((f, -1))
    return out


def _unit_records(unit: tuple[str, int], text_field: str, skip: int):
    path, group = unit
    return file_records(path, text_field, skip) if group < 0 else row_group_records(path, group, text_field, skip)


class TextStreamSource:
    """A streaming source; `reader(q, Q, state)` makes reader q of Q."""

    kind = "stream"
    num_windows = None

    def __init__(self, path: str, tokenizer_path: str, *, seq_len: int, seed: int, text_field: str, name: str,
                 split: str | None = None):
        self.files = list_input_files(path, split=split, what=f"data source {name!r} path")
        self.units = _units(self.files)
        self.tokenizer_path, self.seq_len, self.seed = tokenizer_path, seq_len, seed
        self.text_field, self.name = text_field, name

    def reader(self, q: int, num_readers: int, state: dict | None) -> "TextStreamReader":
        if len(self.units) < num_readers:
            raise ConfigError(f"config error: data source {self.name!r}: {len(self.units)} files/row groups for "
                              f"{num_readers} readers (dp x data.num_workers); streaming gives each reader whole "
                              "files, so split the data into more files, lower data.num_workers, or pre-tokenize "
                              "with scripts/tokenize_data.py")
        return TextStreamReader(self, q, num_readers, state)

    def describe(self) -> str:
        return (f"{self.name}: streaming {len(self.files)} file(s) in {len(self.units)} units from "
                f"{os.path.commonpath(self.files) if self.files else '?'}, tokenized on the fly")


class TextStreamReader:
    def __init__(self, source: TextStreamSource, q: int, num_readers: int, state: dict | None):
        from trainer.data.tokenizer import build_tokenizer

        self.source, self.q, self.num_readers = source, q, num_readers
        self.tokenizer = build_tokenizer(source.tokenizer_path)
        state = state or {"epoch": 0, "cursor": 0, "record": 0, "carry": []}
        self.epoch = int(state["epoch"])
        self._set_epoch_units()
        self.cursor = int(state["cursor"]) if "cursor" in state else int(state["fraction"] * len(self.my_units))
        self.record = int(state.get("record", 0))
        self.carry = [int(t) for t in state.get("carry", [])]
        self._records = None

    def _set_epoch_units(self) -> None:
        n = len(self.source.units)
        order = Permutation(n, derive_keys(self.source.seed, 0xF11E, self.epoch))(np.arange(n))
        self.my_units = [self.source.units[int(u)] for u in order[self.q::self.num_readers]]

    def _next_document(self) -> list[int]:
        while True:
            if self._records is None:
                if self.cursor >= len(self.my_units):
                    self.epoch, self.cursor, self.record = self.epoch + 1, 0, 0
                    self._set_epoch_units()
                self._records = _unit_records(self.my_units[self.cursor], self.source.text_field, self.record)
            text = next(self._records, StopIteration)
            if text is StopIteration:
                self._records, self.cursor, self.record = None, self.cursor + 1, 0
                continue
            self.record += 1
            if text is not None:  # documents.usable_text decided
                return self.tokenizer.encode(text, bos=True, eos=True)

    def take(self, n: int) -> np.ndarray:
        """The next n windows [n, seq_len + 1]; consecutive windows share a boundary token."""
        L = self.source.seq_len + 1
        out = np.empty((n, L), dtype=np.int64)
        for i in range(n):
            while len(self.carry) < L:
                self.carry.extend(self._next_document())
            out[i] = self.carry[:L]
            self.carry = self.carry[L - 1:]
        return out

    def state(self) -> dict:
        return {"epoch": self.epoch, "cursor": self.cursor, "record": self.record, "carry": list(self.carry),
                "fraction": self.cursor / max(1, len(self.my_units))}
