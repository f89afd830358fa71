"""Packing: the examples of one micro-step laid into fewer, fuller rows (`data.packing=auto|on|off`).

    python -m glmtune data.packing=on data.pack_length=4096

Packing is a speed lever, never another training. The optimizer step's examples are decided first,
exactly as unpacked (train/steps.py: the global batch in examples, the same sampler and order), and each rank's
micro-batch receives the same examples it would receive unpacked. Only then are that micro-batch's examples laid,
first-fit in the sampler's order, into rows of up to `pack_length` positions (RowPacker, called by the collator):
a micro-batch of 8 examples of ~150 tokens becomes one row of ~1,200 positions instead of 8 rows padded to the
longest. The loss is still the step's summed token loss over its target tokens (train/steps.py), so packed and
unpacked train the same examples per step with the same gradient up to floating-point order; `train.max_steps`
and epochs count the same data, and `auto` may switch freely. What packing saves is padding, and on a GPU the
launches of many short rows; it never changes how many micro-batches (forward passes) a step takes.

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

Layouts the rule cannot keep as it is: the null slots of an epoch's last, short step (train/steps.py: copies of
an example with every label masked) are left out of the rows, since they carry no target; a micro-batch of null
slots only still runs one row of one of them (zero target tokens: zero loss, zero gradient), so every rank joins
the same collectives. Evaluation batches are not packed: the Trainer weighs each evaluation batch by its row
count, so packing them would change eval_loss.

GLM-4V: an example with an image occupies len(input_ids) + (N - 1) positions (boi + N patches + eoi
replace 3 placeholders); pack_length counts positions, so a row's length after the model splices the
images stays within it. Rows may carry several images; the model splices each into its own example.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from ..config import DataConfig
from .pipeline import IGNORE_INDEX

# Default row length when data.pack_length is not set: on an H100 a 2,048-token row already runs the 9B model
# at ~47 % of the card's bf16 matmul rate, against ~15 % for a single 512-token example (measured).
DEFAULT_PACK_LENGTH = 2048
# `auto` packs when packing at least halves the rows of a micro-batch: below that the saved launches are few.
AUTO_MIN_GAIN = 2.0
# The micro-step statistics draw the examples in a random order of this seed: an estimate of what the sampler's
# (train.seed's) order gives, without importing the trainer.
STATS_SEED = 0


@dataclass
class PackStats:
    """The train split cut into micro-batches of `micro_batch` examples, each packed; in positions (text tokens +
    image embeddings beyond the placeholders)."""

    examples: int
    micro_batch: int
    micro_steps: int  # micro-batches of one epoch (forward passes, packed or not)
    rows: int  # packed rows over those micro-batches
    most_rows: int  # most rows any one of those micro-batches became
    pack_length: int
    positions: int  # sum of example positions
    max_images: int  # most images in one row (GLM-4V), for the planner
    oversize: int  # examples longer than pack_length, alone in a row of their own
    pad_unpacked: int  # padding of the micro-batches unpacked, each padded to its longest example
    pad_packed: int  # padding of the same micro-batches packed, each padded to its longest row

    @property
    def rows_per_micro_step(self) -> float:
        return self.rows / self.micro_steps if self.micro_steps else 0.0

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
    image_extra: int = 0
    lengths: Optional[np.ndarray] = None  # positions of every train example, for stats at the plan's micro-batch

    def shape(self) -> Optional[tuple[int, int]]:
        """(row length in positions, images per row) for the planner and the probe; None when not packing."""
        if not self.enabled:
            return None
        return self.pack_length, self.train.max_images if self.train is not None else 0

    def packer(self) -> Optional[RowPacker]:
        """What the training collator packs each micro-batch with; None when not packing."""
        return RowPacker(self.pack_length, self.image_extra) if self.enabled else None


def positions(example: dict[str, Any], image_extra: int) -> int:
    """Sequence length of an example once the model spliced its image in."""
    return len(example["input_ids"]) + (image_extra if example.get("image") else 0)


def example_positions(split, image_extra: int) -> np.ndarray:
    """Positions of every example of a split: from the cache's length column for a TokenizedSplit (no token
    list is read: that was 2.8 M list conversions at 200K conversations), else from the dicts themselves."""
    if hasattr(split, "positions"):
        return split.positions(image_extra)
    return np.array([positions(e, image_extra) for e in split], dtype=np.int64)


def first_fit(lengths: list[int], pack_length: int) -> list[list[int]]:
    """Indices of `lengths` per row: each example, in the given order, into the first row it still fits; an
    example longer than pack_length gets a row of its own (it is never cut: max_length already did). Rows
    come in order of their first example. A micro-batch holds tens of examples: O(n x rows) is nothing."""
    rows: list[list[int]] = []
    room: list[int] = []
    for i, n in enumerate(lengths):
        at = next((r for r, free in enumerate(room) if n <= free), None)
        if at is None:
            rows.append([i])
            room.append(pack_length - n)
        else:
            rows[at].append(i)
            room[at] -= n
    return rows


@dataclass(frozen=True)
class RowPacker:
    """A micro-batch's examples -> its packed rows (first-fit, in the given order)."""

    pack_length: int
    image_extra: int = 0

    def __call__(self, examples: list[dict[str, Any]]) -> list[dict[str, Any]]:
        rows = first_fit([positions(e, self.image_extra) for e in examples], self.pack_length)
        return [join_row([examples[i] for i in row]) for row in rows]


