"""Conversations -> (input_ids, labels) with the official GLM-4 loss mask, length stats, and the collator.

    python -m glmtune data.train_file=my.jsonl data.val_file=my_dev.jsonl data.max_length=1024

Masking follows the official text fine-tune script (GLM-4 finetune_demo @081f0fb, `combine: False`), so
every assistant turn is trained on:
    ids  = [gMASK] <sop> + encode_message(m) for each message + terminator
    mask = False  False  + [role == "assistant"] * len(...)      (terminator: no entry)
    mask = [False, *mask]                   # shift right by one
    labels = id where mask else -100        # not pre-shifted: the model shifts logits/labels itself
The shift makes `<|assistant|>` itself a non-target, while the token after each reply (the next
`<|user|>`/`<|observation|>`, or the terminator) is a target, so the model learns to stop. The terminator
is `<|user|>` for GLM-4 (the official choice since 2024-07, a generation stop token) and eos for ChatGLM3.
Examples longer than `max_length` are cut from the right; one left without any target is dropped.

GLM-4V: a user message with `"image"` is encoded as the official 4V tokenizer does,
    <|user|> encode(metadata + "\n") <|begin_of_image|> <|endoftext|> <|end_of_image|> encode(content)
and the example keeps the image's path; the model swaps the 3 placeholders for boi + N patches + eoi
(N = 1,600 at 1120 px). max_length counts text tokens (the placeholders included); the N - 1 extra
positions per image are reported separately (SplitStats.images, image_tokens).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple, Optional

import numpy as np
import torch

from ..config import DataConfig
# The message encoding is the tokenizers' chat template (models/template.py); the rest is re-exported for the probe.
from ..models.template import (IMAGE_PLACEHOLDERS, MessageTokenizer, encode_one, image_message_ids,  # noqa: F401
                               process_message)
from .sources import is_rows, where
from .validate import DataError, check_file, locate

if TYPE_CHECKING:
    from .tokenized import TokenizedSplit

IGNORE_INDEX = -100  # label value the loss skips (torch cross_entropy's default ignore_index)


# --- encoding -------------------------------------------------------------------------------------------

def terminator_id(tokenizer: MessageTokenizer) -> int:
    """Token appended after the last message: what the model should emit after its final reply."""
    if tokenizer.family == "chatglm3":
        return tokenizer.eos_token_id
    return tokenizer.get_command("<|user|>")  # GLM-4 (and 4V): stops on <|user|>, like the official demo


def encode_conversation(messages: list[dict[str, Any]], tokenizer: MessageTokenizer
                        ) -> tuple[list[int], list[int]]:
    """Untruncated (input_ids, labels) of one conversation; labels are -100 where no loss is taken."""
    input_ids = list(tokenizer.prefix_ids())  # a copy: it is extended below
    loss_mask = [False] * len(input_ids)
    for message in messages:
        message_ids = encode_one(message, tokenizer)
        input_ids += message_ids
        loss_mask += [message["role"] == "assistant"] * len(message_ids)
    input_ids.append(terminator_id(tokenizer))
    # Shift right by one: the label at position i says whether token i is predicted from tokens < i
    # (after the model's own shift), so the turn's role token is context and the token after the reply a target.
    loss_mask = [False, *loss_mask]
    labels = [token if supervised else IGNORE_INDEX for token, supervised in zip(input_ids, loss_mask)]
    return input_ids, labels


# --- datasets and stats ---------------------------------------------------------------------------------

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


@dataclass
class DataStats:
    max_length: int
    train: SplitStats
    val: Optional[SplitStats] = None


def encode_example(messages: list[dict[str, Any]], tokenizer: MessageTokenizer, max_length: int
                   ) -> tuple[list[int], list[int], int, int]:
    """(input_ids, labels) cut to max_length from the right, the untruncated length, and the targets left.
    An example with 0 targets left is dropped by the caller: only the prompt survived, nothing to learn (and a
    NaN loss if it were alone in a batch)."""
    input_ids, labels = encode_conversation(messages, tokenizer)
    untruncated = len(input_ids)
    input_ids, labels = input_ids[:max_length], labels[:max_length]
    return input_ids, labels, untruncated, sum(label != IGNORE_INDEX for label in labels)


def split_stats(lines: np.ndarray, lengths: np.ndarray, untruncated: np.ndarray, targets: np.ndarray,
                has_image: np.ndarray, per_image: int) -> SplitStats:
    """Stats of one split from its per-example columns (the Arrow cache's; one entry per conversation).
    per_image: embeddings the vision tower adds per image (N + 2), 0 for a text model."""
    kept = targets > 0
    kept_lengths = lengths[kept]
    images = int(has_image[kept].sum())
    return SplitStats(examples=len(lines), kept=int(kept.sum()), dropped=int((~kept).sum()),
                      truncated=int((untruncated[kept] > lengths[kept]).sum()),
                      p50=_percentile(kept_lengths, 50), p95=_percentile(kept_lengths, 95),
                      max=int(kept_lengths.max(initial=0)), max_untruncated=int(untruncated.max(initial=0)),
                      tokens=int(kept_lengths.sum()), target_tokens=int(targets[kept].sum()),
                      dropped_lines=tuple(int(n) for n in lines[~kept]), images=images, image_tokens=images * per_image)


class Datasets(NamedTuple):
    train: TokenizedSplit  # a torch Dataset of {"input_ids", "labels"[, "image"]} dicts over the Arrow cache
    val: Optional[TokenizedSplit]  # None without data.val_file
    stats: DataStats


def build_datasets(cfg: DataConfig, tokenizer: MessageTokenizer, vision_config: Optional[dict] = None) -> Datasets:
    """Train and val examples with their stats, memory-mapped from the Arrow cache (cache.py builds an entry on
    a miss, validating every line and encoding with encode_example). Raises DataError on a bad file or an empty
    split. vision_config: the model's (`arch.vision_config`); None = a text model, and an image is a DataError."""
    for path, key in ((cfg.train_file, "data.train_file"), (cfg.val_file, "data.val_file")):
        if path is not None:
            check_file(path, key)
    train, train_stats = _load_split(cfg, cfg.train_file, "data.train_file", tokenizer, vision_config)
    if not len(train):
        at = where(cfg.train_file, train_stats.dropped_lines[0], is_rows(locate(cfg.train_file)))
        raise DataError(f"{at}: every example lost all its assistant "
                        f"tokens to truncation at data.max_length={cfg.max_length} (longest example "
                        f"{train_stats.max_untruncated} tokens) — raise data.max_length or shorten the prompts")
    val, val_stats = None, None
    if cfg.val_file is not None:
        val, val_stats = _load_split(cfg, cfg.val_file, "data.val_file", tokenizer, vision_config)
        if not len(val):
            at = where(cfg.val_file, val_stats.dropped_lines[0], is_rows(locate(cfg.val_file)))
            raise DataError(f"{at}: every validation example lost all its "
                            f"assistant tokens to truncation at data.max_length={cfg.max_length} — raise "
                            "data.max_length or set data.val_file=null")
    return Datasets(train, val, DataStats(max_length=cfg.max_length, train=train_stats, val=val_stats))


def _load_split(cfg: DataConfig, path: str, key: str, tokenizer: MessageTokenizer, vision_config: Optional[dict]
                ) -> tuple[TokenizedSplit, SplitStats]:
    from .cache import load_split  # pyarrow and the cache machinery: the collator alone does not need them

    split = load_split(cfg, path, key, tokenizer, bool(vision_config), encode_example)
    # The vision tower's module, only for data with images: the length statistics and the plan need no model code.
    from ..models.vision import num_image_tokens

    per_image = num_image_tokens(vision_config) + 2 if vision_config else 0  # boi + N patches + eoi
    columns = (split.column(c) for c in ("line", "length", "untruncated", "targets", "image"))
    return split, split_stats(*columns, per_image)


def longest_length(stats: DataStats) -> int:
    """Longest kept example of any split, in tokens: the sequence length of a worst-case probe batch."""
    return max(stats.train.max, stats.val.max if stats.val is not None else 0)


def format_stats(stats: DataStats) -> str:
    """A small fixed-width table (plain text: no markup, fits logs and the console)."""
    rows = [("split", "examples", "kept", "dropped", "truncated", "p50", "p95", "max", "max untrunc.", "tokens")]
    for name, split in (("train", stats.train), ("val", stats.val)):
        if split is not None:
            rows.append((name, *(str(v) for v in (split.examples, split.kept, split.dropped, split.truncated,
                                                  split.p50, split.p95, split.max, split.max_untruncated,
                                                  split.tokens))))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [f"data (tokens, max_length={stats.max_length})"]
    lines += ["  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths)))
              for row in rows]
    for name, split in (("train", stats.train), ("val", stats.val)):
        if split is not None and split.images:
            each = split.image_tokens // split.images
            lines.append(f"{name}: {split.images} example(s) with an image: {each} image embeddings each replace "
                         f"3 placeholder tokens (+{split.images * (each - 3)} positions beyond the counts above)")
        if split is not None and split.dropped:
            shown = ", ".join(str(n) for n in split.dropped_lines[:10])
            lines.append(f"{name}: dropped (no target token left after truncation) lines {shown}"
                         + (", …" if split.dropped > 10 else ""))
    return "\n".join(lines)


def _percentile(values: np.ndarray, percent: int) -> int:
    """Nearest-rank percentile (an actual example length, never interpolated); 0 for no values."""
    if not len(values):
        return 0
    ordered = np.sort(values)
    rank = max(1, math.ceil(percent / 100 * len(ordered)))
    return int(ordered[rank - 1])


# --- batching -------------------------------------------------------------------------------------------

class DataCollator:
    """Right-pads a list of examples into LongTensors for the HF Trainer.

    input_ids are padded with `pad_id`, labels with -100 (no loss on padding), and attention_mask is
    1 on real tokens, 0 on padding. `pad_to_multiple_of` rounds the padded length up (e.g. 8 for tensor
    cores); it never pads beyond what a multiple requires.
    GLM-4V: examples with an "image" are loaded here (not at encoding: 15 MB of fp32 pixels per image at
    1120 px) into `images` [n_img, 3, S, S], and `image_rows` lists which rows they belong to; text-only
    rows need no placeholder image, the model runs the tower on the listed rows only. Batches without
    any image carry neither key. `image_size` is the model's vision_config["image_size"].
    Packed rows (data/packing.py: `lengths`, `images`) also get `position_ids` and `seq_ids`, and a row
    with k images is listed k times in `image_rows`.
    """

    def __init__(self, pad_id: int, pad_to_multiple_of: Optional[int] = None, image_size: Optional[int] = None
                 ) -> None:
        if pad_to_multiple_of is not None and pad_to_multiple_of <= 0:
            raise ValueError(f"pad_to_multiple_of must be a positive integer, got {pad_to_multiple_of}")
        self.pad_id = pad_id
        self.pad_to_multiple_of = pad_to_multiple_of
        self.image_size = image_size

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        length = max(len(f["input_ids"]) for f in features)
        if self.pad_to_multiple_of:
            length = math.ceil(length / self.pad_to_multiple_of) * self.pad_to_multiple_of
        input_ids, labels, attention_mask = [], [], []
        for feature in features:
            ids = list(feature["input_ids"])
            if len(feature["labels"]) != len(ids):
                raise ValueError(f"example has {len(ids)} input_ids but {len(feature['labels'])} labels")
            pad = length - len(ids)
            input_ids.append(ids + [self.pad_id] * pad)
            labels.append(list(feature["labels"]) + [IGNORE_INDEX] * pad)
            attention_mask.append([1] * len(ids) + [0] * pad)
        batch = {"input_ids": torch.tensor(input_ids, dtype=torch.long),
                 "labels": torch.tensor(labels, dtype=torch.long),
                 "attention_mask": torch.tensor(attention_mask, dtype=torch.long)}
        if any("lengths" in f for f in features):  # packed rows (data/packing.py): one entry per example
            lengths = [f.get("lengths") or [len(f["input_ids"])] for f in features]
            # Positions restart at 0 for every example; seq_ids tell examples apart (-1 = padding).
            batch["position_ids"] = torch.tensor([[p for n in ns for p in range(n)] + [0] * (length - sum(ns))
                                                  for ns in lengths], dtype=torch.long)
            batch["seq_ids"] = torch.tensor([[k for k, n in enumerate(ns) for _ in range(n)] + [-1] * (length - sum(ns))
                                             for ns in lengths], dtype=torch.long)
        # One image per unpacked example ("image"), any number per packed row ("images", in order).
        paths = [(i, path) for i, f in enumerate(features)
                 for path in ([f["image"]] if f.get("image") else f.get("images") or [])]
        if paths:
            if self.image_size is None:
                raise DataError("the data has images but the collator has no image_size — pass "
                                "DataCollator(..., image_size=arch.vision_config['image_size'])")
            batch["images"] = torch.stack([self._load(path) for _, path in paths])
            batch["image_rows"] = torch.tensor([i for i, _ in paths], dtype=torch.long)
        return batch

    def _load(self, path: str) -> torch.Tensor:
        from ..models.vision import load_image  # only for data with images (see _load_split)

        try:
            return load_image(path, self.image_size)
        except (OSError, ValueError) as err:  # changed or damaged since validation
            raise DataError(f"{path}: image cannot be read ({type(err).__name__}: {err}) — check the file") from None
