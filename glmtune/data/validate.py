"""Check every line of the training and validation files before any weights load.

A bad line found after a 9B model has loaded (minutes) or inside a DataLoader worker (a traceback per
rank) is expensive; here it costs a file read. Each problem becomes ONE line for the user:

    data/train.jsonl:12: messages[2] has unknown role 'bot' — use one of: system, user, assistant, observation …

Every line of a file is checked, so the message also says how many more lines are bad and which.
The format is the official GLM-4 fine-tune format, one JSON object per line:
    {"messages": [{"role": "system"|"user"|"assistant"|"observation", "content": "...",
                   "metadata": "..." (optional), "tools": [...] (system only)}, ...]}
ChatGLM3's `conversations` key is accepted as an alias of `messages`. Other tools' formats (alpaca, ShareGPT,
OpenAI chat) are mapped onto these messages first (formats.py), and .json, Parquet and saved `datasets` folders
are read as records (sources.py); their errors name the row (`train.parquet:row 3: ...`).
GLM-4V: the first user message may carry `"image": "<path>"` (one image per conversation, as the official
script); a relative path is relative to the data file's folder. Every image must exist and open as an image.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, NamedTuple

from ..config import SAMPLE_SETS, ConfigError, DataConfig, train_files
from .formats import detect, to_glm
from .images import image_problem
from .messages import check_message, kind
from .sources import DataError, is_rows, is_saved_dataset, records

MESSAGE_KEYS = ("messages", "conversations")  # GLM-4 name first, then the ChatGLM3 alias
_SHOWN_LINES = 5  # how many further bad line numbers the one-line message lists
_UTF8_BOM = b"\xef\xbb\xbf"  # written by some Windows editors; harmless, so it is skipped
# data.format=auto on a file whose first record is GLM messages: each record read as GLM, or as OpenAI chat when it
# has what only OpenAI chat has (tool_calls, a tool turn, top-level tools, content parts: formats.detect).
GLM_OR_OPENAI = "glm+openai"


class Conversation(NamedTuple):
    line: int  # 1-based line number in the file, for messages about this example later on
    messages: list[dict[str, Any]]


class _Problem(NamedTuple):
    line: int
    what: str
    fix: str


# The bundled sample sets: data/samples*/ at the top of a source checkout, glmtune/data/samples*/ inside a wheel
# (pyproject.toml maps them there), so an installed glmtune finds them from any folder.
_HERE = Path(__file__).resolve().parent
SHIPPED = _HERE if (_HERE / "samples").is_dir() else _HERE.parents[1] / "data"


def locate(path: str | Path) -> Path:
    """A data path as written, except that `data/samples/...` and `data/samples_vision/...` fall back to the
    copies shipped inside glmtune when the launch directory has no such file (e.g. `pip install .`, then
    glmtune from any folder). A file of the user's at that path always wins."""
    given = Path(path).expanduser()
    parts = given.parts
    if (
        not given.exists()
        and not given.is_absolute()
        and len(parts) > 2
        and parts[0] == "data"
        and parts[1] in SAMPLE_SETS
        and SHIPPED.joinpath(*parts[1:]).exists()
    ):
        return SHIPPED.joinpath(*parts[1:])
    return given


def validate_files(cfg: DataConfig) -> None:
    """Read and check the train files and, when set, the validation file; raise DataError on the first bad one."""
    for path in train_files(cfg):
        read_conversations(path, "data.train_file", fmt=cfg.format)
    if cfg.val_file is not None:
        read_conversations(cfg.val_file, "data.val_file")


def read_conversations(
    path: str | Path, key: str = "data.train_file", prompts: bool = False, fmt: str = "glm"
) -> list[Conversation]:
    """All conversations of a JSONL file, or DataError naming the first bad line and counting the others.

    `key` is the config key that named the file, so the message can say what to change. `prompts=True`
    reads generation prompts: they end on a user or observation turn instead of containing a reply.
    fmt: data.format (auto = detected from the file's first record).
    """
    shown = str(path)  # as the user wrote it in the config, which is what they will recognise
    path = locate(path)
    raw = _read_bytes(path, shown, key)
    fmt = file_format(fmt, path, shown, raw)
    conversations: list[Conversation] = []
    problems: list[_Problem] = []
    for line_no, line_start, raw_line in records(path, shown, raw):
        result = check_line(raw_line, line_no, line_start, Path(path).parent, prompts, fmt)
        if isinstance(result, _Problem):
            problems.append(result)
        elif result is not None:
            conversations.append(Conversation(line_no, result))
    if problems:
        raise DataError(_one_line(shown, problems, is_rows(path)))
    if not conversations:
        raise DataError(no_conversations(shown, key))
    return conversations


