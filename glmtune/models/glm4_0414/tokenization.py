"""GLM-4-0414's tokenizer: the fast tokenizer of the checkpoint's `tokenizer.json` (byte-level BPE, the GLM special
tokens as added tokens; no tokenizer.model, no code), with the chat template of its tokenizer_config.json (or
chat_template.jinja, where transformers 5 saves it). `[gMASK]<sop>` is in the template, not added by the tokenizer.

transformers 4.40.2 runs tokenizers 0.19, which reads BPE merges only as "a b" strings; tokenizers >= 0.20 writes
them as pairs ["a", "b"] (every tokenizer.json saved since, the 0414 checkpoints' own re-saves included), which 0.19
refuses ("data did not match any variant of untagged enum ModelWrapper"). `tokenizer_json` rewrites pairs as
strings before 0.19 reads them; the file itself is never changed, and exports copy it as it is.

The tokenizer encodes what data/pipeline.py and generation.py ask of a tokenizer: a conversation with its labels
(`encode_conversation`, by template.py's rules) and a prompt (`encode_prompt`), both from the rendered template.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

from .template import THINKING, ChatTemplate, template_inputs

FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")
STOPS = ("<|endoftext|>", "<|user|>", "<|observation|>")  # generation_config.json's eos of the 0414 checkpoints
TERMINATOR = "<|user|>"  # after the last reply, as for GLM-4-9B-chat: the token that ends an assistant turn
IGNORE = -100


def tokenizer_json(path: Path) -> str:
    """tokenizer.json's text with pair merges joined (see above); a ValueError names the file when it is not one."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        merges = data["model"].get("merges")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        raise ValueError(
            f"{path}: not a readable tokenizer.json ({str(err).splitlines()[0][:120]}) — copy it again "
            "from the checkpoint"
        ) from None
    if merges and isinstance(merges[0], list):
        if any(" " in part for pair in merges for part in pair):
            raise ValueError(f"{path}: a merge holds a space, which tokenizers 0.19 (transformers 4.40.2) cannot read")
        data["model"]["merges"] = [" ".join(pair) for pair in merges]
    return json.dumps(data, ensure_ascii=False)


def read_chat_template(folder: Path, config: dict) -> str | None:
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: the default one
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    if not isinstance(template, str) and (folder / "chat_template.jinja").is_file():
        template = (folder / "chat_template.jinja").read_text(encoding="utf-8")
    return template if isinstance(template, str) else None


