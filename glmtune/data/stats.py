"""The numbers the data table shows: per split (examples, kept, dropped, truncated, length percentiles, tokens)
and, for several train files or a held-out val set, per file (its format, kept examples, mix weight, and how
many examples it gives the train and val sets)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import numpy as np


@dataclass
class SplitStats:
    """Lengths in tokens; p50/p95/max are of the kept examples after truncation."""

    examples: int  # conversations in the file
    kept: int  # examples with at least one target token left after truncation
    dropped: int  # examples whose every target token was cut off by truncation
    truncated: int  # kept examples that lost tokens to max_length
    p50: int
    p95: int
    max: int
    max_untruncated: int  # longest example before truncation (kept or dropped): what max_length would need
    tokens: int  # sum of kept lengths (tokens per epoch)
    target_tokens: int  # sum of labels != -100 over the kept examples
    dropped_lines: tuple[int, ...] = ()  # file line numbers of the dropped examples
    images: int = 0  # kept examples with an image
    image_tokens: int = 0  # embeddings the vision tower adds over the kept examples (N + 2 per image)


def split_stats(
    lines: np.ndarray,
    lengths: np.ndarray,
    untruncated: np.ndarray,
    targets: np.ndarray,
    has_image: np.ndarray,
    per_image: int,
) -> SplitStats:
    """Stats of one split from its per-example columns (the Arrow cache's; one entry per conversation).
    per_image: embeddings the vision tower adds per image (N + 2), 0 for a text model."""
    kept = targets > 0
    kept_lengths = lengths[kept]
    images = int(has_image[kept].sum())
    return SplitStats(
        examples=len(lines),
        kept=int(kept.sum()),
        dropped=int((~kept).sum()),
        truncated=int((untruncated[kept] > lengths[kept]).sum()),
        p50=_percentile(kept_lengths, 50),
        p95=_percentile(kept_lengths, 95),
        max=int(kept_lengths.max(initial=0)),
        max_untruncated=int(untruncated.max(initial=0)),
        tokens=int(kept_lengths.sum()),
        target_tokens=int(targets[kept].sum()),
        dropped_lines=tuple(int(n) for n in lines[~kept]),
        images=images,
        image_tokens=images * per_image,
    )


@dataclass
class FileStats:
    """One train file's part in a mixed or split train set (the data table's per-file rows)."""

    file: str  # as written in data.train_file
    records: str  # the record format read (formats.py; glm+openai: GLM with OpenAI records mapped)
    kept: int  # examples with a target token left after truncation
    dropped_lines: tuple[int, ...]  # lines (rows) dropped by truncation
    weight: Optional[float]  # its data.mix weight; None without data.mix
    train: int  # examples it supplies to the train set (repeats counted)
    val: int  # examples held out of it by data.val_size
    rows: bool = False  # errors and dropped examples name rows, not lines


@dataclass
class DataStats:
    max_length: int
    train: SplitStats
    val: Optional[SplitStats] = None
    files: tuple[FileStats, ...] = ()  # several train files or data.val_size: where the examples came from
    val_size: float = 0.0


def longest_length(stats: DataStats) -> int:
    """Longest kept example of any split, in tokens: the sequence length of a worst-case probe batch."""
    return max(stats.train.max, stats.val.max if stats.val is not None else 0)


def format_stats(stats: DataStats) -> str:
    """A small fixed-width table (plain text: no markup, fits logs and the console)."""
    rows = [("split", "examples", "kept", "dropped", "truncated", "p50", "p95", "max", "max untrunc.", "tokens")]
    for name, split in (("train", stats.train), ("val", stats.val)):
        if split is not None:
            rows.append(
                (
                    name,
                    *(
                        str(v)
                        for v in (
                            split.examples,
                            split.kept,
                            split.dropped,
                            split.truncated,
                            split.p50,
                            split.p95,
                            split.max,
                            split.max_untruncated,
                            split.tokens,
                        )
                    ),
                )
            )
    lines = [f"data (tokens, max_length={stats.max_length})", *_table(rows)]
    if stats.files:
        lines += _files_table(stats)
    for name, split in (("train", stats.train), ("val", stats.val)):
        if split is not None and split.images:
            each = split.image_tokens // split.images
            lines.append(
                f"{name}: {split.images} example(s) with an image: {each} image embeddings each replace "
                f"3 placeholder tokens (+{split.images * (each - 3)} positions beyond the counts above)"
            )
        if split is not None and split.dropped and split.dropped_lines:
            lines.append(_dropped(name, split.dropped_lines, split.dropped))
    for file in stats.files:
        if file.dropped_lines:
            lines.append(_dropped(file.file, file.dropped_lines, len(file.dropped_lines), file.rows))
    return "\n".join(lines)


def _files_table(stats: DataStats) -> list[str]:
    """Where the train (and held-out val) examples come from: one row per train file."""
    mixed = any(f.weight is not None for f in stats.files)
    head = (
        "train file",
        "format",
        "kept",
        *(("mix",) if mixed else ()),
        "in train",
        *((f"in val (val_size={stats.val_size:g})",) if stats.val_size else ()),
    )
    rows = [head]
    for f in stats.files:
        rows.append(
            (
                f.file,
                f.records,
                str(f.kept),
                *((f"{f.weight:g}",) if mixed else ()),
                str(f.train),
                *((str(f.val),) if stats.val_size else ()),
            )
        )
    return _table(rows)


def _table(rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return [
        "  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths)))
        for row in rows
    ]


def _dropped(name: str, numbers: tuple[int, ...], count: int, rows: bool = False) -> str:
    shown = ", ".join(str(n) for n in numbers[:10])
    return f"{name}: dropped (no target token left after truncation) {'rows' if rows else 'lines'} {shown}" + (
        ", …" if count > 10 else ""
    )


def _percentile(values: np.ndarray, percent: int) -> int:
    """Nearest-rank percentile (an actual example length, never interpolated); 0 for no values."""
    if not len(values):
        return 0
    ordered = np.sort(values)
    rank = max(1, math.ceil(percent / 100 * len(ordered)))
    return int(ordered[rank - 1])
