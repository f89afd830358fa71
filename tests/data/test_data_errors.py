"""Every malformed data file gives ONE DataError line `<file>:<line>: <what> — <what to do>`.

Each case is checked in-process (`read_conversations` / `validate_files`), where it must raise a DataError.
The command line turns every DataError into exit 2 the same way, so a representative few (file-level,
bytes, JSON, conversation structure, the validation file) also run through the command line's entry point
(`glmtune data.train_file=...`, in this process: conftest.glmtune_in_process): exit 2, the same `file:line` on
stderr, no traceback, and an existing run dir left alone.
"""

import importlib.util
import json
from pathlib import Path
from typing import NamedTuple, Optional

import pytest
from helpers import REPO
from helpers.cli import glmtune_in_process

from glmtune.config import ConfigError, DataConfig
from glmtune.data.validate import DataError, read_conversations, validate_files

GOOD = json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]})


def line(*messages, key="messages", **extra) -> str:
    return json.dumps({key: list(messages), **extra}, ensure_ascii=False)


def user(content="hi", **extra):
    return {"role": "user", "content": content, **extra}


def reply(content="hello", **extra):
    return {"role": "assistant", "content": content, **extra}


class Case(NamedTuple):
    name: str
    content: Optional[bytes]  # None: the file does not exist
    line: Optional[int]  # expected line number in the message; None for file-level problems
    fragments: tuple[str, ...]  # must all appear in the message


def after_good(bad: str) -> bytes:
    """A valid line 1, then the bad line 2: the reported line number must be 2."""
    return (GOOD + "\n" + bad + "\n").encode("utf-8")


GBK_LINE = b'{"messages": [{"role": "user", "content": "\xc4\xe3\xba\xc3"}]}'  # "你好" saved as GBK
GBK_OFFSET = len(GOOD) + 1 + GBK_LINE.index(b"\xc4")  # byte offset of the first bad byte in the file

CASES = [
    Case("missing_file", None, None, ("file not found", "data.train_file")),
    Case("empty_file", b"", 1, ("no conversations",)),
    Case("blank_lines_only", b"\n   \n\n", 1, ("no conversations",)),
    Case(
        "not_utf8",
        (GOOD + "\n").encode() + GBK_LINE + b"\n",
        2,
        ("not valid UTF-8", f"byte offset {GBK_OFFSET}", "0xc4", "re-save"),
    ),
    Case("invalid_json", after_good('{"messages": [}'), 2, ("invalid JSON", "column 15")),
    Case("truncated_json", after_good('{"messages": [{"role": "user"'), 2, ("invalid JSON",)),
    Case("line_not_object", after_good("[1, 2]"), 2, ("line is a list, not an object",)),
    Case("missing_messages", after_good('{"msgs": []}'), 2, ('no "messages" list', "'msgs'")),
    Case("empty_messages", after_good('{"messages": []}'), 2, ('"messages" is empty',)),
    Case("messages_not_list", after_good('{"messages": "hi"}'), 2, ('"messages" is a string',)),
    Case("message_not_object", after_good('{"messages": ["hi"]}'), 2, ("messages[0] is a string, not an object",)),
    Case(
        "unknown_role",
        after_good(line(user(), {"role": "bot", "content": "x"})),
        2,
        ("messages[1] has unknown role 'bot'", "system, user, assistant, observation"),
    ),
    Case("missing_role", after_good(line({"content": "x"}, reply())), 2, ("messages[0] has no role",)),
    Case("non_string_content", after_good(line(user(42), reply())), 2, ("content is a number, not a string",)),
    Case("missing_content", after_good(line({"role": "user"}, reply())), 2, ('has no "content"',)),
    Case(
        "non_string_metadata",
        after_good(line(user(), reply(metadata={"a": 1}))),
        2,
        ("metadata is an object, not a string",),
    ),
    Case(
        "tools_not_list",
        after_good(line({"role": "system", "content": "", "tools": {"type": "function"}}, user(), reply())),
        2,
        ("tools is an object, not a list",),
    ),
    Case(
        "tools_on_user",
        after_good(line(user(tools=[]), reply())),
        2,
        ('messages[0] (user) has "tools"', "system message"),
    ),
    Case(
        "tool_without_name",
        after_good(
            line(
                {"role": "system", "content": "", "tools": [{"type": "function", "function": {"description": "x"}}]},
                user(),
                reply(),
            )
        ),
        2,
        ("tools[0] has no function name",),
    ),
    Case("no_assistant", after_good(line(user())), 2, ("no assistant message",)),
    Case("empty_assistant", after_good(line(user(), reply(""))), 2, ("no assistant message with non-empty content",)),
    Case(
        "conversations_alias_bad_role",
        after_good(line({"role": "tool", "content": "x"}, reply(), key="conversations")),
        2,
        ("conversations[0] has unknown role 'tool'",),
    ),
    Case("top_level_tools", after_good(line(user(), reply(), tools=[])), 2, ('top-level "tools"',)),
]


