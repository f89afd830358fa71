"""tokenizer.json: glmtune's GLM-4 and ChatGLM3 tokenizers in the `tokenizers` library's format, so that serving
engines (vLLM, SGLang, transformers 5.x) load them as a `PreTrainedTokenizerFast` with no tokenizer code.

The official checkpoints ship `tokenization_chatglm.py`, which an engine can only run with trust_remote_code, and
whose older copies fail under transformers 5.x (`_pad() got an unexpected keyword argument 'padding_side'`).
The file written here is plain data, built from what glmtune's own tokenizers hold:

    GLM-4     byte-level BPE: vocab = the rank table with GPT-2's byte-to-character map, merges = every split
              of a token into two tokens, ordered by the token's rank (tiktoken merges the adjacent pair of
              lowest rank); the cl100k-style split regex; `ignore_merges` (tiktoken takes a whole pre-token
              that is itself a token first)
    ChatGLM3  SentencePiece BPE: the pieces, merges ordered by piece score, byte fallback; the normalizer and
              word split SentencePiece applies (dummy prefix per encoded text, spaces as U+2581)

No post-processor: `[gMASK]<sop>` comes from the chat template, as in glmtune's tokenizers and the official
GLM-4 template. Merges are written as "left right" strings, which `tokenizers` 0.19 (transformers 4.40.2)
reads as well as 0.20+ (byte-level and SentencePiece pieces never contain a plain space).
"""

from __future__ import annotations

import base64
from typing import Any


def byte_chars() -> list[str]:
    """GPT-2's printable stand-in for each byte: printable Latin-1 bytes are themselves, the other 68 take
    the code points from 256 up, in byte order (the `ByteLevel` pre-tokenizer's alphabet)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = [], 0
    for byte in range(256):
        if byte in printable:
            chars.append(chr(byte))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return chars


def merges_from_ranks(ranks: dict[Any, int]) -> list[tuple[Any, Any]]:
    """Every (left, right) whose concatenation is a token, both parts tokens too, ordered by the rank of the
    concatenation (then of the parts): BPE by merge order then equals BPE by lowest rank of the merged token."""
    found = []
    for token, rank in ranks.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in ranks and right in ranks:
                found.append((rank, ranks[left], ranks[right], left, right))
    found.sort(key=lambda m: m[:3])
    return [(left, right) for *_, left, right in found]


def _added(specials: dict[str, int]) -> list[dict]:
    return [
        {
            "id": i,
            "content": s,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": True,
        }
        for s, i in sorted(specials.items(), key=lambda kv: kv[1])
    ]


def glm4_tokenizer_json(ranks: dict[bytes, int], specials: dict[str, int], pattern: str) -> dict:
    chars = byte_chars()
    text = {token: "".join(chars[b] for b in token) for token in ranks}
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": _added(specials),
        "normalizer": None,
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": False},
                {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False},
            ],
        },
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": True,
            "vocab": {text[t]: r for t, r in sorted(ranks.items(), key=lambda kv: kv[1])},
            "merges": [f"{text[a]} {text[b]}" for a, b in merges_from_ranks(ranks)],
        },
    }


# --- ChatGLM3: what the SentencePiece model file says about normalization and word splitting --------------------
def _fields(data: bytes) -> dict[int, list]:
    """Protocol-buffer wire format, one message level: field number -> its values (varints as int,
    length-delimited as bytes). Enough to read NormalizerSpec and TrainerSpec without protobuf's generated code
    (sentencepiece's copy needs a newer protobuf runtime than glmtune's stack has)."""
    out: dict[int, list] = {}
    i = 0

    def varint() -> int:
        nonlocal i
        shift = value = 0
        while True:
            byte = data[i]
            i += 1
            value |= (byte & 0x7F) << shift
            shift += 7
            if byte < 0x80:
                return value

    while i < len(data):
        key = varint()
        number, wire = key >> 3, key & 7
        if wire == 0:
            value: Any = varint()
        elif wire == 2:
            size = varint()
            value, i = data[i : i + size], i + size
        elif wire in (1, 5):
            value, i = data[i : i + (8 if wire == 1 else 4)], i + (8 if wire == 1 else 4)
        else:
            raise ValueError(f"unexpected protobuf wire type {wire}")
        out.setdefault(number, []).append(value)
    return out


def _flag(fields: dict[int, list], number: int, default: bool) -> bool:
    return bool(fields[number][-1]) if number in fields else default


# sentencepiece_model.proto field numbers: ModelProto.trainer_spec 2, .normalizer_spec 3; NormalizerSpec
# precompiled_charsmap 2, add_dummy_prefix 3, remove_extra_whitespaces 4; TrainerSpec split_by_whitespace 22,
# treat_whitespace_as_suffix 24, allow_whitespace_only_pieces 26 (proto2 defaults: true, true, true, false, false).
def chatglm3_tokenizer_json(sp, model_proto: bytes, specials: dict[str, int]) -> dict:
    model = _fields(model_proto)
    norm = _fields(model.get(3, [b""])[-1])
    trainer = _fields(model.get(2, [b""])[-1])
    if _flag(trainer, 24, False) or not _flag(trainer, 22, True):
        raise ValueError(
            "SentencePiece model with whitespace as suffix or without whitespace split: its "
            "word split has no tokenizer.json equivalent here"
        )
    normalizers: list[dict] = []
    charsmap = norm.get(2, [b""])[-1]
    if charsmap:
        normalizers.append({"type": "Precompiled", "precompiled_charsmap": base64.b64encode(charsmap).decode()})
    if _flag(norm, 4, True):  # leading/trailing spaces dropped, runs of spaces made one
        normalizers += [
            {"type": "Replace", "pattern": {"Regex": "^ +| +$"}, "content": ""},
            {"type": "Replace", "pattern": {"Regex": " {2,}"}, "content": " "},
        ]
    if _flag(norm, 3, True):  # each encoded text (each segment between special tokens) gets a leading space
        normalizers.append({"type": "Prepend", "prepend": "▁"})
    normalizers.append({"type": "Replace", "pattern": {"String": " "}, "content": "▁"})
    # SentencePiece's SplitIntoWords: a word starts at each "▁" (a run of them, with whitespace-only pieces)
    words = "▁+[^▁]*|[^▁]+" if _flag(trainer, 26, False) else "▁[^▁]*|[^▁]+"
    n = sp.get_piece_size()
    vocab = {sp.id_to_piece(i): i for i in range(n)}
    normal = {
        sp.id_to_piece(i): (-sp.get_score(i), i)
        for i in range(n)
        if not (sp.is_byte(i) or sp.is_control(i) or sp.is_unknown(i) or sp.is_unused(i))
    }
    ranks = {piece: rank for rank, piece in enumerate(sorted(normal, key=normal.get))}
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": _added(specials),
        "normalizer": {"type": "Sequence", "normalizers": normalizers},
        "pre_tokenizer": {"type": "Split", "pattern": {"Regex": words}, "behavior": "Isolated", "invert": False},
        "post_processor": None,
        "decoder": {
            "type": "Sequence",
            "decoders": [
                {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
                {"type": "ByteFallback"},
                {"type": "Fuse"},
                {"type": "Strip", "content": " ", "start": 1, "stop": 0},
            ],
        },
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": sp.id_to_piece(sp.unk_id()),
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": True,
            "byte_fallback": True,
            "ignore_merges": False,
            "vocab": vocab,
            "merges": [f"{a} {b}" for a, b in merges_from_ranks(ranks)],
        },
    }