def file_format(fmt: str, path: Path, shown: str, raw: bytes | None) -> str:
    """data.format for this file: as set, or (auto) the format of its first record that parses as an object.
    auto on a GLM-looking first record gives GLM_OR_OPENAI: OpenAI chat without tools is GLM messages already,
    so an OpenAI file is told apart only at its first tool call, which may be on any line."""
    if fmt != "auto":
        return fmt
    for _, _, raw_line in records(path, shown, raw):
        try:
            found = detect(json.loads(raw_line.decode("utf-8-sig")))
        except (UnicodeDecodeError, ValueError, RecursionError):
            continue
        if found is not None:
            return GLM_OR_OPENAI if found == "glm" else found
    return "glm"  # nothing recognisable: the GLM checks name what is wrong


def no_conversations(shown: str, key: str) -> str:
    return (
        f'{shown}:1: file has no conversations — write one {{"messages": [...]}} JSON object per line, or '
        f"point {key} at another file"
    )


def check_line(
    raw_line: bytes, line_no: int, line_start: int, folder: Path, prompts: bool = False, fmt: str = "glm"
) -> list[dict[str, Any]] | _Problem | None:
    """One line of a file (without its newline): its messages, the problem with it, or None when blank.

    line_start is the byte offset of the line in the file (for the UTF-8 message); folder is the data file's,
    which relative image paths are relative to. The Arrow cache (cache.py) calls this per line in its workers."""
    if line_no == 1 and raw_line.startswith(_UTF8_BOM):
        raw_line, line_start = raw_line[len(_UTF8_BOM) :], line_start + len(_UTF8_BOM)
    try:
        text = raw_line.decode("utf-8")
    except UnicodeDecodeError as err:
        bad_byte = raw_line[err.start]
        return _Problem(
            line_no,
            f"not valid UTF-8 (byte 0x{bad_byte:02x} at byte offset {line_start + err.start} of the file)",
            "re-save the file as UTF-8, e.g. `iconv -f GBK -t UTF-8`",
        )
    if not text.strip():
        return None  # blank lines (and the newline at the end of the file) are allowed
    result = _parse_line(text, line_no, prompts, fmt)
    if not isinstance(result, _Problem):
        result = _resolve_image(result, folder, line_no)
    return result


def check_file(path: str | Path, key: str) -> None:
    """The checks `_read_bytes` makes before reading (exists, a regular file), for every data file at once:
    a missing val file then stops the run before the train file's cache is built (and its progress bars
    printed)."""
    _check_path(locate(path), str(path), key)


def _read_bytes(path: Path, shown: str, key: str) -> bytes | None:
    """The file's bytes (None for a saved dataset folder, read by sources.records)."""
    _check_path(path, shown, key)
    if path.is_dir():
        return None
    try:
        return path.read_bytes()
    except OSError as err:
        raise DataError(f"{shown}: cannot read ({err.strerror or err}) — check the file's permissions") from None


def _check_path(path: Path, shown: str, key: str) -> None:
    if not path.exists():
        where = "" if path.is_absolute() else f" (relative to the launch directory {Path.cwd()})"
        what = "validation file not found" if key == "data.val_file" else "file not found"
        fix = f"fix {key}{where}"
        if key == "data.val_file":
            fix += ", or set data.val_file=null to train without evaluation"
        raise DataError(f"{shown}: {what} — {fix}")
    if path.is_dir() and not is_saved_dataset(path):
        raise DataError(
            f"{shown}: is a directory but not a saved dataset (no state.json) — point {key} at a "
            ".jsonl, .json or .parquet file or a datasets save_to_disk folder"
        )
    if not path.is_file() and not path.is_dir():  # a FIFO or device: reading it would block or never end
        raise DataError(f"{shown}: not a regular file (a FIFO, socket or device) — point {key} at a .jsonl file")


