"""Tokenizers: exact chat-template ids, the tools block, round trips, no special-token injection, loading
without remote code, and the id layout of the released vocabularies."""

import base64
import json
import random
import struct
import sys

import pytest
import regex
import sentencepiece

from glmtune.models.chatglm.tokenization_chatglm3 import ChatGLM3Tokenizer, tiny_chatglm3_tokenizer
from glmtune.models.chatglm.tokenization_glm4 import GLM4Tokenizer, tiny_glm4_tokenizer
from glmtune.models.tokenizer_files import TINY_CORPUS, load_tokenizer, write_tiny_tokenizer

# Tiny GLM-4: 1,266 ranks, so the 14 specials are 1266..1279.
G_EOT, G_GMASK, G_SOP, G_SYSTEM, G_USER, G_ASSISTANT, G_OBSERVATION = 1266, 1268, 1270, 1272, 1273, 1274, 1275
# Tiny ChatGLM3: 1,015 SentencePiece pieces, so the 9 specials are 1015..1023.
C_GMASK, C_SOP, C_SYSTEM, C_USER, C_ASSISTANT, C_OBSERVATION = 1016, 1018, 1020, 1021, 1022, 1023

TOOL_CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": TOOL_CALL},
    {"role": "observation", "content": '{"temp": 21}'},
    {"role": "assistant", "content": "It is 21 C."},
]
WEATHER_FN = {
    "name": "get_weather",
    "description": "查询天气",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
MIXED = "  你好，GLM-4! Hello\tworld 😊🎉\n\n  多个  空格 \r\n\x00\x07\x1b[0m ünïcödé 𝔘 \u200b end \n "


@pytest.fixture(scope="module")
def glm4_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("glm4")
    assert write_tiny_tokenizer(out, "glm4") == 1280
    return out


@pytest.fixture(scope="module")
def chatglm3_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("chatglm3")
    assert write_tiny_tokenizer(out, "chatglm3") == 1024
    return out


@pytest.fixture(scope="module")
def glm4(glm4_dir):
    return load_tokenizer(glm4_dir)


@pytest.fixture(scope="module")
def chatglm3(chatglm3_dir):
    return load_tokenizer(chatglm3_dir)


# --- an independent BPE (tiktoken semantics) over the written rank file, to derive expected ids ---------
PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def read_ranks(folder):
    lines = (folder / "tokenizer.model").read_text().splitlines()
    return {base64.b64decode(tok): int(rank) for tok, rank in (line.split() for line in lines)}


def reference_bpe(text, ranks):
    ids = []
    for piece in regex.findall(PATTERN, text):
        parts = [bytes([b]) for b in piece.encode("utf-8")]
        while True:  # merge the adjacent pair whose concatenation has the lowest rank, leftmost first
            candidates = [(ranks[a + b], i) for i, (a, b) in enumerate(zip(parts, parts[1:])) if a + b in ranks]
            if not candidates:
                break
            _, i = min(candidates)
            parts[i : i + 2] = [parts[i] + parts[i + 1]]
        ids += [ranks[p] for p in parts]
    return ids


def test_glm4_conversation_ids_follow_the_template(glm4, glm4_dir):
    ranks = read_ranks(glm4_dir)
    assert len(ranks) == 1266 and all(ranks[bytes([b])] == b for b in range(256))

    def bpe(text):
        return reference_bpe(text, ranks)

    expected = (
        [G_GMASK, G_SOP]
        + [G_SYSTEM]
        + bpe("\nBe brief.")
        + [G_USER]
        + bpe("\nWeather in Paris?")
        + [G_ASSISTANT]
        + bpe("\n" + TOOL_CALL)
        + [G_OBSERVATION]
        + bpe('\n{"temp": 21}')
        + [G_ASSISTANT]
        + bpe("\nIt is 21 C.")
    )
    assert glm4.apply_chat_template(CONVERSATION) == expected
    assert glm4.apply_chat_template(CONVERSATION[:2], add_generation_prompt=True) == expected[
        : expected.index(G_ASSISTANT)
    ] + [G_ASSISTANT]
    assert glm4.apply_chat_template(CONVERSATION, tokenize=False) == (
        "[gMASK]<sop><|system|>\nBe brief.<|user|>\nWeather in Paris?<|assistant|>\n"
        + TOOL_CALL
        + '<|observation|>\n{"temp": 21}<|assistant|>\nIt is 21 C.'
    )
    # The official fine-tune script tokenizes message by message and drops the prefix: same ids.
    per_message = [glm4.encode_message(m) for m in CONVERSATION]
    assert glm4.prefix_ids() + sum(per_message, []) == expected
    # metadata goes on the role line, in the same text piece; empty content renders nothing at all
    message = {"role": "assistant", "metadata": "get_weather", "content": '{"city": "Paris"}'}
    assert glm4.encode_message(message) == [G_ASSISTANT] + bpe('get_weather\n{"city": "Paris"}')
    # "{metadata}\n{content}" is ONE text piece (the jinja template renders a string, then tokenizes it):
    # here the role line's "\n" merges with the content's leading "\n", which separate encodes would not do
    assert glm4.encode_message({"role": "user", "content": "\nHi"}) == [G_USER] + bpe("\n\nHi")
    assert bpe("\n\nHi") != bpe("\n") + bpe("\nHi")
    assert glm4.encode_message({"role": "user", "content": ""}) == []
    assert glm4.stop_token_ids == [G_EOT, G_USER, G_OBSERVATION] and glm4.eos_token_id == glm4.pad_token_id == G_EOT


def test_glm4_tools_block(glm4, glm4_dir):
    messages = [
        {"role": "system", "content": "", "tools": [{"type": "function", "function": WEATHER_FN}]},
        {"role": "user", "content": "Hi"},
    ]
    block = (
        "\n你是一个名为 GLM-4 的人工智能助手。你是基于智谱AI训练的语言模型 GLM-4 模型开发的，你的任务是针对用户的问题和要求"
        "提供适当的答复和支持。\n\n# 可用工具\n## get_weather\n\n"
        '{\n    "name": "get_weather",\n    "description": "查询天气",\n    "parameters": {\n'
        '        "type": "object",\n        "properties": {\n            "city": {\n'
        '                "type": "string"\n            }\n        },\n        "required": [\n'
        '            "city"\n        ]\n    }\n}\n在调用上述函数时，请使用 Json 格式表示调用的参数。'
    )
    assert glm4.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) == (
        "[gMASK]<sop><|system|>" + block + "<|user|>\nHi<|assistant|>"
    )
    ranks = read_ranks(glm4_dir)
    assert glm4.apply_chat_template(messages) == (
        [G_GMASK, G_SOP, G_SYSTEM] + reference_bpe(block, ranks) + [G_USER] + reference_bpe("\nHi", ranks)
    )
    # system content next to tools: the block, then the system message itself
    with_content = glm4.render_message({"role": "system", "content": "Be brief.", "tools": []})
    assert with_content == "<|system|>" + block[: block.index("\n## ")] + "<|system|>\nBe brief."
    python = glm4.render_message({"role": "system", "content": "", "tools": [{"type": "python"}]})
    assert python.endswith(
        "# 可用工具\n## python\n\n当你向 `python` 发送包含 Python 代码的消息时，该代码将会在一个有状态的 "
        "Jupyter notebook 环境中执行。\n`python` 返回代码执行的输出，或在执行 60 秒后返回超时。\n"
        "`/mnt/data` 将会持久化存储你的文件。在此会话中，`python` 无法访问互联网。不要使用 `python` "
        "进行任何网络请求或者在线 API 调用，这些在线内容的访问将不会成功。"
    )
    with pytest.raises(ValueError, match="unknown tool type 'retrieval'"):
        glm4.encode_message({"role": "system", "content": "", "tools": [{"type": "retrieval"}]})
    # early glm-4-9b-chat templates name the assistant ChatGLM; the checkpoint's own template decides
    early = GLM4Tokenizer(glm4.ranks, chat_template="<|system|>\n你是一个名为 ChatGLM 的人工智能助手。…")
    assert early.render_message(messages[0]).startswith(
        "<|system|>\n你是一个名为 ChatGLM 的人工智能助手。你是基于智谱AI"
    )