class Glm4Tokenizer:
    family = "glm4_0414"

    def __init__(self, folder: str | os.PathLike, thinking: str = "keep"):
        from tokenizers import Tokenizer
        from transformers import PreTrainedTokenizerFast

        if thinking not in THINKING:
            raise ValueError(f"thinking={thinking!r}: use one of {', '.join(THINKING)}")
        self.folder, self.thinking = Path(folder), thinking
        config_file = self.folder / "tokenizer_config.json"
        try:
            config = json.loads(config_file.read_text(encoding="utf-8")) if config_file.is_file() else {}
        except (OSError, ValueError) as err:
            raise ValueError(f"{config_file}: not readable JSON ({err})") from None
        source = self.folder / "tokenizer.json"
        try:
            backend = Tokenizer.from_str(tokenizer_json(source))
        except Exception as err:  # tokenizers raises its own exception type for a file it cannot parse
            if str(err).startswith(str(source)):
                raise
            raise ValueError(f"{source}: tokenizers cannot read it ({str(err).splitlines()[0][:160]})") from None
        self.fast = PreTrainedTokenizerFast(tokenizer_object=backend, clean_up_tokenization_spaces=False)
        self.specials = {t.content: i for i, t in sorted(self.fast.added_tokens_decoder.items()) if t.special}
        self.eos_token_id = self._id(config.get("eos_token"), "<|endoftext|>")
        self.pad_token_id = self._id(config.get("pad_token"), "<|endoftext|>")
        self.stop_token_ids = [self.specials[s] for s in STOPS if s in self.specials]
        template = read_chat_template(self.folder, config)
        if template is None:
            raise ValueError(
                f"{config_file}: no chat_template — a GLM-4-0414 checkpoint renders its prompts with the "
                "template of its tokenizer_config.json; copy that file again"
            )
        variables = {
            key: _content(config.get(key))
            for key in ("bos_token", "eos_token", "pad_token", "unk_token")
            if config.get(key) is not None
        }
        self.chat_template = template
        self.template = ChatTemplate(template, variables)
        digest = hashlib.sha256()
        for name in FILES:
            if (self.folder / name).is_file():
                digest.update(name.encode() + b"\0" + (self.folder / name).read_bytes() + b"\0")
        # What the tokenizer was made from, for caches of its output (data/cache.py keys on it): data.thinking
        # changes the encoding, so it is part of it.
        self.files_sha256 = hashlib.sha256(digest.digest() + f"thinking={thinking}".encode()).hexdigest()

    def _id(self, token, default: str) -> int:
        name = _content(token) or default
        if name not in self.specials:
            raise ValueError(
                f"{self.folder / 'tokenizer_config.json'}: {name!r} is not a special token of tokenizer.json"
            )
        return self.specials[name]

    @property
    def vocab_size(self) -> int:
        return len(self.fast)

    def __len__(self) -> int:
        return self.vocab_size

    def get_command(self, token: str) -> int:
        if token not in self.specials:
            raise ValueError(f"{token!r} is not a special token of {self.folder / 'tokenizer.json'}")
        return self.specials[token]

    def convert_tokens_to_ids(self, tokens):
        if isinstance(tokens, list):
            return [self.convert_tokens_to_ids(t) for t in tokens]
        found = self.fast.convert_tokens_to_ids(tokens)
        if found is None or (found == self.fast.unk_token_id and tokens != self.fast.unk_token):
            raise ValueError(f"{tokens!r} is neither a special token nor a single vocabulary token")
        return found

    def encode(self, text: str) -> list[int]:
        return self.fast.encode(text, add_special_tokens=False)

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return self.fast.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = False, tokenize: bool = True
    ):
        if add_generation_prompt:
            text = self.template.prompt(messages)
        else:
            tools, msgs = template_inputs(messages)
            text = self.template.render(msgs, False, tools)
        return self.encode(text) if tokenize else text

    def encode_prompt(self, messages: list[dict[str, Any]]) -> list[int]:
        """The prompt ids an engine feeds the model for GLM `messages` (ending on the turn to answer)."""
        return self.encode(self.template.prompt(messages))

    def encode_conversation(self, messages: list[dict[str, Any]]) -> tuple[list[int], list[int]]:
        """Untruncated (input_ids, labels) of a training conversation (labels -100 where no loss is taken):
        template.py says which tokens are trained."""
        prompt, spans, reply = self.template.training(messages, self.thinking)
        encoded = self.fast(prompt, add_special_tokens=False, return_offsets_mapping=True)
        ids, offsets = list(encoded["input_ids"]), encoded["offset_mapping"]
        labels = [IGNORE] * len(ids)
        for start, end in spans:
            inside = [i for i, (a, b) in enumerate(offsets) if b > start and a < end]
            after = next((i for i, (a, _) in enumerate(offsets) if a >= end), None)  # the next role token
            for i in inside + ([after] if after is not None else []):
                labels[i] = ids[i]
        reply_ids = self.encode(reply) + [self.get_command(TERMINATOR)]
        return ids + reply_ids, labels + reply_ids

    def save_pretrained(self, out_dir: str | os.PathLike) -> None:
        """The tokenizer files as the checkpoint has them, byte for byte (exports, the data cache's hash)."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        for name in FILES:
            if (self.folder / name).is_file():
                shutil.copyfile(self.folder / name, out / name)


def _content(token) -> str | None:
    """A tokenizer_config.json special token: a string, or an AddedToken dict with its `content`."""
    return token.get("content") if isinstance(token, dict) else token
