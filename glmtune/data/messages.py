"""What each message of a conversation must be: a known role, text content, text metadata, an image path on a user
message only, and tools (function, python, simple_browser, cogview) on the system message only. Each check returns
(what is wrong, what to do) for the file's one line (validate.py), or None.
"""

from __future__ import annotations

from typing import Any

ROLES = ("system", "user", "assistant", "observation")
# Tool types the GLM-4 chat template renders: user functions plus its three built-in tools.
TOOL_TYPES = ("function", "python", "simple_browser", "cogview")


def check_message(message: Any, where: str) -> tuple[str, str] | None:
    """(what is wrong, what to do) for the first problem of one message, or None."""
    if not isinstance(message, dict):
        return f"{where} is {kind(message)}, not an object", 'write each message as {"role": ..., "content": ...}'
    role = message.get("role")
    if role not in ROLES:
        what = f"{where} has no role" if role is None else f"{where} has unknown role {short(role)}"
        hint = " (OpenAI chat with tool turns: set data.format=openai)" if role in ("tool", "function") else ""
        return what, f"use one of: {', '.join(ROLES)}{hint}"
    if "content" not in message:
        return f'{where} ({role}) has no "content"', 'add "content": "" (an empty string is allowed)'
    if not isinstance(message["content"], str):
        return (
            f"{where} ({role}) content is {kind(message['content'])}, not a string",
            "write content as text; tool calls and tool results go in as JSON text (json.dumps)",
        )
    if "metadata" in message and not isinstance(message["metadata"], str):
        return (
            f"{where} ({role}) metadata is {kind(message['metadata'])}, not a string",
            "write metadata as text (e.g. the called function name) or drop the key",
        )
    if "image" in message and (role != "user" or not isinstance(message["image"], str) or not message["image"]):
        what = (
            f'{where} ({role}) has an "image"; only a user message may carry one'
            if role != "user"
            else f"{where} image is {kind(message['image'])}, not a file path"
        )
        return what, 'write "image": "path/to/picture.jpg" on the first user message'
    if "tools" in message:
        return check_tools(message["tools"], role, where)
    return None


def check_tools(tools: Any, role: str, where: str) -> tuple[str, str] | None:
    if role != "system":
        return (
            f'{where} ({role}) has "tools"; only the system message may carry them',
            'move "tools" onto a system message {"role": "system", "content": "", "tools": [...]}',
        )
    if not isinstance(tools, list):
        return (
            f"{where} tools is {kind(tools)}, not a list",
            'write "tools": [{"type": "function", "function": {...}}]',
        )
    for index, tool in enumerate(tools):
        here = f"{where}.tools[{index}]"
        if not isinstance(tool, dict) or tool.get("type") not in TOOL_TYPES:
            what = f"{here} has type {short(tool.get('type'))}" if isinstance(tool, dict) else f"{here} is {kind(tool)}"
            return what, f"write an object whose type is one of: {', '.join(TOOL_TYPES)}"
        if tool["type"] != "function":
            continue
        function = tool.get("function")
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            return (
                f"{here} has no function name",
                'write "function": {"name": ..., "description": ..., "parameters": {...}}',
            )
        parameters = function.get("parameters")
        if parameters is not None and (
            not isinstance(parameters, dict) or not isinstance(parameters.get("properties", {}), dict)
        ):
            return (
                f"{here} parameters is not a JSON-schema object",
                'write "parameters": {"type": "object", "properties": {...}, "required": [...]}',
            )
    return None


def kind(value: Any) -> str:
    """JSON's name for a Python value's type with its article ("an object", "a string"), as written in the file."""
    names = {dict: "an object", list: "a list", str: "a string", bool: "a boolean", int: "a number", float: "a number"}
    return "null" if value is None else names.get(type(value), f"a {type(value).__name__}")


def short(value: Any, limit: int = 40) -> str:
    """A value quoted for a one-line message: repr, newlines escaped, cut to `limit` characters."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"
