"""Packing: several short conversations per row, each one blind to the others (`data.packing=auto|on|off`).

    python -m glmtune data.packing=on data.pack_length=4096

GLM-4's demo data is short (prompts ~30-60, answers ~80-150 tokens): one example per step leaves a GPU
launch-bound (issue 13: 57 ms busy of a ~190 ms step at 512 tokens). Packing concatenates examples into rows
of up to `pack_length` positions, so one forward does the work of many.

A packed row is a plain dict, like an encoded example plus `lengths`:
    {"input_ids": [...], "labels": [...], "lengths": [n_1, n_2, ...], "images": [path, ...]}   (images: GLM-4V)
The collator (pipeline.DataCollator) turns `lengths` into
    position_ids = 0..n_1-1, 0..n_2-1, ...      (GLM rotary reads positions: every example starts at 0)
    seq_ids      = 0 (n_1 times), 1 (n_2 times), ..., -1 on padding
and the model attends only where query and key have the same seq id, causally (block-diagonal causal
mask), so every example sees exactly what it would see alone in its own row.

Labels: each example's first label is -100 (encode_conversation's shift makes it so; it is forced here
for any other source, e.g. the probe's synthetic rows). The model predicts label i from position i - 1,
so no example is ever a target of the one before it.

Loss weighting: the model's loss is the mean over every target token of the micro-batch (the reference
loss), packed or not. A packed row therefore weighs each target token equally — the same loss as an
unpacked batch holding the same examples, not a mean of per-example means. What packing changes is
how many examples share a micro-batch (and so an optimizer step): with packing a step covers more
examples, and `train.max_steps` counts steps of packed rows.

GLM-4V: an example with an image occupies len(input_ids) + (N - 1) positions (boi + N patches + eoi
replace 3 placeholders); pack_length counts positions, so a row's length after the model splices the
images stays within it. Rows may carry several images; the model splices each into its own example.
"""
from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch

from ..config import DataConfig
from .pipeline import IGNORE_INDEX, Datasets

# Default row length when data.pack_length is not set: on an H100 a 2,048-token row already runs the 9B model
# at ~47 % of the card's bf16 matmul rate, against ~15 % for a single 512-token example (issue 13).
DEFAULT_PACK_LENGTH = 2048
# `auto` packs when packing at least halves the forward passes: below that the saved launches are few.
AUTO_MIN_GAIN = 2.0


@dataclass
class PackStats:
    """One split, in positions (text tokens + image embeddings beyond the placeholders)."""

    examples: int
    rows: int
    pack_length: int
    positions: int  # sum of example positions
    max_images: int  # most images in one row (GLM-4V), for the planner
    oversize: int  # examples longer than pack_length, alone in a row of their own
    pad_unpacked: int  # padding of micro-batches of unpacked examples in file order, padded to their longest
    pad_packed: int  # padding of micro-batches of packed rows, padded to their longest

    @property
    def fill(self) -> float:
        """Real positions over rows x pack_length."""
        return self.positions / (self.rows * self.pack_length) if self.rows else 0.0


@dataclass
class Packing:
    enabled: bool
    reason: str
    pack_length: int
    train: Optional[PackStats] = None
    val: Optional[PackStats] = None

    def shape(self) -> Optional[tuple[int, int]]:
        """(row length in positions, images per row) for the planner and the probe; None when not packing."""
        if not self.enabled:
            return None
        splits = [s for s in (self.train, self.val) if s is not None]
        return self.pack_length, max((s.max_images for s in splits), default=0)


def positions(example: dict[str, Any], image_extra: int) -> int:
    """Sequence length of an example once the model spliced its image in."""
    return len(example["input_ids"]) + (image_extra if example.get("image") else 0)


def example_positions(split, image_extra: int) -> np.ndarray:
    """Positions of every example of a split: from the cache's length column for a TokenizedSplit (no token
    list is read: issue 25, 2.8 M list conversions at 200K conversations), else from the dicts themselves."""
    if hasattr(split, "positions"):
        return split.positions(image_extra)
    return np.array([positions(e, image_extra) for e in split], dtype=np.int64)


