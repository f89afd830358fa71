"""A reply as GLM-4 writes it, turned into OpenAI's shape while it grows: content deltas, or one tool call.

GLM-4 answers after `<|assistant|>` with a metadata line, then the content (facts §7, template.py):

    <|assistant|>\\nIt is sunny.                      a text reply: empty metadata line
    <|assistant|>get_weather\\n{"city": "Paris"}       a tool call: the function's name, then its arguments
    <|observation|>                                    ...and it stops, waiting for the tool's result

`ReplyText` is fed the whole decoded reply after every token and says what may be shown so far. The text
shown is always a prefix of the final text, so the streamed deltas concatenated equal the non-streamed
reply, which is `mode=infer`'s output (the decoded reply, stripped). Held back until decided:
  * the first line, while the request has tools and the line could still be one of their names;
  * a tail that could be the start of a `stop` string (OpenAI's semantics: the stop string is not returned);
  * trailing whitespace (the final text is stripped) and a trailing U+FFFD (half of a multi-byte character).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Optional

REPLACEMENT = "\ufffd"  # what decoding makes of a multi-byte character cut after its first bytes


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it (compact when the model wrote valid JSON)
    id: str = ""

    def __post_init__(self):
        self.id = self.id or "call_" + uuid.uuid4().hex[:24]

    def openai(self, index: Optional[int] = None) -> dict:
        call = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index, **call}


def parse_tool_call(text: str, tool_names: set[str]) -> ToolCall | None:
    """GLM-4's `name\\n{arguments}` as a tool call when `name` is one of the request's functions, else None.

    Arguments that are valid JSON are re-written compactly (json.dumps); others are passed on as written,
    as OpenAI does ("the model does not always generate valid JSON"): the client decides."""
    if "\n" not in text:
        return None
    name, arguments = text.split("\n", 1)
    name = name.strip()
    if name not in tool_names:
        return None
    arguments = arguments.strip()
    try:
        arguments = json.dumps(json.loads(arguments), ensure_ascii=False)
    except json.JSONDecodeError:
        pass
    return ToolCall(name, arguments)


def first_stop(text: str, stops: list[str]) -> int | None:
    """Where the earliest stop string starts in `text`, or None."""
    found = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(found) if found else None


def stop_prefix_start(text: str, stops: list[str]) -> int:
    """The earliest position from which the rest of `text` could still grow into a stop string."""
    for start in range(max(0, len(text) - max((len(s) for s in stops), default=0) + 1), len(text)):
        tail = text[start:]
        if any(s.startswith(tail) for s in stops):
            return start
    return len(text)


class ReplyText:
    """One reply's text as it grows. `update(text)` returns the new content delta; `finish()` the last one.
    `stopped` turns true when a stop string appeared (generation should end); `tool_call` is set at finish."""

    def __init__(self, tool_names: set[str] | None = None, stops: list[str] | None = None):
        self.tool_names = tool_names or set()
        self.stops = [s for s in (stops or []) if s]
        self.shown = ""
        self.stopped = False
        self.tool_call: ToolCall | None = None

    def _cut(self, text: str) -> str:
        at = first_stop(text, self.stops)
        if at is not None:
            self.stopped = True
            return text[:at]
        return text

    def _undecided(self, text: str) -> bool:
        """True while the first line may still name a tool, or does (then no part of the reply is content)."""
        if not self.tool_names:
            return False
        if "\n" not in text:
            head = text.strip()
            return not head or any(name.startswith(head) for name in self.tool_names)
        return text.split("\n", 1)[0].strip() in self.tool_names

    def update(self, text: str) -> str:
        """The content delta the reply `text` (decoded so far) adds; "" while something is held back."""
        text = self._cut(text)
        if self.stopped or self._undecided(text):  # a stop string: finish() gives the rest
            return ""
        text = text[: stop_prefix_start(text, self.stops)].rstrip(REPLACEMENT)
        return self._delta(text.strip())

    def finish(self, text: str) -> str:
        """The last delta, and the tool call if the reply is one."""
        text = self._cut(text)
        self.tool_call = parse_tool_call(text, self.tool_names)
        return self._delta("" if self.tool_call else text.strip())

    def _delta(self, now: str) -> str:
        if not now.startswith(self.shown):  # cannot happen for text that only grows; never show text twice
            return ""
        delta, self.shown = now[len(self.shown) :], now
        return delta
