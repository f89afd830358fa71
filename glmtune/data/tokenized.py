"""One split of the Arrow cache as the Trainer sees it: a torch Dataset of the same dicts as ever,
{"input_ids": [...], "labels": [...]} plus "image" (an absolute path) on GLM-4V rows that have one.

The cache entry is a `datasets.save_to_disk` folder (so `datasets.load_from_disk(path)` opens it too); this
module opens its Arrow files with pyarrow alone, memory-mapped: nothing is copied into the process, the kernel
pages the columns in on first touch and every rank on the node shares those pages. Opening costs
milliseconds and no `import datasets` (about 1-2 s of imports that only a build needs).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute  # noqa: F401  (pa.compute)
import torch

# Columns of an entry, one row per conversation (blank lines have none). A dropped row (no target left after
# truncation) keeps its line and lengths for the stats and has empty input_ids/labels.
COLUMNS = ("line", "input_ids", "labels", "length", "untruncated", "targets", "image")


def read_table(folder: Path) -> pa.Table:
    """The entry's rows, memory-mapped (zero-copy), in the order `save_to_disk` listed its shards."""
    state = json.loads((folder / "state.json").read_text())
    tables = []
    for shard in state["_data_files"]:
        # Not closed here: the table's buffers point into the mapping, which lives as long as they do.
        tables.append(pa.ipc.open_stream(pa.memory_map(str(folder / shard["filename"]))).read_all())
    return pa.concat_tables(tables)


_NUMPY = {pa.int8(): np.int8, pa.int32(): np.int32, pa.int64(): np.int64}


def _numpy(array: pa.Array) -> np.ndarray:
    """A fixed-width array without nulls as a numpy view of its buffer (pyarrow's to_numpy imports pandas: 2 s)."""
    return np.frombuffer(array.buffers()[1], dtype=_NUMPY[array.type])[array.offset : array.offset + len(array)]


class _ListColumn:
    """Row i of a list<int32> column as a Python list, read straight from the mapped buffers."""

    def __init__(self, column: pa.ChunkedArray) -> None:
        self.offsets = [
            _numpy(pa.Array.from_buffers(pa.int32(), len(chunk) + 1, [None, chunk.buffers()[1]], offset=chunk.offset))
            for chunk in column.chunks
        ]
        self.values = [_numpy(chunk.values) for chunk in column.chunks]
        self.starts = np.cumsum([0] + [len(chunk) for chunk in column.chunks])

    def __getitem__(self, row: int) -> list[int]:
        chunk = int(np.searchsorted(self.starts, row, side="right")) - 1
        offsets, i = self.offsets[chunk], row - self.starts[chunk]
        return self.values[chunk][offsets[i] : offsets[i + 1]].tolist()


class TokenizedSplit(torch.utils.data.Dataset):
    """The kept examples of one split (rows with at least one target token), in file order."""

    def __init__(self, table: pa.Table, path: Path, built: bool) -> None:
        self.path = path  # the cache entry's folder
        self.built = built  # True when this process built the entry, False when it was already there
        self.table = table
        self._ids = _ListColumn(table.column("input_ids"))
        self._labels = _ListColumn(table.column("labels"))
        self._image = table.column("image")
        self._has_images = self._image.null_count < len(self._image)
        self.rows = np.flatnonzero(self.column("targets") > 0)  # dataset index -> table row

    @classmethod
    def open(cls, folder: Path, built: bool = False) -> TokenizedSplit:
        return cls(read_table(folder / "dataset"), folder, built)

    def column(self, name: str) -> np.ndarray:
        """A whole per-row column (line, length, untruncated, targets) as numpy; the image column as booleans."""
        if name == "image":
            chunks = [_numpy(pa.compute.cast(chunk.is_valid(), pa.int8())) for chunk in self._image.chunks]
            return np.concatenate(chunks or [np.zeros(0, np.int8)]).astype(bool)
        return np.concatenate([_numpy(chunk) for chunk in self.table.column(name).chunks] or [np.zeros(0, np.int32)])

    def target_counts(self) -> np.ndarray:
        """Target tokens per kept example, from the cached column (no token read): what the loss counts, since an
        example's first label is never a target (it starts with the [gMASK] prompt)."""
        return self.column("targets")[self.rows].astype(np.int64)

    def positions(self, image_extra: int) -> np.ndarray:
        """Positions of each kept example (tokens, plus image_extra when it has an image), from the length and
        image columns alone: packing plans and counts with these, never reading a token list."""
        lengths = self.column("length")[self.rows].astype(np.int64)
        if image_extra and self._has_images:
            lengths += self.column("image")[self.rows] * image_extra
        return lengths

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int | slice) -> Any:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        if not -len(self) <= index < len(self):
            raise IndexError(f"index {index} out of range for {len(self)} examples")
        row = int(self.rows[index])
        example: dict[str, Any] = {"input_ids": self._ids[row], "labels": self._labels[row]}
        if self._has_images:
            image = self._image[row].as_py()
            if image is not None:
                example["image"] = image
        return example

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return (self[i] for i in range(len(self)))
