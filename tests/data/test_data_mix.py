"""Several train files mixed by examples (data.mix), a val set held out of them (data.val_size), .json files of JSON
lines, and OpenAI records after a tool-less first record under data.format=auto (issue 35 item 3)."""

import json
from collections import Counter

import pytest
from helpers.cli import glmtune_in_process

from glmtune.config import DataConfig
from glmtune.data.mixing import mix_counts
from glmtune.data.pipeline import DataError, build_datasets, format_stats


def chat(word: str, i: int) -> dict:
    return {
        "messages": [
            {"role": "user", "content": f"{word} question {i}"},
            {"role": "assistant", "content": f"{word} answer {i}"},
        ]
    }


def write_jsonl(path, records) -> str:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    return str(path)


@pytest.fixture
def two_files(tmp_path):
    return (
        write_jsonl(tmp_path / "a.jsonl", [chat("alpha", i) for i in range(12)]),
        write_jsonl(tmp_path / "b.jsonl", [chat("beta", i) for i in range(8)]),
    )


def origins(split, tok) -> Counter:
    """Examples per (file word, index), read back from the encoded tokens."""
    found = Counter()
    for example in split:
        text = tok.decode(example["input_ids"])
        word = "alpha" if "alpha answer" in text else "beta"
        found[(word, int(text.split(f"{word} answer ")[1].split("<")[0]))] += 1
    return found


def test_two_files_mixed_3_to_1_give_15_and_5_examples(two_files, tok, tmp_path):
    """20 kept examples in all, shared 3:1: 15 from a (its 12, 3 of them twice) and 5 of b's 8."""
    cfg = DataConfig(train_file=list(two_files), mix=[3, 1], cache_dir=str(tmp_path / "cache"))
    data = build_datasets(cfg, tok, seed=7)
    found = origins(data.train, tok)
    per_file = Counter(word for (word, _), n in found.items() for _ in range(n))
    assert per_file == {"alpha": 15, "beta": 5} and len(data.train) == 20
    assert sorted(n for (w, _), n in found.items() if w == "alpha") == [1] * 9 + [2] * 3
    assert len([k for k in found if k[0] == "beta"]) == 5  # 5 different examples of b, none repeated
    assert origins(build_datasets(cfg, tok, seed=7).train, tok) == found  # the seed decides the draw
    assert any(origins(build_datasets(cfg, tok, seed=s).train, tok) != found for s in (8, 9, 10))
    table = format_stats(data.stats)
    rows = {line.split()[0]: line.split() for line in table.splitlines()}
    assert rows[two_files[0]][1:] == ["glm+openai", "12", "3", "15"] and rows[two_files[1]][1:] == [
        "glm+openai",
        "8",
        "1",
        "5",
    ]
    # without data.mix, every example of every file once
    plain = build_datasets(DataConfig(train_file=list(two_files), cache_dir=str(tmp_path / "cache")), tok)
    assert len(plain.train) == 20 and set(origins(plain.train, tok).values()) == {1}


def test_mix_counts_are_exact_by_largest_remainder():
    assert mix_counts([12, 8], [3, 1]) == [15, 5]
    assert mix_counts([10, 10, 10], [1, 1, 1]) == [10, 10, 10]
    assert mix_counts([5, 5], [2, 1]) == [7, 3] and sum(mix_counts([7, 4, 2], [0.5, 0.3, 0.2])) == 13


def test_huge_equal_weights_are_an_even_mix_of_every_example(two_files, tok, tmp_path):
    """data.mix=[1e308,1e308]: their sum overflows to inf, which made every share 0 (2 examples trained of 20)."""
    cfg = DataConfig(train_file=list(two_files), mix=[1e308, 1e308], cache_dir=str(tmp_path / "cache"))
    assert len(build_datasets(cfg, tok, seed=7).train) == 20
    assert mix_counts([12, 8], [1e308, 1e308]) == mix_counts([12, 8], [1, 1]) == [10, 10]


def test_val_size_splits_reproducibly_by_seed(two_files, tok, tmp_path):
    cfg = DataConfig(train_file=list(two_files), val_size=0.1, cache_dir=str(tmp_path / "cache"))
    data = build_datasets(cfg, tok, seed=1)
    held, trained = origins(data.val, tok), origins(data.train, tok)
    assert sum(held.values()) == 2 and sum(trained.values()) == 18 and not set(held) & set(trained)
    assert origins(build_datasets(cfg, tok, seed=1).val, tok) == held
    assert any(origins(build_datasets(cfg, tok, seed=s).val, tok) != held for s in (2, 3, 4))
    assert data.stats.val.examples == 2 and "in val (val_size=0.1)" in format_stats(data.stats)
    # a count, from one file
    one = build_datasets(DataConfig(train_file=two_files[0], val_size=3, cache_dir=str(tmp_path / "cache")), tok)
    assert (len(one.train), len(one.val)) == (9, 3)
    with pytest.raises(DataError, match="leaving none to train on"):
        build_datasets(DataConfig(train_file=two_files[1], val_size=8, cache_dir=str(tmp_path / "cache")), tok)


