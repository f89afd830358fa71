"""The chat template of glmtune's tokenizers: one message as training and inference both render it.

    ids = [gMASK] <sop> + encode_one(m) for each message (+ <|assistant|> for a prompt to answer)

`encode_one` is the official GLM-4 / ChatGLM3 message encoding (`process_message`, then the tokenizer's
`encode_message`), with GLM-4V's image prefix for a user message with an `"image"`. The data stage builds its
training examples from it (data/pipeline.py: loss mask, terminator, truncation) and generation its prompts
(generation.py), so a trained adapter sees at inference exactly the tokens it was trained on.
"""

from __future__ import annotations

import copy
from typing import Any, Protocol


class MessageTokenizer(Protocol):
    """What encoding needs from tokenization.py's tokenizers."""

    family: str
    eos_token_id: int
    pad_token_id: int

    def prefix_ids(self) -> list[int]: ...
    def get_command(self, token: str) -> int: ...
    def encode_message(self, message: dict[str, Any]) -> list[int]: ...
    def encode(self, text: str) -> list[int]: ...


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
    return (
        [tokenizer.get_command("<|user|>")]
        + tokenizer.encode(f"{message.get('metadata') or ''}\n")
        + placeholders
        + tokenizer.encode(message.get("content") or "")
    )


def reference_text(message: dict) -> str:
    """An assistant message as the model writes it: the content, or `name\n{arguments}` for a tool call."""
    metadata, content = message.get("metadata") or "", message.get("content") or ""
    return f"{metadata}\n{content}" if metadata else content
