"""Encoding with the official GLM-4 loss mask, truncation and dropping, stats, the collator, the shipped samples.

Expected ids and labels are written out by hand from `encode_message` pieces and literal -100s, not by
re-running the encoder's loop, so a wrong shift or terminator shows up as a mismatch.
"""

import json
from pathlib import Path

import pytest
import torch
from helpers import REPO

from glmtune.config import DataConfig
from glmtune.data.pipeline import (
    DataCollator,
    DataError,
    build_datasets,
    encode_conversation,
    format_stats,
    longest_length,
    process_message,
)
from glmtune.data.validate import read_conversations
from glmtune.models.tokenizer_files import load_tokenizer, write_tiny_tokenizer

X = -100  # no loss at this position


@pytest.fixture(scope="module")
def tok3(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tok_chatglm3")
    write_tiny_tokenizer(folder, "chatglm3")
    return load_tokenizer(folder)


def U(text):
    return {"role": "user", "content": text}


def A(text):
    return {"role": "assistant", "content": text}


def S(text):
    return {"role": "system", "content": text}


def O(text):
    return {"role": "observation", "content": text}


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def write_jsonl(path: Path, conversations) -> Path:
    path.write_text(
        "".join(json.dumps({"messages": c}, ensure_ascii=False) + "\n" for c in conversations), encoding="utf-8"
    )
    return path


def test_single_turn_labels_are_the_reply_and_the_terminator(tok):
    gmask, sop = tok.get_command("[gMASK]"), tok.get_command("<sop>")
    assistant, user = tok.get_command("<|assistant|>"), tok.get_command("<|user|>")
    u, a = tok.encode_message(U("Who are you?")), tok.encode_message(A("I am GLM-4."))
    assert a[0] == assistant and u[0] == user and len(a) > 2
    ids, labels = encode_conversation([U("Who are you?"), A("I am GLM-4.")], tok)
    assert ids == [gmask, sop, *u, *a, user]  # GLM-4 terminator: <|user|>, not eos
    assert labels == [X, X] + [X] * len(u) + [X] + a[1:] + [user]
    assert labels[2 + len(u)] == X  # the <|assistant|> token itself is context, not a target
    assert labels[2 + len(u) + 1] == a[1]  # the "\n" after it is the first target


def test_multi_turn_supervises_every_reply_and_the_token_after_it(tok):
    conv = [U("Capital of Japan?"), A("Tokyo."), U("Population?"), A("About 14 million.")]
    u1, a1, u2, a2 = (tok.encode_message(m) for m in conv)
    ids, labels = encode_conversation(conv, tok)
    user = tok.get_command("<|user|>")
    assert ids == tok.prefix_ids() + u1 + a1 + u2 + a2 + [user]
    assert (
        labels
        == (
            [X, X]
            + [X] * len(u1)
            + [X]
            + a1[1:]
            + [u2[0]]  # the <|user|> that ends reply 1 is a target
            + [X] * (len(u2) - 1)
            + [X]
            + a2[1:]
            + [user]
        )
    )


def test_system_prompt_is_never_a_target(tok):
    conv = [S("Answer in one sentence."), U("Why is the sky blue?"), A("Rayleigh scattering.")]
    s, u, a = (tok.encode_message(m) for m in conv)
    ids, labels = encode_conversation(conv, tok)
    assert ids == tok.prefix_ids() + s + u + a + [tok.get_command("<|user|>")]
    assert labels == [X, X] + [X] * len(s) + [X] * len(u) + [X] + a[1:] + [tok.get_command("<|user|>")]


def test_tool_call_observation_and_final_answer(tok):
    system = {"role": "system", "content": "", "tools": [WEATHER_TOOL]}
    call = A(json.dumps({"name": "get_weather", "parameters": {"city": "Beijing"}}))
    conv = [system, U("Weather in Beijing?"), call, O('{"temperature": 21}'), A("It is 21 °C.")]
    s, u, c, o, a = (tok.encode_message(m) for m in conv)
    assert s[0] == tok.get_command("<|system|>") and o[0] == tok.get_command("<|observation|>")
    ids, labels = encode_conversation(conv, tok)
    assert ids == tok.prefix_ids() + s + u + c + o + a + [tok.get_command("<|user|>")]
    assert (
        labels
        == (
            [X, X]
            + [X] * len(s)
            + [X] * len(u)
            + [X]
            + c[1:]
            + [o[0]]  # the model must learn to stop its call with <|observation|>
            + [X] * (len(o) - 1)
            + [X]
            + a[1:]
            + [tok.get_command("<|user|>")]
        )
    )


def test_chatglm3_terminator_is_eos(tok3):
    conv = [U("你好"), A("你好！")]
    u, a = tok3.encode_message(conv[0]), tok3.encode_message(conv[1])
    ids, labels = encode_conversation(conv, tok3)
    assert ids == tok3.prefix_ids() + u + a + [tok3.eos_token_id]
    assert labels == [X, X] + [X] * len(u) + [X] + a[1:] + [tok3.eos_token_id]


def test_process_message_drops_none_properties_and_tools_off_system():
    system = {
        "role": "system",
        "content": "",
        "tools": [
            {
                "type": "function",
                "function": {
                    "name": "f",
                    "parameters": {"type": "object", "properties": {"a": {"type": "string"}, "b": None}},
                },
            }
        ],
    }
    cleaned = process_message(system)
    assert cleaned["tools"][0]["function"]["parameters"]["properties"] == {"a": {"type": "string"}}
    assert system["tools"][0]["function"]["parameters"]["properties"]["b"] is None  # input left untouched
    assert "tools" not in process_message({"role": "user", "content": "hi", "tools": []})


def test_truncation_cuts_from_the_right_and_keeps_the_example(tok, tmp_path):
    conv = [U("Explain LoRA."), A("LoRA trains two small matrices next to each frozen weight. " * 8)]
    u, a = tok.encode_message(conv[0]), tok.encode_message(conv[1])
    full_ids = tok.prefix_ids() + u + a + [tok.get_command("<|user|>")]
    full_labels = [X, X] + [X] * len(u) + [X] + a[1:] + [tok.get_command("<|user|>")]
    cut = 2 + len(u) + 10  # inside the reply
    train, _, stats = build_datasets(
        DataConfig(train_file=str(write_jsonl(tmp_path / "t.jsonl", [conv])), max_length=cut), tok
    )
    assert list(train) == [{"input_ids": full_ids[:cut], "labels": full_labels[:cut]}]
    assert (stats.train.truncated, stats.train.dropped, stats.train.max, stats.train.max_untruncated) == (
        1,
        0,
        cut,
        len(full_ids),
    )


def test_example_without_targets_after_truncation_is_dropped_and_counted(tok, tmp_path):
    short, long_prompt = [U("Hi"), A("Hello!")], [U("Please read this. " * 30), A("Done.")]
    n_short = len(tok.prefix_ids() + tok.encode_message(short[0]) + tok.encode_message(short[1])) + 1
    cut = n_short + 2  # the short example fits; the long prompt alone is longer than this
    assert len(tok.encode_message(long_prompt[0])) + 3 > cut
    path = write_jsonl(tmp_path / "t.jsonl", [short, long_prompt])
    train, _, stats = build_datasets(DataConfig(train_file=str(path), max_length=cut), tok)
    assert len(train) == 1 and len(train[0]["input_ids"]) == n_short
    assert (stats.train.examples, stats.train.kept, stats.train.dropped, stats.train.truncated) == (2, 1, 1, 0)
    assert stats.train.dropped_lines == (2,)
    assert "dropped" in format_stats(stats) and "lines 2" in format_stats(stats)


def test_all_examples_dropped_is_a_data_error(tok, tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", [[U("Please read this. " * 30), A("Done.")]])
    with pytest.raises(DataError, match=r"t\.jsonl:1: .*data\.max_length=8"):
        build_datasets(DataConfig(train_file=str(path), max_length=8), tok)


def test_stats_on_a_handmade_file(tok, tmp_path):
    convs = [
        [U("a"), A("b")],
        [U("Hi there"), A("Hello, how can I help?")],
        [S("Be brief."), U("What is 2 + 2?"), A("4.")],
        [U("Tell me a story."), A("Once upon a time " * 20)],
    ]
    lengths = [2 + sum(len(tok.encode_message(m)) for m in c) + 1 for c in convs]
    max_length = sorted(lengths)[2] + 1  # the longest one is truncated, the other three fit
    train_path = write_jsonl(tmp_path / "train.jsonl", convs)
    val_path = write_jsonl(tmp_path / "val.jsonl", convs[:2])
    train, val, stats = build_datasets(DataConfig(str(train_path), str(val_path), max_length), tok)
    kept = sorted(min(n, max_length) for n in lengths)
    s = stats.train
    assert (s.examples, s.kept, s.dropped, s.truncated) == (4, 4, 0, 1)
    assert (s.p50, s.p95, s.max, s.max_untruncated) == (kept[1], kept[3], max_length, max(lengths))  # nearest rank
    assert s.tokens == sum(kept)
    assert s.target_tokens == sum(sum(label != X for label in ex["labels"]) for ex in train)
    assert stats.val is not None and (stats.val.examples, stats.val.max) == (2, max(lengths[:2]))
    assert len(val) == 2 and longest_length(stats) == max_length
    table = format_stats(stats)
    assert f"max_length={max_length}" in table and "train" in table and "val" in table


def test_validation_file_is_optional(tok, tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", [[U("a"), A("b")]])
    _, val, stats = build_datasets(DataConfig(train_file=str(path), val_file=None), tok)
    assert val is None and stats.val is None
    assert not any(line.startswith("val") for line in format_stats(stats).splitlines())


def test_collator_right_pads_with_pad_id_and_minus_100():
    batch = DataCollator(pad_id=7)([{"input_ids": [1, 2, 3], "labels": [X, 2, 3]}, {"input_ids": [4], "labels": [4]}])
    assert all(t.dtype == torch.long for t in batch.values())
    assert batch["input_ids"].tolist() == [[1, 2, 3], [4, 7, 7]]
    assert batch["labels"].tolist() == [[X, 2, 3], [4, X, X]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]


def test_collator_pad_to_multiple_of():
    batch = DataCollator(pad_id=0, pad_to_multiple_of=8)([{"input_ids": [5] * 9, "labels": [5] * 9}])
    assert batch["input_ids"].shape == (1, 16) and batch["attention_mask"].sum().item() == 9
    assert batch["labels"][0, 9:].tolist() == [X] * 7
    exact = DataCollator(pad_id=0, pad_to_multiple_of=4)([{"input_ids": [5] * 8, "labels": [5] * 8}])
    assert exact["input_ids"].shape == (1, 8)


def test_shipped_samples_encode_with_nothing_dropped(tok):
    cfg = DataConfig(train_file=str(REPO / "data/samples/train.jsonl"), val_file=str(REPO / "data/samples/val.jsonl"))
    train, val, stats = build_datasets(cfg, tok)
    assert 40 <= stats.train.examples <= 60 and stats.val.examples >= 8
    assert stats.train.dropped == 0 and stats.val.dropped == 0
    assert stats.train.truncated >= 5 and stats.train.max_untruncated > 500  # long answers exercise truncation
    assert all(len(ex["input_ids"]) == len(ex["labels"]) <= 500 for ex in [*train, *val])
    roles = {m["role"] for c in read_conversations(cfg.train_file) for m in c.messages}
    assert roles == {"system", "user", "assistant", "observation"}


def test_shipped_chatglm3_sample_uses_the_conversations_key(tok3):
    path = REPO / "data/samples/chatglm3_train.jsonl"
    assert all("conversations" in json.loads(line) for line in path.read_text(encoding="utf-8").splitlines())
    train, _, stats = build_datasets(DataConfig(train_file=str(path)), tok3)
    assert stats.train.kept == stats.train.examples >= 10
    assert all(ex["input_ids"][-1] == tok3.eos_token_id for ex in train)
