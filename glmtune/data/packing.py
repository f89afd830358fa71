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


def pack(examples: list[dict[str, Any]], pack_length: int, image_extra: int = 0) -> list[dict[str, Any]]:
    """Best-fit decreasing: longest example first, into the fullest row it still fits (O(n log n)).
    An example longer than pack_length gets a row of its own (it is never cut: max_length already did)."""
    order = sorted(range(len(examples)), key=lambda i: -positions(examples[i], image_extra))
    bins: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (room left, bin index), sorted: the first with room >= n is the best fit
    for i in order:
        n = positions(examples[i], image_extra)
        at = bisect.bisect_left(free, (n, -1))
        if at < len(free):
            room, b = free.pop(at)
            bins[b].append(i)
            if room - n > 0:
                bisect.insort(free, (room - n, b))
        else:
            bins.append([i])
            if pack_length - n > 0:
                bisect.insort(free, (pack_length - n, len(bins) - 1))
    # Rows keep the examples in file order inside them, and rows come in order of their first example.
    return [join_row([examples[i] for i in sorted(b)]) for b in sorted(bins, key=min)]


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


def split_stats(examples, rows, pack_length: int, image_extra: int, micro_batch: int) -> PackStats:
    oversize = sum(positions(e, image_extra) > pack_length for e in examples)
    return PackStats(examples=len(examples), rows=len(rows), pack_length=pack_length,
                     positions=sum(positions(e, image_extra) for e in examples),
                     max_images=max((len(r.get("images", ())) for r in rows), default=0), oversize=oversize,
                     pad_unpacked=_padding([positions(e, image_extra) for e in examples], micro_batch),
                     pad_packed=_padding([len(r["input_ids"]) + image_extra * len(r.get("images", ()))
                                          for r in rows], micro_batch))


def _padding(lengths: list[int], micro_batch: int) -> int:
    total = 0
    for start in range(0, len(lengths), micro_batch):
        chunk = lengths[start:start + micro_batch]
        total += max(chunk) * len(chunk) - sum(chunk)
    return total


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

    image_extra: positions an image adds beyond its 3 placeholders (plan.estimate.image_extra_tokens)."""
    splits = [s for s in (data.train, data.val) if s is not None]
    longest = max(positions(e, image_extra) for s in splits for e in s)
    length = pack_length_for(cfg, longest)
    packed = [pack(s, length, image_extra) for s in splits]
    stats = [split_stats(s, p, length, image_extra, micro_batch) for s, p in zip(splits, packed)]
    gain = stats[0].examples / max(1, stats[0].rows)
    if cfg.packing == "off":
        enabled, reason = False, "data.packing=off"
    elif cfg.packing == "on":
        enabled, reason = True, "data.packing=on"
    elif not on_gpu:
        enabled, reason = False, ("auto: off on CPU (compute-bound per token: no launch overhead to save, and the "
                                  "dense block-diagonal mask costs attention over the whole row)")
    elif gain >= AUTO_MIN_GAIN:
        enabled, reason = True, f"auto: {gain:.1f} examples per row, {gain:.1f}x fewer forward passes"
    else:
        enabled, reason = False, f"auto: only {gain:.1f} examples per row (packs from {AUTO_MIN_GAIN:.0f})"
    result = Packing(enabled, reason, length, stats[0], stats[1] if len(stats) > 1 else None)
    if not enabled:
        return data, result
    return Datasets(packed[0], packed[1] if len(packed) > 1 else None, data.stats), result


def format_packing(p: Packing, micro_batch: int) -> str:
    """Rows, fill and padding per split, plain text under the data table."""
    lines = [f"packing: {'on' if p.enabled else 'off'} ({p.reason}); rows of {p.pack_length} positions"]
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
