"""What the GLM-4 and ChatGLM3 tokenizers share: special-token bookkeeping and the chat-template loop.

The official checkpoints ship `tokenization_chatglm.py`, which `AutoTokenizer` can only use by executing it
(`trust_remote_code=True`). glmtune reads `tokenizer.model` itself instead: GLM-4's is a tiktoken rank table
(`tokenization_glm4.py`), ChatGLM3's a SentencePiece model (`tokenization_chatglm3.py`). This module holds what
both share. Picking a family for a folder, and the tiny tokenizers, are in `tokenizer_files.py`, which imports
both families (the families import this module, so it cannot import them back).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterable

ROLES = ("system", "user", "assistant", "observation")
Message = dict[str, Any]


class ChatTokenizer:
    """What GLM4Tokenizer and ChatGLM3Tokenizer share; subclasses supply the text codec and message layout."""

    family: str
    specials: dict[str, int]  # special-token string -> id, in the official order
    aliases: dict[str, str] = {}  # the other family's spelling ("sop" vs "<sop>"), so callers need not care
    eos_token_id: int
    pad_token_id: int
    stop_token_ids: list[int]

    def __init__(self, chat_template: str | None = None) -> None:
        # The source checkpoint's jinja template: save_pretrained writes it back, GLM-4 reads a name from it.
        self.chat_template = chat_template
        self.special_by_id = {i: s for s, i in self.specials.items()}

    # --- subclass hooks ---------------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        raise NotImplementedError

    def encode(self, text: str) -> list[int]:
        raise NotImplementedError

    def _decode_ordinary(self, ids: list[int]) -> str:
        raise NotImplementedError

    def _ordinary_token_id(self, token: str) -> int | None:
        raise NotImplementedError

    def encode_message(self, message: Message) -> list[int]:
        raise NotImplementedError

    def render_message(self, message: Message) -> str:
        raise NotImplementedError

    def _write_model_file(self, path: Path) -> None:
        raise NotImplementedError

    def _config(self) -> dict[str, Any]:
        raise NotImplementedError

    def tokenizer_json(self) -> dict[str, Any]:
        """The same tokenizer as tokenizer.json data (tokenizer_json.py): engines load it without code."""
        raise NotImplementedError

    # --- shared behaviour -------------------------------------------------------------------------------
    def __len__(self) -> int:
        return self.vocab_size

    def get_command(self, token: str) -> int:
        name = self.aliases.get(token, token)
        if name not in self.specials:
            raise ValueError(f"{token!r} is not a {self.family} special token; known: {', '.join(self.specials)}")
        return self.specials[name]

    def convert_tokens_to_ids(self, tokens: str | list[str]) -> int | list[int]:
        if isinstance(tokens, list):
            return [self.convert_tokens_to_ids(t) for t in tokens]  # type: ignore[misc]
        if self.aliases.get(tokens, tokens) in self.specials:
            return self.get_command(tokens)
        token_id = self._ordinary_token_id(tokens)
        if token_id is None:
            raise ValueError(f"{tokens!r} is neither a special token nor a single {self.family} vocabulary token")
        return token_id

    def prefix_ids(self) -> list[int]:
        return [self.get_command("[gMASK]"), self.get_command("<sop>")]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        # Ordinary ids are decoded in runs, never one by one, so multi-token characters survive.
        parts: list[str] = []
        run: list[int] = []
        for i in (int(x) for x in ids):
            if i not in self.special_by_id:
                if not 0 <= i < self.vocab_size:
                    raise ValueError(f"token id {i} is outside the {self.family} vocabulary (0..{self.vocab_size - 1})")
                run.append(i)
                continue
            if run:
                parts.append(self._decode_ordinary(run))
                run = []
            if not skip_special_tokens:
                parts.append(self.special_by_id[i])
        if run:
            parts.append(self._decode_ordinary(run))
        return "".join(parts)

    def apply_chat_template(
        self, messages: list[Message], add_generation_prompt: bool = False, tokenize: bool = True
    ) -> list[int] | str:
        """The whole conversation as the official template renders it: [gMASK]<sop>, each message, and
        `<|assistant|>` (no newline: the model writes the empty metadata line itself) when asked."""
        if tokenize:
            ids = self.prefix_ids()
            for message in messages:
                ids += self.encode_message(message)
            if add_generation_prompt:
                ids.append(self.get_command("<|assistant|>"))
            return ids
        text = "".join(self.special_by_id[i] for i in self.prefix_ids())
        text += "".join(self.render_message(m) for m in messages)
        return text + ("<|assistant|>" if add_generation_prompt else "")

    def save_pretrained(self, out_dir: str | os.PathLike) -> None:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        self._write_model_file(out / "tokenizer.model")
        (out / "tokenizer.json").write_text(
            json.dumps(self.tokenizer_json(), ensure_ascii=False) + "\n", encoding="utf-8"
        )
        # PreTrainedTokenizerFast: what tokenizer.json is to every HF loader; glmtune itself reads tokenizer.model
        config = {
            "family": self.family,
            "tokenizer_class": "PreTrainedTokenizerFast",
            **self._config(),
            "padding_side": "left",
            "clean_up_tokenization_spaces": False,  # decode as is, no space edits
            "added_tokens_decoder": {str(i): {"content": s, "special": True} for s, i in self.specials.items()},
        }
        if self.chat_template is not None:
            config["chat_template"] = self.chat_template
        (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")


def checked_message(message: Message) -> tuple[str, str, str]:
    """(role, metadata, content); None counts as empty because `datasets` fills missing keys with None."""
    role = message.get("role")
    if role not in ROLES:
        raise ValueError(f"message role must be one of {', '.join(ROLES)}, got {role!r}")
    content = message.get("content") or ""
    metadata = message.get("metadata") or ""
    if not isinstance(content, str) or not isinstance(metadata, str):
        raise ValueError(f"{role} message: content and metadata must be strings")
    return role, metadata, content