def write_case(case: Case, folder: Path) -> Path:
    path = folder / f"{case.name}.jsonl"
    if case.content is not None:
        path.write_bytes(case.content)
    return path


def check_message(message: str, path: Path, case: Case) -> None:
    assert "\n" not in message  # one line
    assert " — " in message  # what is wrong — what to do
    prefix = f"{path}:{case.line}:" if case.line is not None else f"{path}:"
    assert prefix in message, message
    for fragment in case.fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_file_raises_one_line_data_error(case, tmp_path):
    path = write_case(case, tmp_path)
    with pytest.raises(DataError) as err:
        read_conversations(path)
    check_message(str(err.value), path, case)
    assert isinstance(err.value, ConfigError)  # so the launcher reports it like a config error (exit 2)


def test_missing_validation_file_names_the_key(tmp_path):
    train = tmp_path / "train.jsonl"
    train.write_text(GOOD + "\n")
    missing = tmp_path / "dev.jsonl"
    with pytest.raises(DataError) as err:
        validate_files(DataConfig(train_file=str(train), val_file=str(missing)))
    message = str(err.value)
    assert message.startswith(f"{missing}: validation file not found — ") and "data.val_file=null" in message


def test_relative_missing_path_names_the_launch_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(DataError, match="relative to the launch directory"):
        read_conversations("nowhere.jsonl")


def test_all_bad_lines_are_counted_in_the_same_line(tmp_path):
    bad = [GOOD, "{oops", GOOD, "[]", '{"messages": []}', GOOD, line(user()), "", "{"]
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(bad) + "\n")
    message = str(pytest.raises(DataError, read_conversations, path).value)
    assert message.startswith(f"{path}:2: invalid JSON")
    assert message.endswith("(… and 4 more bad lines: 4, 5, 7, 9)") and "\n" not in message


def test_many_bad_lines_list_only_the_first_few(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(["{"] * 12) + "\n")
    message = str(pytest.raises(DataError, read_conversations, path).value)
    assert message.endswith("(… and 11 more bad lines: 2, 3, 4, 5, 6, …)")


def test_blank_lines_bom_crlf_metadata_and_alias_are_accepted(tmp_path):
    path = tmp_path / "ok.jsonl"
    rows = [
        GOOD,
        "",
        "   ",
        line(user(), reply("call", metadata="get_weather")),
        line(
            {"role": "system", "content": "", "tools": [{"type": "function", "function": {"name": "f"}}]},
            user(),
            reply(),
            key="conversations",
        ),
    ]
    path.write_bytes(b"\xef\xbb\xbf" + "\r\n".join(rows).encode("utf-8") + b"\r\n")
    conversations = read_conversations(path)
    assert [c.line for c in conversations] == [1, 4, 5]
    assert conversations[2].messages[0]["tools"][0]["function"]["name"] == "f"


def test_shipped_sample_files_validate():
    for name in ("train.jsonl", "val.jsonl", "chatglm3_train.jsonl"):
        assert read_conversations(REPO / "data" / "samples" / name)


# --- the same cases through `python -m glmtune` -------------------------------------------------------

HAS_CLI = importlib.util.find_spec("glmtune.__main__") is not None
CLI_CASES = [
    *(c for c in CASES if c.name in ("missing_file", "not_utf8", "invalid_json", "no_assistant")),
    Case("missing_val_file", None, None, ("validation file not found", "data.val_file")),
]


class CliResult(NamedTuple):
    returncode: int
    stderr: str
    data_file: Path
    keep_file: Path


def _run_cli(case: Case, folder: Path) -> CliResult:
    folder.mkdir()
    run_dir = folder / "run"
    run_dir.mkdir()
    keep = run_dir / "keep.txt"
    keep.write_text("from an earlier run\n")
    if case.name == "missing_val_file":
        train = folder / "train.jsonl"
        train.write_text(GOOD + "\n")
        data_file = folder / "dev.jsonl"
        data_args = [f"data.train_file={train}", f"data.val_file={data_file}"]
    else:
        data_file = write_case(case, folder)
        data_args = [f"data.train_file={data_file}", "data.val_file=null"]
    proc = glmtune_in_process(*data_args, f"hydra.run.dir={run_dir}", cwd=REPO)
    return CliResult(proc.returncode, proc.stderr, data_file, keep)


@pytest.fixture(scope="module")
def cli_results(tmp_path_factory) -> dict[str, CliResult]:
    root = tmp_path_factory.mktemp("cli")
    return {case.name: _run_cli(case, root / case.name) for case in CLI_CASES}


@pytest.mark.skipif(not HAS_CLI, reason="the launcher (glmtune/__main__.py) is not wired yet")
@pytest.mark.parametrize("case", CLI_CASES, ids=[c.name for c in CLI_CASES])
def test_cli_exits_2_with_file_and_line(case, cli_results):
    result = cli_results[case.name]
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    check_message(result.stderr.strip().splitlines()[-1], result.data_file, case)
    assert result.keep_file.read_text() == "from an earlier run\n"  # an earlier run's files are left alone
