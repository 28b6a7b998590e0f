"""Reading documents out of the files users bring: .txt, .jsonl (+ .gz / .zst), .parquet,
.arrow, and folders written by Hugging Face `datasets.save_to_disk`.

Everything here streams: a file is read record by record (a line, or a parquet/arrow
record batch), never whole, so memory stays flat whatever the corpus size. Every
record has a stable position ``(file index, record index)`` in the sorted file list;
the offline tokenizer and the on-the-fly stream resume by skipping to a position
(reading, not tokenizing, the records before it), which works for compressed files
that cannot seek. `datasets` is not needed: its folders are Arrow IPC streams listed
in ``state.json``, which pyarrow reads directly.
"""

from __future__ import annotations

import codecs
import gzip
import io
import json
import logging
import os
import threading
from collections.abc import Iterator

from configuration.fields import ConfigError

JSONL_EXTENSIONS = (".jsonl", ".jsonl.gz", ".jsonl.zst", ".json.gz", ".json.zst", ".ndjson")
TEXT_EXTENSIONS = (".txt",)
TABLE_EXTENSIONS = (".parquet", ".arrow")
ALL_EXTENSIONS = TEXT_EXTENSIONS + JSONL_EXTENSIONS + TABLE_EXTENSIONS
RECORD_BATCH_ROWS = 1024  # parquet/arrow rows read at a time
logger = logging.getLogger(__name__)

# Bytes that are not UTF-8 become U+FFFD, as errors="replace" does, but are counted, so that
# a file in another encoding (Latin-1, UTF-16) is named once instead of training silently on
# replacement characters. Per thread: the decoder calls the handler on the reading thread.
_UTF8_ERRORS = "titan_count_replace"
_bad_bytes = threading.local()
_warned_files: set[str] = set()


def _count_and_replace(e: UnicodeDecodeError) -> tuple[str, int]:
    _bad_bytes.n = getattr(_bad_bytes, "n", 0) + (e.end - e.start)
    return "\ufffd", e.end


codecs.register_error(_UTF8_ERRORS, _count_and_replace)


def _counted_lines(f, path: str) -> Iterator[str]:
    """The lines of text file `f`; warns once per file if any of its bytes were not UTF-8
    (counted around each read, so files read in turn by one thread never mix counts)."""
    bad, lines = 0, iter(f)
    try:
        while True:
            before = getattr(_bad_bytes, "n", 0)
            try:
                line = next(lines)
            finally:
                bad += getattr(_bad_bytes, "n", 0) - before
            yield line
    except StopIteration:
        pass
    finally:
        if bad and path not in _warned_files:
            _warned_files.add(path)
            logger.warning("data: %s: %d bytes are not valid UTF-8 (read as U+FFFD); re-encode the file as UTF-8 "
                           "(e.g. iconv -f latin1 -t utf-8)", path, bad)


def usable_text(value) -> str | None:
    """The one rule for which records are documents, shared by every source (files, the
    offline tokenizer behind `tokens`, and `stream`): a string with something besides
    whitespace. Anything else (missing, not a string, empty, whitespace only) is None and
    is skipped, so the same corpus gives the same documents whichever way it is read."""
    return value if isinstance(value, str) and value.strip() else None


def require_text_column(path: str, columns: list[str], text_field: str) -> None:
    """A parquet/arrow file must have the text column; one line naming the file and the fix."""
    if text_field not in columns:
        raise ConfigError(f"config error: {path}: no column {text_field!r} (columns: {columns}); set the text "
                          "field to the text column (--text-field, or text_field of the data source)")


def _hidden(name: str) -> bool:
    return name.startswith(".") or name.startswith("_")


def datasets_folder_files(folder: str, split: str | None) -> list[str] | None:
    """The arrow files of a `save_to_disk` folder (a Dataset, or a DatasetDict's `split`), in
    their saved order; None if `folder` is not such a folder."""
    if os.path.isfile(os.path.join(folder, "dataset_dict.json")):
        with open(os.path.join(folder, "dataset_dict.json")) as f:
            splits = json.load(f).get("splits", [])
        pick = split or ("train" if "train" in splits else (splits[0] if len(splits) == 1 else None))
        if pick not in splits:
            raise ConfigError(f"config error: {folder} is a datasets DatasetDict with splits {splits}; "
                              f"choose one with --split (text_split in a config)")
        return datasets_folder_files(os.path.join(folder, pick), None)
    state = os.path.join(folder, "state.json")
    if not os.path.isfile(state):
        return None
    with open(state) as f:
        names = [d["filename"] for d in json.load(f).get("_data_files", [])]
    return [os.path.join(folder, n) for n in names]


