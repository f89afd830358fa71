"""GLM-4 / GLM-4V tokenizer: byte-level BPE over a tiktoken rank table, plus glm-4-9b-chat's chat template.

`tokenizer.model` holds one "<base64 token bytes> <rank>" line per token (151,329 in the release); the 14
special tokens take the ids after the last rank. The tiny tokenizer is a byte-level BPE trained here.
"""

from __future__ import annotations

import base64
import binascii
import heapq
import json
import re
from collections import Counter
from functools import lru_cache
from pathlib import Path
from typing import Any

import regex
import tiktoken

from .tokenization import ChatTokenizer, Message, checked_message

# The pre-tokenization regex of the official tokenization_chatglm.py (cl100k-style).
PAT_STR = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
SPECIAL_TOKENS = (
    "<|endoftext|>",
    "[MASK]",
    "[gMASK]",
    "[sMASK]",
    "<sop>",
    "<eop>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|observation|>",
    "<|begin_of_image|>",
    "<|end_of_image|>",
    "<|begin_of_video|>",
    "<|end_of_video|>",
)
_RANK_LINE = re.compile(rb"[A-Za-z0-9+/]+={0,2} \d+")

# --- the tools system block of glm-4-9b-chat's jinja chat_template (tokenizer_config.json) -------------
# Reconstructed from copies of that template (GLM-4 revisions name the assistant "GLM-4", early ones
# "ChatGLM"; load_tokenizer picks the name out of the checkpoint's own template). Two rendering details
# of transformers are reproduced because they decide the token ids the official fine-tune demo trains on:
#   * the template is compiled with trim_blocks=True, which drops the first "\n" after `{% if ... %}`,
#     so each tool section starts with "\n## name" although the template text says "\n\n## name";
#   * `tojson(indent=4)` is json.dumps(ensure_ascii=False, indent=4) in key order (transformers >= 4.42;
#     4.40's jinja built-in sorted keys and escaped non-ASCII, an accident we do not copy).
_TOOLS_INTRO = (
    "你是一个名为 {name} 的人工智能助手。你是基于智谱AI训练的语言模型 GLM-4 模型开发的，"
    "你的任务是针对用户的问题和要求提供适当的答复和支持。\n\n# 可用工具"
)
_FUNCTION_SUFFIX = "\n在调用上述函数时，请使用 Json 格式表示调用的参数。"
_BUILTIN_TOOLS = {
    "python": "当你向 `python` 发送包含 Python 代码的消息时，该代码将会在一个有状态的 Jupyter notebook 环境中执行。\n"
    "`python` 返回代码执行的输出，或在执行 60 秒后返回超时。\n`/mnt/data` 将会持久化存储你的文件。"
    "在此会话中，`python` 无法访问互联网。不要使用 `python` 进行任何网络请求或者在线 API 调用，"
    "这些在线内容的访问将不会成功。",
    "simple_browser": "你可以使用 `simple_browser` 工具。该工具支持以下函数：\n`search(query: str, recency_days: int)`："
    "使用搜索引擎进行查询并显示结果，可以使用 `recency_days` 参数控制搜索内容的时效性。\n"
    "`mclick(ids: list[int])`：获取一系列指定 id 的页面内容。每次调用时，须选择3-10个页面。"
    "选择多个角度的页面，同时尽可能选择可信任的信息来源。考虑到部分页面是无法加载的，"
    "你也可以多打开一些可能有用的页面而不用担心内容过多。\n`open_url(url: str)`：打开指定的 URL。\n\n"
    "使用 `【{引用 id}†{引用文本}】` 来引用内容。\n\n操作步骤：1. 使用 `search` 来获得信息列表; "
    "2. 使用 `mclick` 来获取指定 ID 页面的内容; 3. 根据获得的内容进行回复。在回复中应当引用信息来源。\n"
    " 如果用户提供了 URL，也可以用 `open_url` 直接打开页面。\n"
    "如果初次搜索结果没有找到合适的信息，也可以再次使用 `search` 进行搜索。",
    "cogview": "如果用户的请求中包含了对图像的描述，你可以使用 `cogview` 来生成图像并展示给用户。"
    "你需要向 `cogview` 发送图像描述，规则：\n- 发送给 `cogview` 的消息必须使用英语。用户的中文描述必须完全翻译为英语。\n"
    "- 应当尽可能详细地描述图像生成的需求，需求描述约 100 英文单词。\n- 保持用户原始描述的意图。"
    "不要虚构内容或者没见过的人物。\n- 如无特殊说明，所在地为中国，持有中国立场并遵循中国社会主义价值观。",
}