def test_json_lines_in_a_json_file_and_errors_name_the_file_and_line(two_files, tok, tmp_path):
    lines = tmp_path / "c.json"  # JSON lines in a .json file, as HF datasets, LLaMA-Factory and axolotl read it
    lines.write_text("".join(json.dumps(chat("gamma", i)) + "\n" for i in range(3)))
    data = build_datasets(DataConfig(train_file=[two_files[0], str(lines)], cache_dir=str(tmp_path / "cache")), tok)
    assert len(data.train) == 15
    alone = build_datasets(DataConfig(train_file=str(lines), cache_dir=str(tmp_path / "cache")), tok)
    assert [str(lines), "glm+openai", "3", "3"] in [row.split() for row in format_stats(alone.stats).splitlines()]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(chat("gamma", 0)) + "\n\n" + json.dumps({"messages": [{"role": "bot"}]}) + "\n")
    cfg = DataConfig(train_file=[two_files[0], str(bad)], cache_dir=str(tmp_path / "cache"))
    message = str(pytest.raises(DataError, build_datasets, cfg, tok).value)
    assert message.startswith(f"{bad}:3: messages[0] has unknown role 'bot'") and "\n" not in message
    array = tmp_path / "d.json"  # a JSON list still names rows
    array.write_text(json.dumps([chat("delta", 0), {"messages": []}]))
    message = str(pytest.raises(DataError, build_datasets, DataConfig(train_file=str(array)), tok).value)
    assert message.startswith(f"{array}:row 1: ")


OPENAI = [
    {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello."},
        ]
    },
    {
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
            {"role": "tool", "tool_call_id": "c1", "content": '{"t": 21}'},
            {"role": "assistant", "content": "21 degrees."},
        ],
        "tools": [
            {
                "type": "function",
                "function": {
                    "name": "get_weather",
                    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
                },
            }
        ],
    },
]


def test_cli_trains_on_a_json_lines_file_and_a_tool_less_openai_file_mixed_3_to_1(tmp_path):
    """A real tiny training: 12 + 4 kept examples, 2 held out for val, the other 14 shared 3:1 (10.5 : 3.5, the
    remainder to the first file): 11 + 3 trained, so one epoch at batch 1 is 14 steps. The OpenAI file's first
    record has no tools: auto reads it as GLM messages with OpenAI records mapped."""
    lines = tmp_path / "chats.json"
    lines.write_text("".join(json.dumps(chat("alpha", i)) + "\n" for i in range(12)))
    openai = write_jsonl(tmp_path / "openai.jsonl", OPENAI * 2)
    run = tmp_path / "run"
    proc = glmtune_in_process(
        f"data.train_file=[{lines},{openai}]",
        "data.mix=[3,1]",
        "data.val_file=null",
        "data.val_size=2",
        "data.format=auto",
        "train.num_epochs=1",
        "probe.enabled=false",
        "train.per_device_batch_size=1",
        "data.packing=off",
        "eval.generate=true",
        "eval.max_new_tokens=4",
        f"hydra.run.dir={run}",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["steps"] == 14 and "eval_loss" in metrics
    out = proc.stdout + proc.stderr
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.strip()}
    assert rows[str(lines)][1:] == ["glm+openai", "12", "3", "11", *rows[str(lines)][5:]]
    assert rows[openai][1:4] == ["glm+openai", "4", "1"] and int(rows[str(lines)][5]) + int(rows[openai][5]) == 2
    assert int(rows[str(lines)][4]) + int(rows[openai][4]) == 14
    # eval.generate re-reads the 2 held-out conversations from the train files: one reply per assistant turn
    predictions = [
        json.loads(line)
        for path in (run / "eval").glob("eval_predictions_step*.jsonl")
        for line in path.read_text().splitlines()
    ]
    references = {chat("alpha", i)["messages"][1]["content"] for i in range(12)} | {
        "Hello.",
        "21 degrees.",
        'get_weather\n{"city": "Paris"}',
    }
    assert len(predictions) >= 2 and {p["reference"] for p in predictions} <= references


def test_bad_mix_and_val_settings_exit_2_in_one_line(two_files, tmp_path):
    cases = [
        (["data.mix=[3,1]"], "needs one weight per data.train_file entry"),
        ([f"data.train_file=[{two_files[0]},{two_files[1]}]", "data.mix=[3,0]"], "must be > 0"),
        # a val file given and a val set held out (the bundled val file steps aside by itself: test_config.py)
        (["data.val_file=data/samples/val.jsonl", "data.val_size=0.1"], "not both"),
        (["data.val_file=null", "data.val_size=1.5"], "a whole number of examples"),
        ([f"data.train_file=[{two_files[0]},{two_files[0]}]"], "lists a file twice"),
        (
            [f"data.train_file=[{two_files[0]},{two_files[1]}]", "data.mix=[inf,1]"],
            "data.mix[0] must be a finite number, got inf",
        ),
        (
            [f"data.train_file=[{two_files[0]},{two_files[1]}]", "data.mix=[1,nan]"],
            "data.mix[1] must be a finite number, got nan",
        ),
    ]
    for args, expected in cases:
        proc = glmtune_in_process("mode=plan", *args)
        assert proc.returncode == 2 and expected in proc.stderr and "Traceback" not in proc.stderr, (args, proc.stderr)
        assert proc.stderr.count("\n") == 1, proc.stderr  # numpy's warnings for inf/nan weights are gone too