def plan_rows(lengths: np.ndarray, pack_length: int) -> tuple[np.ndarray, np.ndarray]:
    """Best-fit decreasing over example lengths: longest first, into the fullest row it still fits (O(n log n)).
    An example longer than pack_length gets a row of its own (it is never cut: max_length already did).
    Returns (members, offsets): row r holds examples members[offsets[r]:offsets[r + 1]], in index order, and
    rows come in order of their first example. Two int64 arrays, 8 B per example: no Python list per row."""
    order = np.argsort(-lengths, kind="stable").tolist()
    sizes = lengths.tolist()
    row_of = [0] * len(sizes)
    rows = 0
    # Free room as one sorted list of room * 2**32 + row: the first entry >= n * 2**32 is the best fit.
    free: list[int] = []
    for i in order:
        n = sizes[i]
        at = bisect.bisect_left(free, n << 32)
        if at < len(free):
            key = free.pop(at)
            room, row = key >> 32, key & 0xFFFFFFFF
            if room - n > 0:
                bisect.insort(free, ((room - n) << 32) | row)
        else:
            row, rows = rows, rows + 1
            if pack_length - n > 0:
                bisect.insort(free, ((pack_length - n) << 32) | row)
        row_of[i] = row
    row_of_np = np.asarray(row_of, dtype=np.int64)
    first = np.full(rows, len(sizes), dtype=np.int64)
    np.minimum.at(first, row_of_np, np.arange(len(sizes)))
    rank = np.empty(rows, dtype=np.int64)
    rank[np.argsort(first, kind="stable")] = np.arange(rows)  # renumber rows by their first example
    members = np.lexsort((np.arange(len(sizes)), rank[row_of_np]))
    offsets = np.concatenate([[0], np.cumsum(np.bincount(rank[row_of_np], minlength=rows))])
    return members, offsets


def pack(examples, pack_length: int, image_extra: int = 0) -> list[dict[str, Any]]:
    """Every packed row of `examples` (a list or split), as dicts: for tests and small data."""
    rows = PackedSplit(examples, *plan_rows(example_positions(examples, image_extra), pack_length))
    return [rows[i] for i in range(len(rows))]


class PackedSplit(torch.utils.data.Dataset):
    """Packed rows over a split, joined when the Trainer asks for one: only that row's examples are read
    (memory-mapped from the cache), so a launch never holds all the tokens as Python lists."""

    def __init__(self, split, members: np.ndarray, offsets: np.ndarray) -> None:
        self.split, self.members, self.offsets = split, members, offsets

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def target_counts(self) -> np.ndarray:
        """Target tokens per row (train/steps.py weighs each step by them), from the examples' cached counts."""
        counts = self.split.target_counts() if hasattr(self.split, "target_counts") else \
            np.array([sum(label != IGNORE_INDEX for label in e["labels"][1:]) for e in self.split], dtype=np.int64)
        return np.add.reduceat(counts[self.members], self.offsets[:-1]) if len(self.members) else counts[:0]

    def __getitem__(self, row: int) -> dict[str, Any]:
        if not -len(self) <= row < len(self):
            raise IndexError(f"row {row} out of range for {len(self)} packed rows")
        row %= len(self)
        return join_row([self.split[int(i)] for i in self.members[self.offsets[row]:self.offsets[row + 1]]])


def join_row(members: list[dict[str, Any]]) -> dict[str, Any]:
    """One packed row of `members`, in the given order."""
    ids: list[int] = []
    labels: list[int] = []
    for example in members:
        ids += example["input_ids"]
        labels += [IGNORE_INDEX, *example["labels"][1:]]  # never a target across the boundary
    row = {"input_ids": ids, "labels": labels, "lengths": [len(e["input_ids"]) for e in members]}
    images = [e["image"] for e in members if e.get("image")]
    if images:
        row["images"] = images
    return row


def split_stats(split, lengths: np.ndarray, members: np.ndarray, offsets: np.ndarray, pack_length: int,
                image_extra: int, micro_batch: int) -> PackStats:
    """Rows, fill and padding of one split, vectorized over the length (and image) columns."""
    row_positions = np.add.reduceat(lengths[members], offsets[:-1]) if len(members) else lengths[:0]
    max_images = 0
    if image_extra:
        if hasattr(split, "column"):
            has_image = split.column("image")[split.rows]
        else:
            has_image = np.array([bool(e.get("image")) for e in split])
        if has_image.any():
            max_images = int(np.add.reduceat(has_image[members].astype(np.int64), offsets[:-1]).max())
    return PackStats(examples=len(lengths), rows=len(offsets) - 1, pack_length=pack_length,
                     positions=int(lengths.sum()), max_images=max_images,
                     oversize=int((lengths > pack_length).sum()),
                     pad_unpacked=_padding(lengths, micro_batch), pad_packed=_padding(row_positions, micro_batch))