def render_tools_block(tools: list[dict[str, Any]], assistant_name: str = "GLM-4") -> str:
    """The text that follows `<|system|>` in the tools block (one text piece, as the template tokenizes it)."""
    text = "\n" + _TOOLS_INTRO.format(name=assistant_name)
    for tool in tools:
        kind = tool.get("type")
        if kind == "function":
            function = tool["function"]
            text += f"\n## {function['name']}\n\n{json.dumps(function, ensure_ascii=False, indent=4)}{_FUNCTION_SUFFIX}"
        elif kind in _BUILTIN_TOOLS:
            text += f"\n## {kind}\n\n{_BUILTIN_TOOLS[kind]}"
        else:  # the jinja template silently drops unknown tools; a training set should hear about it
            raise ValueError(f"unknown tool type {kind!r}; GLM-4 knows function, {', '.join(_BUILTIN_TOOLS)}")
    return text


def looks_like_rank_file(data: bytes) -> bool:
    first_line = data.split(b"\n", 1)[0].strip()
    return bool(_RANK_LINE.fullmatch(first_line))


class GLM4Tokenizer(ChatTokenizer):
    family = "glm4"
    aliases = {"sop": "<sop>", "eop": "<eop>"}

    def __init__(self, mergeable_ranks: dict[bytes, int], chat_template: str | None = None) -> None:
        if sorted(mergeable_ranks.values()) != list(range(len(mergeable_ranks))):
            raise ValueError("GLM-4 ranks must be 0..n-1 without gaps: the special ids are numbered after them")
        n = len(mergeable_ranks)
        self.specials = {s: n + k for k, s in enumerate(SPECIAL_TOKENS)}
        self.ranks = mergeable_ranks
        self._enc = tiktoken.Encoding(
            name="glmtune_glm4", pat_str=PAT_STR, mergeable_ranks=mergeable_ranks, special_tokens=self.specials
        )
        self.eos_token_id = self.pad_token_id = self.specials["<|endoftext|>"]
        self.stop_token_ids = [self.eos_token_id, self.specials["<|user|>"], self.specials["<|observation|>"]]
        found = re.search(r"你是一个名为 (\S+) 的人工智能助手", chat_template or "")
        self.tools_assistant_name = found.group(1) if found else "GLM-4"
        super().__init__(chat_template)

    @classmethod
    def from_bytes(
        cls, data: bytes, chat_template: str | None = None, source: str = "tokenizer.model"
    ) -> GLM4Tokenizer:
        ranks: dict[bytes, int] = {}
        for number, line in enumerate(data.splitlines(), 1):
            if not line.strip():
                continue
            try:
                token, rank = line.split()
                ranks[base64.b64decode(token, validate=True)] = int(rank)
            except (ValueError, binascii.Error):
                raise ValueError(f"{source}:{number}: expected '<base64 token bytes> <rank>'") from None
        return cls(ranks, chat_template=chat_template)

    @property
    def vocab_size(self) -> int:
        return len(self.ranks) + len(self.specials)

    def encode(self, text: str) -> list[int]:
        # encode_ordinary never produces special ids, so "<|user|>" in data stays text (no prompt injection).
        return self._enc.encode_ordinary(text)

    def _decode_ordinary(self, ids: list[int]) -> str:
        return self._enc.decode_bytes(ids).decode("utf-8", errors="replace")

    def _ordinary_token_id(self, token: str) -> int | None:
        return self.ranks.get(token.encode("utf-8"))

    def _pieces(self, message: Message) -> list[tuple[bool, str]]:
        """(is_special, text) pieces: the jinja template renders a string in which the tokenizer then finds
        the special tokens, so everything between two specials is encoded as ONE piece."""
        role, metadata, content = checked_message(message)
        pieces: list[tuple[bool, str]] = []
        if message.get("tools") is not None:  # `item['tools'] is defined`
            pieces += [(True, "<|system|>"), (False, render_tools_block(message["tools"], self.tools_assistant_name))]
        if content:
            pieces += [(True, f"<|{role}|>"), (False, f"{metadata}\n{content}")]
        return pieces

    def encode_message(self, message: Message) -> list[int]:
        ids: list[int] = []
        for special, text in self._pieces(message):
            ids += [self.specials[text]] if special else self.encode(text)
        return ids

    def render_message(self, message: Message) -> str:
        return "".join(text for _, text in self._pieces(message))

    def _write_model_file(self, path: Path) -> None:
        lines = (
            f"{base64.b64encode(token).decode()} {rank}\n"
            for token, rank in sorted(self.ranks.items(), key=lambda kv: kv[1])
        )
        path.write_text("".join(lines))

    def _config(self) -> dict[str, Any]:
        return {"eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>"}

    def tokenizer_json(self) -> dict[str, Any]:
        from .tokenizer_json import glm4_tokenizer_json

        return glm4_tokenizer_json(self.ranks, self.specials, PAT_STR)