CHATGLM3_PIECES = {  # pinned from the tiny model (SentencePiece 0.2); each text gets its own dummy-prefix "▁"
    "\n": [585, 13],
    "Be brief.": [370, 586, 324, 348, 586, 604, 609],
    "Weather in Paris?": [425, 586, 358, 319, 372, 292, 490, 702],
    TOOL_CALL: [
        289,
        387,
        265,
        264,
        379,
        612,
        478,
        272,
        264,
        542,
        285,
        317,
        589,
        265,
        289,
        584,
        265,
        264,
        660,
        292,
        490,
        538,
    ],
    '{"temp": 21}': [289, 587, 363, 602, 265, 585, 627, 623, 620],
    "It is 21 C.": [371, 587, 356, 585, 627, 623, 585, 703, 609],
}


def test_chatglm3_conversation_ids_follow_build_chat_input(chatglm3):
    for text, ids in CHATGLM3_PIECES.items():
        assert chatglm3.encode(text) == ids and chatglm3.decode(ids) == text
    newline = CHATGLM3_PIECES["\n"]
    roles = [C_SYSTEM, C_USER, C_ASSISTANT, C_OBSERVATION, C_ASSISTANT]
    expected = [C_GMASK, C_SOP]
    for role, message in zip(roles, CONVERSATION):
        expected += [role] + newline + CHATGLM3_PIECES[message["content"]]
    assert chatglm3.apply_chat_template(CONVERSATION) == expected
    assert chatglm3.apply_chat_template(CONVERSATION[:2], add_generation_prompt=True) == expected[
        : expected.index(C_ASSISTANT)
    ] + [C_ASSISTANT]
    assert chatglm3.prefix_ids() == [C_GMASK, C_SOP] == [chatglm3.get_command("[gMASK]"), chatglm3.get_command("sop")]
    # the string form is what decode gives: "<|role|>\n content", as chatglm3-6b's own jinja template writes it
    text = chatglm3.apply_chat_template(CONVERSATION, tokenize=False)
    assert text == (
        "[gMASK]sop<|system|>\n Be brief.<|user|>\n Weather in Paris?<|assistant|>\n "
        + TOOL_CALL
        + '<|observation|>\n {"temp": 21}<|assistant|>\n It is 21 C.'
    )
    assert chatglm3.decode(expected) == text
    # metadata is encoded with the newline, content separately; empty content still renders the role line
    meta = chatglm3.encode_message({"role": "assistant", "metadata": "get_weather", "content": "Hi"})
    assert meta == [C_ASSISTANT] + chatglm3.encode("get_weather\n") + chatglm3.encode("Hi")
    assert chatglm3.encode_message({"role": "user", "content": ""}) == [C_USER] + newline
    assert chatglm3.eos_token_id == 2 and chatglm3.pad_token_id == 0
    assert chatglm3.stop_token_ids == [2, C_USER, C_OBSERVATION]