def _padding(lengths: np.ndarray, micro_batch: int) -> int:
    """Padding of consecutive micro-batches of `lengths`, each padded to its longest."""
    if not len(lengths):
        return 0
    starts = np.arange(0, len(lengths), micro_batch)
    counts = np.diff(np.append(starts, len(lengths)))
    return int((np.maximum.reduceat(lengths, starts) * counts).sum() - lengths.sum())


def pack_length_for(cfg: DataConfig, longest: int) -> int:
    """data.pack_length, or the default: DEFAULT_PACK_LENGTH, raised to the longest example's positions."""
    return cfg.pack_length if cfg.pack_length is not None else max(DEFAULT_PACK_LENGTH, longest)


def planned_packing(cfg: DataConfig, image_extra: int) -> Optional[tuple[int, int]]:
    """mode=plan reads no data: with data.packing=on, rows of the configured length, as many images as
    fit (every example an image and little text); auto and off plan unpacked examples."""
    if cfg.packing != "on":
        return None
    length = pack_length_for(cfg, cfg.max_length + image_extra)
    return length, (length // (image_extra + 3) if image_extra else 0)


def pack_datasets(cfg: DataConfig, data: Datasets, image_extra: int, micro_batch: int, on_gpu: bool
                  ) -> tuple[Datasets, Packing]:
    """Datasets of packed rows when data.packing says so (auto: on a GPU when it at least halves the rows).
    Off (or auto on CPU) does no packing work at all; on plans rows from the length columns and joins each
    row only when it is read (PackedSplit).

    image_extra: positions an image adds beyond its 3 placeholders (plan.estimate.image_extra_tokens)."""
    splits = [s for s in (data.train, data.val) if s is not None]
    lengths = [example_positions(s, image_extra) for s in splits]  # numpy over the cached columns: milliseconds
    length = pack_length_for(cfg, max(int(n.max(initial=0)) for n in lengths))
    if cfg.packing == "off":
        return data, Packing(False, "data.packing=off", length)
    if cfg.packing == "auto" and not on_gpu:
        return data, Packing(False, "auto: off on CPU (compute-bound per token: no launch overhead to save, and "
                                    "the dense block-diagonal mask costs attention over the whole row)", length)
    plans = [plan_rows(n, length) for n in lengths]
    stats = [split_stats(s, n, *p, length, image_extra, micro_batch) for s, n, p in zip(splits, lengths, plans)]
    gain = stats[0].examples / max(1, stats[0].rows)
    if cfg.packing == "on":
        enabled, reason = True, "data.packing=on"
    elif gain >= AUTO_MIN_GAIN:
        enabled, reason = True, f"auto: {gain:.1f} examples per row, {gain:.1f}x fewer forward passes"
    else:
        enabled, reason = False, f"auto: only {gain:.1f} examples per row (packs from {AUTO_MIN_GAIN:.0f})"
    result = Packing(enabled, reason, length, stats[0], stats[1] if len(stats) > 1 else None)
    if not enabled:
        return data, result
    packed = [PackedSplit(s, *p) for s, p in zip(splits, plans)]
    return Datasets(packed[0], packed[1] if len(packed) > 1 else None, data.stats), result


def format_packing(p: Packing, micro_batch: int) -> str:
    """Rows, fill and padding per split, plain text under the data table."""
    lines = [f"packing: {'on' if p.enabled else 'off'} ({p.reason})"
             + (f"; rows of {p.pack_length} positions" if p.train is not None else "")]
    for name, s in (("train", p.train), ("val", p.val)):
        if s is None:
            continue
        saved = s.pad_unpacked - s.pad_packed
        lines.append(f"  {name}: {s.examples} examples -> {s.rows} rows ({s.examples / max(1, s.rows):.1f} per row), "
                     f"fill {s.fill:.1%}; padding at micro-batch {micro_batch}: {s.pad_unpacked} unpacked vs "
                     f"{s.pad_packed} packed ({saved:+d} saved), forward passes "
                     f"{math.ceil(s.examples / micro_batch)} -> {math.ceil(s.rows / micro_batch)}"
                     + (f"; {s.oversize} example(s) longer than a row, alone in theirs" if s.oversize else ""))
    return "\n".join(lines)