def train_byte_bpe(text: str, n_merges: int) -> dict[bytes, int]:
    """Byte-level BPE on `text` after PAT_STR pre-tokenization: ranks 0..255 are the single bytes (rank == byte
    value), then one rank per merge. Ties go to the smallest pair of ids, so the result is deterministic."""
    words = Counter(piece.encode("utf-8") for piece in regex.findall(PAT_STR, text))
    vocab: list[bytes] = [bytes([b]) for b in range(256)]
    ids_of: dict[bytes, int] = {t: i for i, t in enumerate(vocab)}
    seqs = [list(w) for w in words]
    freqs = list(words.values())
    counts: Counter[tuple[int, int]] = Counter()
    where: dict[tuple[int, int], set[int]] = {}
    for w, seq in enumerate(seqs):
        for pair in zip(seq, seq[1:]):
            counts[pair] += freqs[w]
            where.setdefault(pair, set()).add(w)
    heap = [(-c, pair) for pair, c in counts.items()]
    heapq.heapify(heap)
    while len(vocab) < 256 + n_merges and heap:
        neg, pair = heapq.heappop(heap)
        if counts.get(pair, 0) != -neg or neg == 0:
            continue  # stale heap entry; the current count was pushed again when it changed
        merged = vocab[pair[0]] + vocab[pair[1]]
        if merged not in ids_of:  # the same bytes can arise from two different splits; keep one rank
            ids_of[merged] = len(vocab)
            vocab.append(merged)
        new_id = ids_of[merged]
        changed: set[tuple[int, int]] = set()
        for w in sorted(where.pop(pair, ())):
            seq, f = seqs[w], freqs[w]
            for old in zip(seq, seq[1:]):
                counts[old] -= f
                changed.add(old)
            out, i = [], 0
            while i < len(seq):
                if i + 1 < len(seq) and (seq[i], seq[i + 1]) == pair:
                    out.append(new_id)
                    i += 2
                else:
                    out.append(seq[i])
                    i += 1
            seqs[w] = out
            for new in zip(out, out[1:]):
                counts[new] += f
                changed.add(new)
                where.setdefault(new, set()).add(w)
        for p in changed:
            if counts[p] > 0:
                heapq.heappush(heap, (-counts[p], p))
    return {token: rank for rank, token in enumerate(vocab)}


@lru_cache(maxsize=2)
def tiny_glm4_tokenizer(corpus: str, n_merges: int = 1010) -> GLM4Tokenizer:
    """1,266 ranks + 14 specials = 1,280 ids (already a multiple of 64, like the real padded vocabularies)."""
    return GLM4Tokenizer(train_byte_bpe(corpus, n_merges))