def test_chatglm3_tools_are_appended_as_json(chatglm3):
    tools = [{"name": "get_weather", "description": "查询天气"}]
    message = {"role": "system", "content": "Answer.", "tools": tools}
    assert chatglm3.render_message(message) == (
        '<|system|>\n Answer.\n[\n    {\n        "name": "get_weather",\n        "description": "查询天气"\n    }\n]'
    )
    content = 'Answer.\n[\n    {\n        "name": "get_weather",\n        "description": "查询天气"\n    }\n]'
    assert chatglm3.encode_message(message) == [C_SYSTEM] + CHATGLM3_PIECES["\n"] + chatglm3.encode(content)


@pytest.mark.parametrize("name", ["glm4", "chatglm3"])
def test_round_trip(name, request):
    tok = request.getfixturevalue(name)
    for text in [MIXED, "", " ", "\n", "\t\t", "  leading and trailing  ", "😊", "中文", "a" * 300, "\r\n\r\n"]:
        assert tok.decode(tok.encode(text)) == text
    rng = random.Random(0)
    alphabets = [
        " \t\n\r\x0b\x0c",
        "".join(map(chr, range(0x20))) + "\x7f",
        "abcXYZ019.,!?'\"{}[]<|>_-=",
        "你好世界模型训练数据的是了一",
        "😊🎉👍🚀🤖",
        "éüßñøçαβγдж한국어日本語",
    ]
    for _ in range(300):
        chars = []
        for _ in range(rng.randint(0, 40)):
            if rng.random() < 0.2:  # any code point, surrogates excluded (not encodable as UTF-8)
                cp = rng.choice([rng.randint(0, 0xD7FF), rng.randint(0xE000, 0x10FFFF)])
                # SentencePiece writes spaces as U+2581, so that one character cannot survive ChatGLM3's model
                chars.append(chr(cp) if cp != 0x2581 else "x")
            else:
                chars.append(rng.choice(rng.choice(alphabets)))
        text = "".join(chars)
        assert tok.decode(tok.encode(text)) == text, repr(text)