def _one_line(shown: str, problems: list[_Problem], rows: bool = False) -> str:
    first, rest = problems[0], problems[1:]
    message = f"{shown}:{'row ' if rows else ''}{first.line}: {first.what} — {first.fix}"
    if rest:
        lines = ", ".join(str(p.line) for p in rest[:_SHOWN_LINES]) + (", …" if len(rest) > _SHOWN_LINES else "")
        plural = ("row" if rows else "line") + ("" if len(rest) == 1 else "s")
        message += f" (… and {len(rest)} more bad {plural}: {lines})"
    return message


def _parse_line(text: str, line_no: int, prompts: bool = False, fmt: str = "glm") -> list[dict[str, Any]] | _Problem:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as err:
        return _Problem(
            line_no,
            f"invalid JSON: {err.msg} (column {err.colno})",
            "each line must be one complete JSON object; check quotes, commas and brackets",
        )
    except RecursionError:  # Python's parser recurses once per nesting level
        return _Problem(
            line_no,
            "JSON nested too deeply to parse",
            'a conversation needs only a few levels: {"messages": [{"role": ..., "content": ...}]}',
        )
    if not isinstance(obj, dict):
        return _Problem(line_no, f"line is {kind(obj)}, not an object", 'write one {"messages": [...]} object per line')
    if fmt == GLM_OR_OPENAI:
        fmt = "openai" if detect(obj) == "openai" else "glm"
    if fmt != "glm":
        obj = to_glm(obj, fmt)
        if isinstance(obj, tuple):
            return _Problem(line_no, *obj)
    key = next((k for k in MESSAGE_KEYS if k in obj), None)
    if key is None:
        found = ", ".join(repr(k) for k in list(obj)[:5]) or "none"
        return _Problem(
            line_no,
            f'no "messages" list (keys found: {found})',
            'put the conversation under "messages" (or ChatGLM3\'s "conversations")',
        )
    messages = obj[key]
    if not isinstance(messages, list) or not messages:
        got = "empty" if isinstance(messages, list) else kind(messages)
        return _Problem(line_no, f'"{key}" is {got}', f'make "{key}" a non-empty list of messages')
    if "tools" in obj:  # ChatGLM3's top-level tools: its own demo refuses them too
        return _Problem(
            line_no,
            'top-level "tools" is not supported',
            'move the tools list onto the system message: {"role": "system", "content": "", '
            '"tools": [...]}, or set data.format=openai for OpenAI chat records',
        )
    for index, message in enumerate(messages):
        problem = check_message(message, f"{key}[{index}]")
        if problem is not None:
            return _Problem(line_no, *problem)
    with_image = [i for i, m in enumerate(messages) if "image" in m]
    first_user = next(i for i, m in enumerate(messages) if m["role"] == "user") if with_image else None
    if with_image and with_image != [first_user]:
        late = next(i for i in with_image if i != first_user)
        return _Problem(
            line_no,
            f'{key}[{late}] has an "image", but only the first user message may carry one '
            "(GLM-4V takes one image per conversation)",
            "move the image to the first user message, or split the conversation",
        )
    if prompts:
        # A final assistant message is the reference answer, written beside the prediction.
        asked = messages[:-1] if messages[-1]["role"] == "assistant" else messages
        if not asked or asked[-1]["role"] not in ("user", "observation"):
            return _Problem(
                line_no,
                f'the prompt ends on a "{messages[-1]["role"]}" message',
                "end each prompt on the user (or observation) turn the model should answer, "
                "optionally followed by one assistant message: the reference answer",
            )
    elif not any(m["role"] == "assistant" and m["content"] for m in messages):
        return _Problem(
            line_no,
            "no assistant message with non-empty content, so nothing would be trained",
            "add the assistant reply the model should learn, or delete the line",
        )
    return messages


def _resolve_image(messages: list[dict[str, Any]], folder: Path, line_no: int) -> list[dict[str, Any]] | _Problem:
    """Make a message's image path absolute (relative = to the data file's folder) and check it whole
    (data/images.py: a regular file, under the pixel cap, decodable to its last byte)."""
    for message in messages:
        if "image" not in message:
            continue
        image = Path(message["image"]).expanduser()
        image = image if image.is_absolute() else (folder / image).resolve()
        problem = image_problem(image)
        if problem is not None:
            return _Problem(line_no, *problem)
        message["image"] = str(image)
    return messages
