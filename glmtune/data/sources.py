"""Data files as a stream of raw JSON records: JSONL lines, a `.json` list, Parquet rows or a `datasets`
`save_to_disk` folder. Everything after this (validation, format mapping, encoding, the Arrow cache) sees the
same (number, byte offset, raw JSON) triples, so every file type gets the same checks and the same messages.

    .jsonl (or any other file)   one record per line      errors name the line:   train.jsonl:12: ...
    .json                        a list of records        errors name the row:    train.json:row 3: ...
    .json not starting with [    one record per line (JSON lines named .json, as HF datasets, LLaMA-Factory and
                                 axolotl read them)       errors name the line:   train.json:12: ...
    .parquet                     one record per row       (rows count from 0, as data[3] and ds[3] do)
    folder with state.json       datasets.load_from_disk  one split; a DatasetDict folder names its splits

Parquet and saved datasets are read by pyarrow and `datasets` themselves; a column missing from a row reads as
None there and is dropped here, so it means what a missing key means in JSON.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Iterator

from ..config import ConfigError

ROW_SUFFIXES = (".json", ".parquet")
_ROW_BATCH = 1_000  # rows converted to Python objects at a time


class DataError(ConfigError):
    """A data file that cannot be trained on: one line `<file>:<line>: <what is wrong> — <what to do>`."""


def is_rows(path: Path) -> bool:
    """True when errors in this file name a row (0-based index) rather than a line."""
    if path.suffix.lower() == ".json" and path.is_file():
        return is_json_array(path)
    return path.is_dir() or path.suffix.lower() in ROW_SUFFIXES


def is_json_array(path: Path) -> bool:
    """A .json file is one JSON list when its first non-blank character (after a UTF-8 BOM) is `[`; anything else
    is read as JSON lines, one record per line."""
    with path.open("rb") as f:
        head = f.read(4096)
        while head and not head.lstrip(b"\xef\xbb\xbf \t\r\n"):  # only whitespace so far: read on
            more = f.read(4096)
            if not more:
                break
            head += more
    return head.lstrip(b"\xef\xbb\xbf \t\r\n")[:1] == b"["


def where(shown: str, number: int, rows: bool) -> str:
    return f"{shown}:row {number}" if rows else f"{shown}:{number}"


def is_saved_dataset(path: Path) -> bool:
    return path.is_dir() and ((path / "state.json").is_file() or (path / "dataset_dict.json").is_file())


def digest(path: Path, raw: bytes | None = None) -> str:
    """sha256 of the file, or of a saved dataset folder's files (by relative name): the cache key's content."""
    h = hashlib.sha256()
    if raw is not None or path.is_file():
        h.update(raw if raw is not None else path.read_bytes())
        return h.hexdigest()
    for file in sorted(p for p in path.rglob("*") if p.is_file()):
        h.update(str(file.relative_to(path)).encode() + b"\0" + file.read_bytes() + b"\0")
    return h.hexdigest()


def records(path: Path, shown: str, raw: bytes | None = None) -> Iterator[tuple[int, int, bytes]]:
    """(line number or row index, byte offset of the line (0 for rows), raw JSON bytes) of each non-blank record.
    A file that cannot be read as its type at all raises DataError."""
    if not is_rows(path):
        yield from _lines(raw if raw is not None else path.read_bytes())
    elif path.is_dir():
        yield from _arrow_rows(_saved_table(path, shown))
    elif path.suffix.lower() == ".parquet":
        yield from _arrow_rows(_parquet_table(path, shown))
    else:
        yield from _json_rows(raw if raw is not None else path.read_bytes(), shown)


def _lines(raw: bytes) -> Iterator[tuple[int, int, bytes]]:
    start, line_no = 0, 0
    while start <= len(raw):
        end = raw.find(b"\n", start)
        end = len(raw) if end < 0 else end
        line_no += 1
        chunk = raw[start:end]
        if chunk.strip():
            yield line_no, start, chunk
        start = end + 1


def _error(shown: str, what: str, fix: str) -> DataError:
    return DataError(f"{shown}: {what} — {fix}")


def _json_rows(raw: bytes, shown: str) -> Iterator[tuple[int, int, bytes]]:
    try:
        data = json.loads(raw.decode("utf-8-sig"))
    except UnicodeDecodeError as err:
        raise _error(shown, f"not valid UTF-8 (byte offset {err.start})", "re-save the file as UTF-8") from None
    except json.JSONDecodeError as err:
        raise DataError(
            f"{shown}:{err.lineno}: invalid JSON: {err.msg} (column {err.colno}) — a .json data file "
            "starting with [ is one JSON list of records; check its brackets and commas"
        ) from None
    if not isinstance(data, list):
        raise _error(
            shown,
            f"holds a JSON {type(data).__name__}, not a list of records",
            "write [{...}, {...}] (or one record per line in a .jsonl file)",
        )
    for index, record in enumerate(data):
        yield index, 0, json.dumps(record, ensure_ascii=False).encode()


def _parquet_table(path: Path, shown: str):
    import pyarrow.parquet as pq

    try:
        return pq.read_table(str(path))
    except (OSError, ValueError) as err:  # pyarrow's ArrowInvalid is a ValueError
        raise _error(
            shown,
            f"cannot be read as Parquet ({str(err).splitlines()[0][:120]})",
            "check the file, or name it .jsonl / .json for JSON",
        ) from None


def _saved_table(path: Path, shown: str):
    import datasets

    try:
        loaded = datasets.load_from_disk(str(path))
    except (OSError, ValueError, FileNotFoundError) as err:
        raise _error(
            shown,
            f"cannot be opened as a saved dataset ({str(err).splitlines()[0][:120]})",
            "point at a datasets.save_to_disk folder",
        ) from None
    if isinstance(loaded, datasets.DatasetDict):
        splits = ", ".join(loaded)
        raise _error(
            shown,
            f"is a DatasetDict with splits {splits}",
            f"point at one split's folder, e.g. {shown.rstrip('/')}/{next(iter(loaded), 'train')}",
        )
    if loaded._indices is not None:  # saved after select/shuffle: the rows in their selected order
        datasets.disable_progress_bars()
        loaded = loaded.flatten_indices()
        datasets.enable_progress_bars()
    return loaded.data.table


def _arrow_rows(table) -> Iterator[tuple[int, int, bytes]]:
    index = 0
    for batch in table.to_batches(max_chunksize=_ROW_BATCH):
        for row in batch.to_pylist():
            yield index, 0, json.dumps(_drop_none(row), ensure_ascii=False).encode()
            index += 1


def _drop_none(value: Any) -> Any:
    """Arrow gives every struct all the keys any row has, None where a row lacked one: drop those again."""
    if isinstance(value, dict):
        return {k: _drop_none(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_drop_none(v) for v in value]
    return value