def pack(examples, pack_length: int, image_extra: int = 0) -> list[dict[str, Any]]:
    """Every packed row of `examples` (a list or split) as one micro-batch: for tests, bench/ and small data."""
    return RowPacker(pack_length, image_extra)(list(examples))


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


def micro_step_stats(lengths: np.ndarray, has_image: np.ndarray, micro_batch: int, pack_length: int) -> PackStats:
    """One epoch in a seeded random order, cut into micro-batches of `micro_batch` examples, each packed."""
    order = np.random.default_rng(STATS_SEED).permutation(len(lengths))
    rows = most = pad_unpacked = pad_packed = max_images = 0
    for start in range(0, len(order), micro_batch):
        chunk = order[start : start + micro_batch]
        sizes = lengths[chunk].tolist()
        packed = first_fit(sizes, pack_length)
        row_sizes = [sum(sizes[i] for i in row) for row in packed]
        rows, most = rows + len(packed), max(most, len(packed))
        pad_unpacked += max(sizes) * len(sizes) - sum(sizes)
        pad_packed += max(row_sizes) * len(row_sizes) - sum(row_sizes)
        if has_image.any():
            max_images = max(max_images, *(int(has_image[chunk[row]].sum()) for row in packed))
    return PackStats(
        examples=len(lengths),
        micro_batch=micro_batch,
        micro_steps=math.ceil(len(lengths) / micro_batch),
        rows=rows,
        most_rows=most,
        pack_length=pack_length,
        positions=int(lengths.sum()),
        max_images=max_images,
        oversize=int((lengths > pack_length).sum()),
        pad_unpacked=pad_unpacked,
        pad_packed=pad_packed,
    )


def expected_rows(p: Packing, micro_batch: int) -> float:
    """Rows per micro-step on average over an epoch of this data at `micro_batch` examples (the plan's)."""
    if p.train is not None and micro_batch == p.train.micro_batch:
        return round(p.train.rows_per_micro_step, 2)
    if p.lengths is None:
        return float(micro_batch)
    return round(
        micro_step_stats(
            p.lengths, np.zeros(len(p.lengths), dtype=bool), micro_batch, p.pack_length
        ).rows_per_micro_step,
        2,
    )


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


def decide_packing(cfg: DataConfig, train, image_extra: int, micro_batch: int, on_gpu: bool) -> Packing:
    """Whether the training collator packs (auto: on a GPU when it at least halves a micro-batch's rows), and the
    micro-step statistics. Off (or auto on CPU) does no packing work at all; on reads only the length and image
    columns (numpy over the cache), never a token list. The datasets themselves are never changed: which examples
    a step trains does not depend on packing.

    image_extra: positions an image adds beyond its 3 placeholders (plan.estimate.image_extra_tokens)."""
    lengths = example_positions(train, image_extra)
    length = pack_length_for(cfg, int(lengths.max(initial=0)))
    if cfg.packing == "off":
        return Packing(False, "data.packing=off", length)
    if cfg.packing == "auto" and not on_gpu:
        return Packing(
            False,
            "auto: off on CPU (compute-bound per token: no launch overhead to save, and "
            "the dense block-diagonal mask costs attention over the whole row)",
            length,
        )
    stats = micro_step_stats(lengths, _has_image(train, image_extra), micro_batch, length)
    gain = micro_batch / max(stats.rows_per_micro_step, 1e-9)
    if cfg.packing == "on":
        enabled, reason = True, "data.packing=on"
    elif gain >= AUTO_MIN_GAIN:
        enabled, reason = True, f"auto: {gain:.1f} examples per row, {gain:.1f}x fewer rows per micro-step"
    else:
        enabled, reason = (
            False,
            (f"auto: only {gain:.1f} examples per row at micro-batch {micro_batch} (packs from {AUTO_MIN_GAIN:.0f})"),
        )
    return Packing(enabled, reason, length, stats, image_extra, lengths)


def _has_image(split, image_extra: int) -> np.ndarray:
    if not image_extra:
        return np.zeros(len(split), dtype=bool)
    if hasattr(split, "column"):
        return split.column("image")[split.rows].astype(bool)
    return np.array([bool(e.get("image")) for e in split])


def format_packing(p: Packing, micro_batch: int) -> str:
    """Rows per micro-step, fill and padding, plain text under the data table. With the plan's micro-batch
    (which the probe may lower) the statistics are redrawn for it."""
    lines = [
        f"packing: {'on' if p.enabled else 'off'} ({p.reason})"
        + (f"; each micro-batch's examples in rows of up to {p.pack_length} positions" if p.train else "")
    ]
    s = p.train
    if s is not None and p.lengths is not None and micro_batch != s.micro_batch:
        s = micro_step_stats(p.lengths, np.zeros(len(p.lengths), dtype=bool), micro_batch, p.pack_length)
    if s is not None:
        saved = s.pad_unpacked - s.pad_packed
        lines.append(
            f"  train: micro-batches of {s.micro_batch} examples -> {s.rows_per_micro_step:.1f} rows on "
            f"average, at most {s.most_rows} ({s.micro_steps} micro-batches of an epoch, as unpacked), fill "
            f"{s.fill:.1%}; padding {s.pad_unpacked} unpacked vs {s.pad_packed} packed ({saved:+d} saved)"
            + (f"; {s.oversize} example(s) longer than a row, alone in theirs" if s.oversize else "")
        )
    return "\n".join(lines)
