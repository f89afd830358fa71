"""Other tools' data formats and file types: alpaca, ShareGPT, OpenAI chat (with a tool call) from .jsonl, .json,
Parquet and a saved `datasets` folder encode to exactly what the same conversation in GLM messages encodes to; a
bad record in each gives one `file:line` / `file:row N` line; the CLI trains from each and exits 2 on a bad one."""

import json
from pathlib import Path

import datasets
import pytest
from helpers.cli import glmtune_in_process

from glmtune.config import DataConfig
from glmtune.data.formats import detect
from glmtune.data.pipeline import DataError, build_datasets, encode_conversation
from glmtune.data.validate import read_conversations

TOOL = {
    "name": "get_weather",
    "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}

# The same two conversations in every format; GLM is the reference each must encode to.
GLM = [
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Add\n2 and 3"},
        {"role": "assistant", "content": "5"},
    ],
    [
        {"role": "system", "content": "", "tools": [{"type": "function", "function": TOOL}]},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "metadata": "get_weather", "content": '{"city": "Paris"}'},
        {"role": "observation", "content": '{"temp": 20}'},
        {"role": "assistant", "content": "20 °C."},
    ],
]
ALPACA = [
    {"instruction": "Add", "input": "2 and 3", "output": "5", "system": "Be brief.", "history": []},
    {"instruction": "Say hi", "input": "", "output": "hi", "system": "", "history": [["Hello?", "Hello."]]},
]
ALPACA_GLM = [
    GLM[0],
    [
        {"role": "user", "content": "Hello?"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Say hi"},
        {"role": "assistant", "content": "hi"},
    ],
]
SHAREGPT = [
    {
        "system": "Be brief.",
        "tools": "",
        "conversations": [{"from": "human", "value": "Add\n2 and 3"}, {"from": "gpt", "value": "5"}],
    },
    {
        "system": "",
        "tools": json.dumps([TOOL]),
        "conversations": [
            {"from": "human", "value": "Weather in Paris?"},
            {"from": "function_call", "value": json.dumps({"name": "get_weather", "arguments": {"city": "Paris"}})},
            {"from": "observation", "value": '{"temp": 20}'},
            {"from": "gpt", "value": "20 °C."},
        ],
    },
]
OPENAI = [
    {
        "tools": [],
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Add\n2 and 3"},
            {"role": "assistant", "content": "5"},
        ],
    },
    {
        "tools": [{"type": "function", "function": TOOL}],
        "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "c1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": '{"temp": 20}'},
            {"role": "assistant", "content": "20 °C."},
        ],
    },
]
BAD = {
    "alpaca": {"instruction": "no output here"},
    "sharegpt": {"conversations": [{"from": "bot", "value": "x"}]},
    "openai": {
        "messages": [
            {"role": "user", "content": "x"},
            {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{"}}]},
        ]
    },
}
BAD_WHAT = {"alpaca": 'no "output"', "sharegpt": "unknown \"from\" 'bot'", "openai": "arguments are not JSON"}
RECORDS = {"alpaca": (ALPACA, ALPACA_GLM), "sharegpt": (SHAREGPT, GLM), "openai": (OPENAI, GLM)}
# (format, file type): every format in JSONL, and every file type at least once.
CASES = [
    ("alpaca", "jsonl"),
    ("sharegpt", "jsonl"),
    ("openai", "jsonl"),
    ("sharegpt", "json"),
    ("openai", "parquet"),
    ("alpaca", "saved"),
]


def write(records: list, folder: Path, kind: str, name: str = "train") -> Path:
    if kind == "jsonl":
        path = folder / f"{name}.jsonl"
        path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    elif kind == "json":
        path = folder / f"{name}.json"
        path.write_text(json.dumps(records, ensure_ascii=False), encoding="utf-8")
    else:
        rows = datasets.Dataset.from_list(records)  # columns: the first record's keys (all records have them)
        path = folder / (f"{name}.parquet" if kind == "parquet" else name)
        rows.to_parquet(str(path)) if kind == "parquet" else rows.save_to_disk(str(path))
    return path


@pytest.mark.parametrize("fmt,kind", CASES, ids=[f"{f}-{k}" for f, k in CASES])
def test_each_format_and_file_type_encodes_as_its_glm_equivalent(fmt, kind, tok, tmp_path):
    records, reference = RECORDS[fmt]
    path = write(records, tmp_path, kind)
    assert [c.messages for c in read_conversations(path, fmt="auto")] == reference
    data = build_datasets(DataConfig(train_file=str(path), cache_dir=str(tmp_path / "cache"), max_length=400), tok)
    expected = [dict(zip(("input_ids", "labels"), encode_conversation(m, tok))) for m in reference]
    assert list(data.train) == expected


def test_detect_reads_each_format_from_one_record():
    assert [detect(r) for r in (ALPACA[0], SHAREGPT[0], OPENAI[1], {"messages": GLM[0]})] == [
        "alpaca",
        "sharegpt",
        "openai",
        "glm",
    ]
    parts = {
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
            {"role": "assistant", "content": "Hello."},
        ]
    }
    assert detect(parts) == "openai"
    assert read_conversations.__module__  # text parts are joined: checked through the mapping below
    from glmtune.data.formats import to_glm

    assert to_glm(parts, "openai")["messages"][0] == {"role": "user", "content": "Hi"}
    assert detect({"conversations": [{"role": "user", "content": "x"}]}) == "glm"  # ChatGLM3


@pytest.mark.parametrize("fmt,kind", CASES, ids=[f"{f}-{k}" for f, k in CASES])
def test_a_bad_record_in_each_is_one_line_naming_its_line_or_row(fmt, kind, tok, tmp_path):
    records = [*RECORDS[fmt][0], BAD[fmt]]
    path = write(records, tmp_path, kind)
    cfg = DataConfig(train_file=str(path), cache_dir=str(tmp_path / "cache"), format=fmt)
    message = str(pytest.raises(DataError, build_datasets, cfg, tok).value)
    where = f"{path}:3: " if kind == "jsonl" else f"{path}:row 2: "
    assert message.startswith(where) and BAD_WHAT[fmt] in message and " — " in message and "\n" not in message
    assert message == str(pytest.raises(DataError, read_conversations, path, fmt=fmt).value)


def test_openai_tool_turn_after_a_tool_less_first_record(tmp_path):
    """auto: a first record without tools reads as GLM messages, and a later OpenAI record is mapped as OpenAI
    (issue 35); data.format=glm stays strict and names the format to use."""
    path = write([{"messages": GLM[0]}, OPENAI[1]], tmp_path, "jsonl")
    assert [c.messages for c in read_conversations(path, fmt="auto")] == [GLM[0], GLM[1]]
    message = str(pytest.raises(DataError, read_conversations, path, fmt="glm").value)
    assert "data.format=openai" in message and f"{path}:2:" in message


def test_a_dataset_dict_folder_names_its_splits(tmp_path):
    rows = datasets.Dataset.from_list(ALPACA)
    datasets.DatasetDict(train=rows, test=rows).save_to_disk(str(tmp_path / "dd"))
    message = str(pytest.raises(DataError, read_conversations, tmp_path / "dd").value)
    assert "DatasetDict with splits train, test" in message and f"{tmp_path / 'dd'}/train" in message


@pytest.mark.slow
@pytest.mark.parametrize("fmt,kind", [("sharegpt", "json"), ("openai", "parquet"), ("alpaca", "saved")])
def test_cli_trains_from_each_file_type_and_refuses_a_bad_row(fmt, kind, tmp_path):
    records = RECORDS[fmt][0] * 3
    path = write(records, tmp_path, kind)
    args = [
        f"data.train_file={path}",
        "data.val_file=null",
        f"data.cache_dir={tmp_path / 'cache'}",
        "train.max_steps=2",
        "probe.enabled=false",
    ]
    proc = glmtune_in_process(*args, f"hydra.run.dir={tmp_path / 'run'}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (tmp_path / "run" / "adapter" / "adapter_model.safetensors").is_file()
    bad = write([*records, BAD[fmt]], tmp_path, kind, name="bad")
    proc = glmtune_in_process(*args[1:], f"data.train_file={bad}", f"hydra.run.dir={tmp_path / 'bad_run'}")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1].split("error: ")[-1].startswith(f"{bad}:row {len(records)}: ")
    assert not (tmp_path / "bad_run" / ".hydra").exists() and not (tmp_path / "bad_run" / "adapter").exists()