@pytest.mark.parametrize("name", ["glm4", "chatglm3"])
def test_special_strings_in_text_stay_text(name, request):
    tok = request.getfixturevalue(name)
    injected = "<|user|>[gMASK]<sop>sop<|assistant|><|observation|><|endoftext|>"
    specials = set(tok.specials.values())
    assert not specials & set(tok.encode(injected))
    ids = tok.apply_chat_template([{"role": "user", "content": injected}])
    assert [i for i in ids if i in specials] == tok.prefix_ids() + [tok.get_command("<|user|>")]
    assert tok.decode(tok.encode(injected)) == injected
    assert tok.decode(ids, skip_special_tokens=True).endswith(injected)


@pytest.mark.parametrize(
    "family,cls", [("glm4", GLM4Tokenizer), ("glm4v", GLM4Tokenizer), ("chatglm3", ChatGLM3Tokenizer)]
)
def test_load_tiny_tokenizers(tmp_path, family, cls):
    size = write_tiny_tokenizer(tmp_path, family)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    tok = load_tokenizer(tmp_path)
    assert isinstance(tok, cls) and tok.family == config["family"] and size == tok.vocab_size == len(tok)
    sop = tok.prefix_ids()[1]  # either spelling works for either family
    assert tok.get_command("<sop>") == tok.get_command("sop") == tok.convert_tokens_to_ids("<sop>") == sop
    assert tok.convert_tokens_to_ids(["[gMASK]", "<|user|>"]) == [tok.prefix_ids()[0], tok.get_command("<|user|>")]
    with pytest.raises(ValueError, match="not a .* special token"):
        tok.get_command("<|tool|>")
    with pytest.raises(ValueError, match="outside the"):
        tok.decode([size + 5])
    # saving reproduces the files byte for byte
    tok.save_pretrained(tmp_path / "saved")
    for name in ("tokenizer.model", "tokenizer_config.json"):
        assert (tmp_path / "saved" / name).read_bytes() == (tmp_path / name).read_bytes()


def test_tiny_tokenizers_are_deterministic():
    first, second = tiny_glm4_tokenizer.__wrapped__(TINY_CORPUS), tiny_glm4_tokenizer.__wrapped__(TINY_CORPUS)
    assert list(first.ranks.items()) == list(second.ranks.items())
    assert (
        tiny_chatglm3_tokenizer.__wrapped__(TINY_CORPUS).model_proto
        == tiny_chatglm3_tokenizer.__wrapped__(TINY_CORPUS).model_proto
    )


def test_loading_never_imports_the_checkpoint_code(tmp_path, glm4_dir, chatglm3_dir):
    for source in (glm4_dir, chatglm3_dir):
        folder = tmp_path / source.name
        folder.mkdir()
        (folder / "tokenizer.model").write_bytes((source / "tokenizer.model").read_bytes())
        marker = folder / "imported"
        (folder / "tokenization_chatglm.py").write_text(
            f"open({str(marker)!r}, 'w').close()\nraise RuntimeError('remote code must not run')\n"
        )
        (folder / "tokenizer_config.json").write_text(
            json.dumps({"auto_map": {"AutoTokenizer": ["tokenization_chatglm.ChatGLM4Tokenizer", None]}})
        )
        tok = load_tokenizer(folder)
        assert tok.decode(tok.encode(MIXED)) == MIXED
        assert not marker.exists() and "tokenization_chatglm" not in sys.modules


