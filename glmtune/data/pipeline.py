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
from typing import TYPE_CHECKING, Any, NamedTuple, Optional

import torch

from ..config import DataConfig, train_files

# The message encoding is the tokenizers' chat template (models/chatglm/template.py); the rest is re-exported for the
# probe. GLM-4-0414's tokenizer renders its checkpoint's own template (encode_conversation below).
from ..models.chatglm.template import (
    IMAGE_PLACEHOLDERS,
    MessageTokenizer,
    encode_one,  # noqa: F401
    image_message_ids,
    process_message,
)
from .sources import is_rows, where
from .stats import DataStats, FileStats, SplitStats, format_stats, longest_length, split_stats  # noqa: F401
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


def encode_conversation(messages: list[dict[str, Any]], tokenizer: MessageTokenizer) -> tuple[list[int], list[int]]:
    """Untruncated (input_ids, labels) of one conversation; labels are -100 where no loss is taken. A tokenizer
    that renders its checkpoint's jinja template (GLM-4-0414: models/glm4_0414/template.py) encodes the whole
    conversation itself, by the same rule: the assistant's tokens and the token after each reply are targets."""
    if hasattr(tokenizer, "encode_conversation"):
        return tokenizer.encode_conversation(messages)
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


def encode_example(
    messages: list[dict[str, Any]], tokenizer: MessageTokenizer, max_length: int
) -> tuple[list[int], list[int], int, int]:
    """(input_ids, labels) cut to max_length from the right, the untruncated length, and the targets left.
    An example with 0 targets left is dropped by the caller: only the prompt survived, nothing to learn (and a
    NaN loss if it were alone in a batch)."""
    input_ids, labels = encode_conversation(messages, tokenizer)
    untruncated = len(input_ids)
    input_ids, labels = input_ids[:max_length], labels[:max_length]
    return input_ids, labels, untruncated, sum(label != IGNORE_INDEX for label in labels)


class Datasets(NamedTuple):
    train: TokenizedSplit  # a torch Dataset of {"input_ids", "labels"[, "image"]} dicts over the Arrow cache
    val: Optional[TokenizedSplit]  # None without data.val_file or data.val_size
    stats: DataStats


def cache_entries(data: Datasets) -> dict[str, TokenizedSplit]:
    """Each data file's cache entry by the config key naming it: what a resume must find unchanged."""
    parts = getattr(data.train, "parts", [data.train])  # a mixing.Selection spans several entries
    found = {"data.train_file" + (f"[{i}]" if i else ""): part for i, part in enumerate(parts)}
    if data.val is not None and not hasattr(data.val, "parts"):  # a held-out val set is in the train entries
        found["data.val_file"] = data.val
    return found


def build_datasets(
    cfg: DataConfig, tokenizer: MessageTokenizer, vision_config: Optional[dict] = None, seed: int = 42
) -> Datasets:
    """Train and val examples with their stats, memory-mapped from the Arrow cache (cache.py builds an entry on
    a miss, validating every line and encoding with encode_example). Raises DataError on a bad file or an empty
    split. vision_config: the model's (`arch.vision_config`); None = a text model, and an image is a DataError.
    Several train files are mixed by data.mix, and data.val_size holds a val set out of them (mixing.py), with
    `seed` (train.seed)."""
    files = train_files(cfg)
    keys = ["data.train_file"] + [f"data.train_file[{i}]" for i in range(1, len(files))]
    for path, key in (*zip(files, keys), (cfg.val_file, "data.val_file")):
        if path is not None:
            check_file(path, key)
    parts = []
    for path, key in zip(files, keys):
        split, stats = _load_split(cfg, path, key, tokenizer, vision_config)
        if not len(split):
            at = where(path, stats.dropped_lines[0], is_rows(locate(path)))
            raise DataError(
                f"{at}: every example lost all its assistant "
                f"tokens to truncation at data.max_length={cfg.max_length} (longest example "
                f"{stats.max_untruncated} tokens) — raise data.max_length or shorten the prompts"
            )
        parts.append((split, stats))
    from .mixing import records_format, selected

    if len(files) == 1 and not cfg.val_size:  # one file as ever: its entry is the train split
        train, train_stats = parts[0]
        # Its row in the data table says which format was read (its dropped lines are listed under "train").
        files_stats = (
            FileStats(
                file=files[0],
                records=records_format(train),
                kept=len(train),
                dropped_lines=(),
                weight=None,
                train=len(train),
                val=0,
            ),
        )
        val, val_stats = None, None
    else:
        train, val, train_stats, val_stats, files_stats = selected(cfg, files, parts, _per_image(vision_config), seed)
    if cfg.val_file is not None:
        val, val_stats = _load_split(cfg, cfg.val_file, "data.val_file", tokenizer, vision_config)
        if not len(val):
            at = where(cfg.val_file, val_stats.dropped_lines[0], is_rows(locate(cfg.val_file)))
            raise DataError(
                f"{at}: every validation example lost all its "
                f"assistant tokens to truncation at data.max_length={cfg.max_length} — raise "
                "data.max_length or set data.val_file=null"
            )
    return Datasets(
        train,
        val,
        DataStats(
            max_length=cfg.max_length, train=train_stats, val=val_stats, files=files_stats, val_size=cfg.val_size
        ),
    )


