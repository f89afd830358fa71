"""The tokenized-data cache: what changes the key rebuilds, what does not reuses, errors keep file and line through
the workers, two builders at once leave one valid entry, and GLM-4V images are checked once and decoded late."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pyarrow as pa
import pytest
from helpers import REPO

from glmtune.config import DataConfig
from glmtune.data.pipeline import DataCollator, DataError, build_datasets, encode_conversation
from glmtune.data.validate import read_conversations
from glmtune.models.chatglm.configuration import released_config
from glmtune.models.tokenizer_files import load_tokenizer, write_tiny_tokenizer


def conv(i: int) -> list:
    return [
        {"role": "user", "content": f"Question number {i}: what is {i} + {i}?"},
        {"role": "assistant", "content": f"The answer is {2 * i}. " * (1 + i % 5)},
    ]


def write(path: Path, conversations, blank_every: int = 0) -> Path:
    lines = []
    for i, c in enumerate(conversations):
        lines.append(json.dumps({"messages": c}, ensure_ascii=False))
        if blank_every and i % blank_every == 0:
            lines.append("   ")  # blank lines are skipped but still count in line numbers
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def entries(cache: Path) -> list[Path]:
    return sorted(p for p in cache.iterdir() if p.is_dir())


def test_unchanged_input_reuses_the_entry_and_each_key_part_rebuilds(tok, tmp_path):
    data = write(tmp_path / "train.jsonl", [conv(i) for i in range(30)])
    cache = tmp_path / "cache"
    cfg = DataConfig(train_file=str(data), max_length=64, cache_dir=str(cache))
    first = build_datasets(cfg, tok)
    assert first.train.built and len(entries(cache)) == 1
    expected = [
        dict(zip(("input_ids", "labels"), (ids[:64], labels[:64])))
        for ids, labels in (encode_conversation(c, tok) for c in (conv(i) for i in range(30)))
    ]
    assert list(first.train) == expected  # the cache holds exactly what the encoder produces

    before = pa.total_allocated_bytes()
    again = build_datasets(cfg, tok)
    assert not again.train.built and again.train.path == first.train.path
    assert list(again.train) == expected and again.stats == first.stats
    assert pa.total_allocated_bytes() - before < 64_000  # memory-mapped: the rows were not copied into the heap

    write(data, [conv(i) for i in range(31)])  # changed file
    changed = build_datasets(cfg, tok)
    assert changed.train.built and len(changed.train) == 31 and len(entries(cache)) == 2

    shorter = build_datasets(DataConfig(train_file=str(data), max_length=32, cache_dir=str(cache)), tok)
    assert shorter.train.built and max(len(ex["input_ids"]) for ex in shorter.train) == 32
    assert len(entries(cache)) == 3

    other_folder = tmp_path / "tok_other"
    write_tiny_tokenizer(other_folder, "glm4")
    config = json.loads((other_folder / "tokenizer_config.json").read_text())
    config["chat_template"] = "你是一个名为 OtherName 的人工智能助手"  # same vocabulary, other tokenizer files
    (other_folder / "tokenizer_config.json").write_text(json.dumps(config))
    retokenized = build_datasets(cfg, load_tokenizer(other_folder))
    assert retokenized.train.built and len(entries(cache)) == 4
    assert not build_datasets(cfg, tok).train.built  # and every old entry is still there to be found
    assert not [p for p in cache.iterdir() if ".tmp-" in p.name]


@pytest.mark.parametrize("num_proc", [1, 2])
def test_bad_lines_report_file_and_line_from_the_workers(tok, tmp_path, num_proc):
    """Line numbers count blank lines and survive the split into worker shards: the same message as plain
    validation, first bad line and the others."""
    rows = [json.dumps({"messages": c}) for c in (conv(i) for i in range(40))]
    rows[33] = '{"messages": [}'  # in the second worker's half
    rows[36] = json.dumps({"messages": [{"role": "bot", "content": "x"}]})
    data = tmp_path / "bad.jsonl"
    data.write_text("\n".join(rows[:5] + ["", ""] + rows[5:]) + "\n", encoding="utf-8")  # 2 blank lines at 6, 7
    cache = tmp_path / "cache"
    cfg = DataConfig(train_file=str(data), cache_dir=str(cache), num_proc=num_proc)
    message = str(pytest.raises(DataError, build_datasets, cfg, tok).value)
    assert message.startswith(f"{data}:36: invalid JSON: ") and "(column 15) — " in message
    assert message.endswith("(… and 1 more bad line: 39)")
    assert message == str(pytest.raises(DataError, read_conversations, data).value)
    assert entries(cache) == []  # nothing half-built is left to be found
    # A later launch checks again (the error file only informs the processes that waited on the builder).
    assert str(pytest.raises(DataError, build_datasets, cfg, tok).value) == message


BUILDER = textwrap.dedent("""
    import json, logging, sys, time
    from pathlib import Path
    logging.basicConfig(level=logging.INFO)  # the cache's "waiting for ..." line, as Hydra's logging shows it
    from glmtune.config import DataConfig
    from glmtune.data.pipeline import build_datasets
    from glmtune.models.tokenizer_files import load_tokenizer
    data, cache, tok, me, other = sys.argv[1:]
    tokenizer = load_tokenizer(tok)
    Path(me).touch()
    while not Path(other).exists():  # start building within a few ms of the other process
        time.sleep(0.005)
    split = build_datasets(DataConfig(train_file=data, cache_dir=cache, num_proc=1), tokenizer).train
    print(json.dumps({"built": split.built, "path": str(split.path), "rows": [split[i] for i in (0, -1)],
                      "n": len(split)}))