def test_unusable_tokenizer_model_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="cannot read tokenizer.model"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer.model").write_bytes(b"\x00\x01 not a tokenizer")
    with pytest.raises(ValueError, match="neither a GLM-4 rank table nor a SentencePiece model"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer.model").write_text("IQ== 0\nnot-base64! 1\n")
    with pytest.raises(ValueError, match=r"tokenizer.model:2: expected"):
        load_tokenizer(tmp_path)


def test_released_glm4_id_layout(tmp_path):
    """151,329 ranks (the release) put the specials at 151329..151342, as in glm-4-9b-chat's config."""
    tokens = [bytes([b]) for b in range(256)] + [bytes([a, b]) for a in range(256) for b in range(256)]
    tokens += [bytes([a, b, c]) for a in range(256) for b in range(256) for c in range(2)][: 151_329 - len(tokens)]
    (tmp_path / "tokenizer.model").write_text(
        "".join(f"{base64.b64encode(t).decode()} {i}\n" for i, t in enumerate(tokens))
    )
    tok = load_tokenizer(tmp_path)
    assert isinstance(tok, GLM4Tokenizer) and len(tok.ranks) == 151_329 and tok.vocab_size == 151_343
    layout = {
        "<|endoftext|>": 151329,
        "[MASK]": 151330,
        "[gMASK]": 151331,
        "[sMASK]": 151332,
        "<sop>": 151333,
        "<eop>": 151334,
        "<|system|>": 151335,
        "<|user|>": 151336,
        "<|assistant|>": 151337,
        "<|observation|>": 151338,
        "<|begin_of_image|>": 151339,
        "<|end_of_image|>": 151340,
        "<|begin_of_video|>": 151341,
        "<|end_of_video|>": 151342,
    }
    assert {name: tok.get_command(name) for name in layout} == layout
    assert tok.eos_token_id == tok.pad_token_id == 151329 and tok.stop_token_ids == [151329, 151336, 151338]
    assert tok.prefix_ids() == [151331, 151333]
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True) == (
        [151331, 151333, 151336] + tok.encode("\nhi") + [151337]
    )


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not n:
            return bytes(out)


def with_pieces(model_proto: bytes, pieces: list[tuple[str, float]]) -> bytes:
    """A serialized SentencePiece model with pieces appended: ModelProto field 1 (wire type 2) holds a piece
    message (piece = field 1, a string; score = field 2, a float), and protobuf merges a repeated field's
    entries in the order they appear. Written by hand: sentencepiece_model_pb2's generated code needs a
    protobuf runtime as new as the wheel's, and the track extra (swanlab) pins an older one."""
    out = bytearray(model_proto)
    for text, score in pieces:
        raw = text.encode()
        body = b"\x0a" + _varint(len(raw)) + raw + b"\x15" + struct.pack("<f", score)
        out += b"\x0a" + _varint(len(body)) + body
    return bytes(out)


def test_released_chatglm3_id_layout(chatglm3):
    """A 64,789-piece SentencePiece model (the release) gives the README ids [gMASK]=64790, sop=64792, ..."""
    have = sentencepiece.SentencePieceProcessor(model_proto=chatglm3.model_proto).get_piece_size()
    model = with_pieces(chatglm3.model_proto, [(f"▁synthetic{i}", -1000.0 - i) for i in range(64_789 - have)])
    assert sentencepiece.SentencePieceProcessor(model_proto=model).get_piece_size() == 64_789
    tok = ChatGLM3Tokenizer(model)
    assert tok.vocab_size == 64_798
    layout = {
        "[MASK]": 64789,
        "[gMASK]": 64790,
        "[sMASK]": 64791,
        "sop": 64792,
        "eop": 64793,
        "<|system|>": 64794,
        "<|user|>": 64795,
        "<|assistant|>": 64796,
        "<|observation|>": 64797,
    }
    assert {name: tok.get_command(name) for name in layout} == layout
    assert (tok.eos_token_id, tok.pad_token_id, tok.stop_token_ids) == (2, 0, [2, 64795, 64797])