def _per_image(vision_config: Optional[dict]) -> int:
    if not vision_config:
        return 0
    from ..models.chatglm.vision import num_image_tokens  # the vision tower's module, only for a vision model

    return num_image_tokens(vision_config) + 2  # boi + N patches + eoi


def _load_split(
    cfg: DataConfig, path: str, key: str, tokenizer: MessageTokenizer, vision_config: Optional[dict]
) -> tuple[TokenizedSplit, SplitStats]:
    from .cache import load_split  # pyarrow and the cache machinery: the collator alone does not need them

    split = load_split(cfg, path, key, tokenizer, bool(vision_config), encode_example)
    columns = (split.column(c) for c in ("line", "length", "untruncated", "targets", "image"))
    return split, split_stats(*columns, _per_image(vision_config))


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

    def __init__(self, pad_id: int, pad_to_multiple_of: Optional[int] = None, image_size: Optional[int] = None) -> None:
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
        batch = {
            "input_ids": torch.tensor(input_ids, dtype=torch.long),
            "labels": torch.tensor(labels, dtype=torch.long),
            "attention_mask": torch.tensor(attention_mask, dtype=torch.long),
        }
        if any("lengths" in f for f in features):  # packed rows (data/packing.py): one entry per example
            lengths = [f.get("lengths") or [len(f["input_ids"])] for f in features]
            # Positions restart at 0 for every example; seq_ids tell examples apart (-1 = padding).
            batch["position_ids"] = torch.tensor(
                [[p for n in ns for p in range(n)] + [0] * (length - sum(ns)) for ns in lengths], dtype=torch.long
            )
            batch["seq_ids"] = torch.tensor(
                [[k for k, n in enumerate(ns) for _ in range(n)] + [-1] * (length - sum(ns)) for ns in lengths],
                dtype=torch.long,
            )
        # One image per unpacked example ("image"), any number per packed row ("images", in order).
        paths = [
            (i, path)
            for i, f in enumerate(features)
            for path in ([f["image"]] if f.get("image") else f.get("images") or [])
        ]
        if paths:
            if self.image_size is None:
                raise DataError(
                    "the data has images but the collator has no image_size — pass "
                    "DataCollator(..., image_size=arch.vision_config['image_size'])"
                )
            batch["images"] = torch.stack([self._load(path) for _, path in paths])
            batch["image_rows"] = torch.tensor([i for i, _ in paths], dtype=torch.long)
        return batch

    def _load(self, path: str) -> torch.Tensor:
        from ..models.chatglm.vision import load_image  # only for data with images (see _load_split)

        try:
            return load_image(path, self.image_size)
        except (OSError, ValueError) as err:  # changed or damaged since validation
            raise DataError(f"{path}: image cannot be read ({type(err).__name__}: {err}) — check the file") from None