""")


@pytest.mark.slow
def test_two_simultaneous_builders_leave_one_valid_entry(tok, tmp_path):
    data = write(tmp_path / "train.jsonl", [conv(i) for i in range(3000)], blank_every=7)
    tok_dir = tmp_path / "tok"
    write_tiny_tokenizer(tok_dir, "glm4")
    cache = tmp_path / "cache"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                BUILDER,
                str(data),
                str(cache),
                str(tok_dir),
                str(tmp_path / f"ready{i}"),
                str(tmp_path / f"ready{1 - i}"),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for i in (0, 1)
    ]
    results = [p.communicate(timeout=600) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err[-2000:] for _, err in results]
    outs = [json.loads(out.strip().splitlines()[-1]) for out, _ in results]
    assert sorted(o["built"] for o in outs) == [False, True]  # one built it, the other one waited and opened it
    waiter = results[[o["built"] for o in outs].index(False)][1]
    assert "waiting for another process building" in waiter  # they really overlapped
    assert outs[0]["path"] == outs[1]["path"] and outs[0]["rows"] == outs[1]["rows"] and outs[0]["n"] == 3000
    assert [p.name for p in entries(cache)] == [Path(outs[0]["path"]).name]
    assert not [p for p in cache.iterdir() if ".tmp-" in p.name or p.suffix == ".error"]
    fresh = build_datasets(DataConfig(train_file=str(data), cache_dir=str(cache)), load_tokenizer(tok_dir)).train
    assert not fresh.built and fresh[0] == outs[0]["rows"][0] and fresh[len(fresh) - 1] == outs[0]["rows"][1]


def test_images_are_checked_once_and_decoded_in_the_collator(tok, tmp_path):
    from PIL import Image

    Image.new("RGB", (16, 16), (200, 30, 30)).save(tmp_path / "red.png")
    rows = [
        [{"role": "user", "content": "What colour?", "image": "red.png"}, {"role": "assistant", "content": "Red."}],
        conv(1),
    ]
    data = write(tmp_path / "vision.jsonl", rows)
    vision = released_config("glm4v_9b").vision_config
    cfg = DataConfig(train_file=str(data), cache_dir=str(tmp_path / "cache"))
    first = build_datasets(cfg, tok, vision)
    assert first.train[0]["image"] == str((tmp_path / "red.png").resolve()) and "image" not in first.train[1]
    assert first.stats.train.images == 1
    (tmp_path / "red.png").unlink()  # gone after validation: the cached launch does not look at images again...
    cached = build_datasets(cfg, tok, vision)
    assert not cached.train.built and cached.train[0]["image"] == first.train[0]["image"]
    collator = DataCollator(tok.pad_token_id, image_size=32)
    assert "images" not in collator([cached.train[1]])
    with pytest.raises(DataError, match=r"red\.png: image cannot be read"):  # ...the collator reads it, late
        collator([cached.train[0]])
    # A text model is another key: it checks the file and refuses the image with the line number.
    with pytest.raises(DataError, match=r"vision\.jsonl:1: image not found"):
        build_datasets(cfg, tok, None)
