"""ChatGLM3-6B tokenizer: a SentencePiece model plus nine special tokens numbered after its pieces.

Message layout follows the official tokenization_chatglm.py (`build_single_message` / `build_chat_input`):
`[<|role|>] + encode(f"{metadata}\\n") + encode(content)`, the two texts encoded separately, so each gets
SentencePiece's dummy-prefix space. Unlike GLM-4's jinja template, a message with empty content still renders.
"""

from __future__ import annotations

import io
import json
import os
from functools import lru_cache
from pathlib import Path
from typing import Any

import sentencepiece as spm

from .tokenization import ChatTokenizer, Message, checked_message

SPECIAL_TOKENS = (
    "[MASK]",
    "[gMASK]",
    "[sMASK]",
    "sop",
    "eop",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|observation|>",
)


class ChatGLM3Tokenizer(ChatTokenizer):
    family = "chatglm3"
    aliases = {"<sop>": "sop", "<eop>": "eop"}

    def __init__(self, model_proto: bytes, chat_template: str | None = None, source: str = "tokenizer.model") -> None:
        self.sp = spm.SentencePieceProcessor()
        try:
            self.sp.LoadFromSerializedProto(model_proto)
        except (RuntimeError, OSError) as e:
            raise ValueError(f"{source}: neither a GLM-4 rank table nor a SentencePiece model ({e})") from None
        self.model_proto = model_proto
        n = self.sp.get_piece_size()
        self.specials = {s: n + k for k, s in enumerate(SPECIAL_TOKENS)}
        self.eos_token_id = self.sp.eos_id()
        self.pad_token_id = self.sp.unk_id()  # the official tokenizer pads with <unk>
        self.stop_token_ids = [self.eos_token_id, self.specials["<|user|>"], self.specials["<|observation|>"]]
        super().__init__(chat_template)

    @classmethod
    def from_bytes(
        cls, data: bytes, chat_template: str | None = None, source: str = "tokenizer.model"
    ) -> ChatGLM3Tokenizer:
        return cls(data, chat_template=chat_template, source=source)

    @property
    def vocab_size(self) -> int:
        return self.sp.get_piece_size() + len(self.specials)

    def encode(self, text: str) -> list[int]:
        # The special tokens are not SentencePiece pieces, so "<|user|>" in data is always split as text.
        return self.sp.encode(text)

    def _decode_ordinary(self, ids: list[int]) -> str:
        return self.sp.decode(ids)

    def _ordinary_token_id(self, token: str) -> int | None:
        piece_id = self.sp.piece_to_id(token)
        return None if piece_id == self.sp.unk_id() and token != self.sp.id_to_piece(piece_id) else piece_id

    def _content(self, message: Message) -> tuple[str, str, str]:
        role, metadata, content = checked_message(message)
        if role == "system" and message.get("tools") is not None:  # build_chat_input appends the tools as JSON
            content = content + "\n" + json.dumps(message["tools"], indent=4, ensure_ascii=False)
        return role, metadata, content

    def encode_message(self, message: Message) -> list[int]:
        role, metadata, content = self._content(message)
        return [self.specials[f"<|{role}|>"]] + self.encode(f"{metadata}\n") + self.encode(content)

    def render_message(self, message: Message) -> str:
        # What decode() gives for encode_message's ids; with empty metadata it is what chatglm3-6b's own jinja
        # template writes ("<|user|>\n Hi"): the space is the dummy prefix of the separately encoded content.
        role, metadata, content = self._content(message)
        return f"<|{role}|>{metadata}\n" + (f" {content}" if content else "")

    def _write_model_file(self, path: Path) -> None:
        path.write_bytes(self.model_proto)

    def _config(self) -> dict[str, Any]:
        return {
            "eos_token": self.sp.id_to_piece(self.eos_token_id),
            "pad_token": self.sp.id_to_piece(self.pad_token_id),
        }

    def tokenizer_json(self) -> dict[str, Any]:
        from .tokenizer_json import chatglm3_tokenizer_json

        return chatglm3_tokenizer_json(self.sp, self.model_proto, self.specials)


@lru_cache(maxsize=2)
def tiny_chatglm3_tokenizer(corpus: str, vocab_size: int = 1015) -> ChatGLM3Tokenizer:
    """SentencePiece BPE trained on `corpus`: 1,015 pieces + 9 specials = 1,024 ids.

    Settings chosen so encode/decode round-trips any text (byte fallback, no normalization, whitespace kept);
    one thread and no sampling keep it deterministic.
    """
    model = io.BytesIO()
    with open(os.devnull, "w") as quiet:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter([line for line in corpus.splitlines() if line.strip()]),
            model_writer=model,
            logstream=quiet,
            model_type="bpe",
            vocab_size=vocab_size,
            character_coverage=1.0,
            byte_fallback=True,
            normalization_rule_name="identity",
            remove_extra_whitespaces=False,
            add_dummy_prefix=True,
            split_digits=True,
            allow_whitespace_only_pieces=True,
            num_threads=1,
            input_sentence_size=0,
            shuffle_input_sentence=False,
            unk_id=0,
            bos_id=1,
            eos_id=2,
            pad_id=-1,
            hard_vocab_limit=True,
        )
    return ChatGLM3Tokenizer(model.getvalue(), source="tiny ChatGLM3 tokenizer")
