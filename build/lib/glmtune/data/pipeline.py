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

import copy
import math
from dataclasses import dataclass
from typing import Any, NamedTuple, Optional, Protocol

import torch

from ..config import DataConfig
from ..models.vision import load_image, num_image_tokens
# Re-exported so callers need one import: `from glmtune.data import DataError, validate_files, ...`.
from .validate import Conversation, DataError, read_conversations, validate_files  # noqa: F401

IGNORE_INDEX = -100  # label value the loss skips (torch cross_entropy's default ignore_index)


class MessageTokenizer(Protocol):
    """What encoding needs from glmtune.models.tokenization's tokenizers."""

    family: str
    eos_token_id: int
    pad_token_id: int

    def prefix_ids(self) -> list[int]: ...
    def get_command(self, token: str) -> int: ...
    def encode_message(self, message: dict[str, Any]) -> list[int]: ...
    def encode(self, text: str) -> list[int]: ...


# --- encoding -------------------------------------------------------------------------------------------

def process_message(message: dict[str, Any]) -> dict[str, Any]:
    """The official `process_message`: `tools` only on system messages, and tool-parameter properties whose
    value is None removed (`datasets` fills keys missing from a row with None). Returns a copy."""
    message = copy.deepcopy(message)
    if message.get("role") != "system":
        message.pop("tools", None)
        return message
    for tool in message.get("tools") or []:
        parameters = (tool.get("function") or {}).get("parameters")
        if isinstance(parameters, dict) and isinstance(parameters.get("properties"), dict):
            parameters["properties"] = {k: v for k, v in parameters["properties"].items() if v is not None}
    return message


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


def encode_one(message: dict[str, Any], tokenizer: MessageTokenizer) -> list[int]:
    """One message as training and inference both render it (official template, 4V image prefix)."""
    if "image" in message:
        return image_message_ids(message, tokenizer)
    return tokenizer.encode_message(process_message(message))


# The 3 ids the model swaps for the vision tower's boi + patches + eoi.
IMAGE_PLACEHOLDERS = ("<|begin_of_image|>", "<|endoftext|>", "<|end_of_image|>")


def image_message_ids(message: dict[str, Any], tokenizer: MessageTokenizer) -> list[int]:
    """The 4V tokenizer's build_single_message with the image prefix between role line and content."""
    placeholders = [tokenizer.get_command(t) for t in IMAGE_PLACEHOLDERS]
    return ([tokenizer.get_command("<|user|>")] + tokenizer.encode(f"{message.get('metadata') or ''}\n")
            + placeholders + tokenizer.encode(message.get("content") or ""))


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


def encode_split(conversations: list[Conversation], tokenizer: MessageTokenizer, max_length: int,
                 vision_config: Optional[dict] = None, source: str = "data.train_file"
                 ) -> tuple[list[dict[str, Any]], SplitStats]:
    """Encode, truncate to max_length (from the right) and drop examples left without targets.

    vision_config: the model's (GLM-4V); None = a text model, and an image in the data is a DataError."""
    examples: list[dict[str, list[int]]] = []
    lengths: list[int] = []
    untruncated: list[int] = []
    truncated = target_tokens = 0
    dropped_lines: list[int] = []
    images = 0
    per_image = num_image_tokens(vision_config) + 2 if vision_config else 0
    for conversation in conversations:
        image = next((m["image"] for m in conversation.messages if "image" in m), None)
        if image is not None and not vision_config:
            raise DataError(f"{source}:{conversation.line}: has an \"image\" but this model has no vision tower "
                            "— use model=glm4v_9b (or glm4v_tiny), or drop the image")
        input_ids, labels = encode_conversation(conversation.messages, tokenizer)
        untruncated.append(len(input_ids))
        was_cut = len(input_ids) > max_length
        input_ids, labels = input_ids[:max_length], labels[:max_length]
        targets = sum(label != IGNORE_INDEX for label in labels)
        if targets == 0:  # only the prompt survived: nothing to learn, and a NaN loss if alone in a batch
            dropped_lines.append(conversation.line)
            continue
        truncated += was_cut
        target_tokens += targets
        lengths.append(len(input_ids))
        examples.append({"input_ids": input_ids, "labels": labels, **({"image": image} if image else {})})
        images += image is not None
    stats = SplitStats(examples=len(conversations), kept=len(examples), dropped=len(dropped_lines),
                       truncated=truncated, p50=_percentile(lengths, 50), p95=_percentile(lengths, 95),
                       max=max(lengths, default=0), max_untruncated=max(untruncated, default=0),
                       tokens=sum(lengths), target_tokens=target_tokens, dropped_lines=tuple(dropped_lines),
                       images=images, image_tokens=images * per_image)
    return examples, stats


class Datasets(NamedTuple):
    train: list[dict[str, Any]]
    val: Optional[list[dict[str, Any]]]  # None without data.val_file
    stats: DataStats


def build_datasets(cfg: DataConfig, tokenizer: MessageTokenizer, vision_config: Optional[dict] = None) -> Datasets:
    """Encoded train and val examples with their stats. Raises DataError on a bad file or an empty split.
    vision_config: the model's (`arch.vision_config`), needed for data with images."""
    train, train_stats = encode_split(read_conversations(cfg.train_file, "data.train_file"), tokenizer,
                                      cfg.max_length, vision_config, cfg.train_file)
    if not train:
        raise DataError(f"{cfg.train_file}:{train_stats.dropped_lines[0]}: every example lost all its assistant "
                        f"tokens to truncation at data.max_length={cfg.max_length} (longest example "
                        f"{train_stats.max_untruncated} tokens) — raise data.max_length or shorten the prompts")
    val, val_stats = None, None
    if cfg.val_file is not None:
        val, val_stats = encode_split(read_conversations(cfg.val_file, "data.val_file"), tokenizer, cfg.max_length,
                                      vision_config, cfg.val_file)
        if not val:
            raise DataError(f"{cfg.val_file}:{val_stats.dropped_lines[0]}: every validation example lost all its "
                            f"assistant tokens to truncation at data.max_length={cfg.max_length} — raise "
                            "data.max_length or set data.val_file=null")
    return Datasets(train, val, DataStats(max_length=cfg.max_length, train=train_stats, val=val_stats))


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


def _percentile(values: list[int], percent: int) -> int:
    """Nearest-rank percentile (an actual example length, never interpolated); 0 for no values."""
    if not values:
        return 0
    ordered = sorted(values)
    rank = max(1, math.ceil(percent / 100 * len(ordered)))
    return ordered[rank - 1]


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
        rows = [i for i, f in enumerate(features) if f.get("image")]
        if rows:
            if self.image_size is None:
                raise DataError("the data has images but the collator has no image_size — pass "
                                "DataCollator(..., image_size=arch.vision_config['image_size'])")
            batch["images"] = torch.stack([self._load(features[i]["image"]) for i in rows])
            batch["image_rows"] = torch.tensor(rows, dtype=torch.long)
        return batch

    def _load(self, path: str) -> torch.Tensor:
        try:
            return load_image(path, self.image_size)
        except (OSError, ValueError) as err:  # changed or damaged since validation
            raise DataError(f"{path}: image cannot be read ({type(err).__name__}: {err}) — check the file") from None