def list_input_files(path: str, *, split: str | None = None, what: str = "input") -> list[str]:
    """Supported files under `path` (a file, a `datasets` folder, or a folder searched
    recursively; hidden files skipped), sorted by relative path."""
    fix = f"point {what} at a {', '.join(ALL_EXTENSIONS)} file, a folder of them, or a datasets.save_to_disk folder"
    if not path or not os.path.exists(path):
        raise ConfigError(f"config error: {what}: {path!r} does not exist; {fix}")
    if os.path.isfile(path):
        if not path.endswith(ALL_EXTENSIONS):
            raise ConfigError(f"config error: {what}: {path!r} is not a supported file; {fix}")
        return [path]
    saved = datasets_folder_files(path, split)
    if saved is not None:
        return saved
    files = []
    for d, dirs, names in os.walk(path):
        dirs[:] = sorted(x for x in dirs if not _hidden(x))
        files += [os.path.join(d, n) for n in names if n.endswith(ALL_EXTENSIONS) and not _hidden(n)]
    if not files:
        raise ConfigError(f"config error: {what}: no supported files under {path!r}; {fix}")
    return sorted(files, key=lambda p: os.path.relpath(p, path))


def _open_text(path: str):
    if path.endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8", errors=_UTF8_ERRORS)
    if path.endswith(".zst"):
        try:
            import zstandard
        except ImportError:
            raise ConfigError(f"config error: {path}: reading .zst needs `pip install zstandard`") from None
        raw = zstandard.ZstdDecompressor().stream_reader(open(path, "rb"), closefd=True)
        return io.TextIOWrapper(raw, encoding="utf-8", errors=_UTF8_ERRORS)
    return open(path, encoding="utf-8", errors=_UTF8_ERRORS)


def _jsonl_records(path: str, text_field: str, skip: int) -> Iterator[str | None]:
    with _open_text(path) as f:
        for lineno, line in enumerate(_counted_lines(f, path), 1):
            if lineno <= skip:
                continue
            if not line.strip():
                yield None
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(f"config error: {path}:{lineno} is not valid JSON ({e.msg}); fix or remove "
                                  "that line") from None
            yield usable_text(obj.get(text_field) if isinstance(obj, dict) else None)


def _record_batches(path: str, text_field: str):
    import pyarrow as pa

    if path.endswith(".parquet"):
        import pyarrow.parquet as pq

        pf = pq.ParquetFile(path)
        require_text_column(path, pf.schema_arrow.names, text_field)
        yield from pf.iter_batches(batch_size=RECORD_BATCH_ROWS, columns=[text_field])
        return
    source = pa.memory_map(path, "r")
    try:
        batches = iter(pa.ipc.open_stream(source))  # datasets writes the IPC stream format
    except pa.ArrowInvalid:
        file_reader = pa.ipc.open_file(source)
        batches = (file_reader.get_batch(i) for i in range(file_reader.num_record_batches))
    for batch in batches:
        require_text_column(path, batch.schema.names, text_field)
        yield batch.select([text_field])


def _table_records(path: str, text_field: str, skip: int) -> Iterator[str | None]:
    seen = 0
    for batch in _record_batches(path, text_field):
        n = batch.num_rows
        if seen + n <= skip:
            seen += n
            continue
        column = batch.column(0).to_pylist()
        for text in column[max(0, skip - seen):]:
            yield usable_text(text)
        seen += n


def row_group_records(path: str, group: int, text_field: str, skip: int = 0) -> Iterator[str | None]:
    """The records of one parquet row group after the first `skip` (text or None, as file_records)."""
    import pyarrow.parquet as pq

    pf = pq.ParquetFile(path)
    require_text_column(path, pf.schema_arrow.names, text_field)
    for text in pf.read_row_group(group, columns=[text_field]).column(0).to_pylist()[skip:]:
        yield usable_text(text)


def file_records(path: str, text_field: str = "text", skip: int = 0) -> Iterator[str | None]:
    """The records of one file after the first `skip`: the text, or None for a record
    without a usable text (usable_text: blank or whitespace-only, missing field, not a
    string). A .txt file is one record (the whole file)."""
    if path.endswith(TEXT_EXTENSIONS):
        if skip == 0:
            with open(path, encoding="utf-8", errors=_UTF8_ERRORS) as f:
                text = "".join(_counted_lines(iter(f.read, ""), path))  # one read, counted
            yield usable_text(text)
        return
    if path.endswith(TABLE_EXTENSIONS):
        yield from _table_records(path, text_field, skip)
        return
    yield from _jsonl_records(path, text_field, skip)


def iter_records(files: list[str], text_field: str = "text", start: tuple[int, int] = (0, 0),
                 ) -> Iterator[tuple[int, int, str | None]]:
    """(file index, record index, text or None) for every record from position `start` on."""
    first_file, first_record = start
    for fi in range(first_file, len(files)):
        skip = first_record if fi == first_file else 0
        for ri, text in enumerate(file_records(files[fi], text_field, skip), skip):
            yield fi, ri, text
