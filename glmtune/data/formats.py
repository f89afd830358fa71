"""Other tools' record formats, mapped onto GLM messages before the usual validation and encoding.

    data.format=auto|glm|alpaca|sharegpt|openai        (auto: per file, from its first record that parses)

| format | record | GLM messages |
|---|---|---|
| glm | `{"messages": [{"role", "content", ...}]}` (ChatGLM3: `conversations`) | as they are |
| alpaca | `instruction`, `input`, `output`, optional `system`, `history` ([[q, a], ...]) | system; user/assistant per history pair; user `instruction\\ninput`; assistant `output` |
| sharegpt | `conversations` of `{"from", "value"}`, optional `system`, `tools` | human/user -> user, gpt/assistant -> assistant, system -> system, function_call -> assistant tool call, observation/tool/function -> observation |
| openai | `messages` with `tool_calls` and `tool` turns, optional top-level `tools` | tools onto the system message; each tool call -> an assistant message, metadata = the function's name, content = its arguments (JSON); tool -> observation |

A tool call becomes what GLM-4 itself writes (`<|assistant|>name\\n{arguments}`): metadata is the name, the
content the arguments as JSON text. Tools lists become the official `[{"type": "function", "function": {...}}]`.
`to_glm` returns the mapped record, or (what is wrong, what to do) for the one-line error.
"""

from __future__ import annotations

import json
from typing import Any, Union

FORMATS = ("glm", "alpaca", "sharegpt", "openai")
_SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "model": "assistant",
    "chatgpt": "assistant",
    "system": "system",
    "observation": "observation",
    "tool": "observation",
    "function": "observation",
    "function_call": "call",
}
_OPENAI_ROLES = {
    "system": "system",
    "developer": "system",
    "user": "user",
    "assistant": "assistant",
    "tool": "observation",
    "function": "observation",
    "observation": "observation",
}
Mapped = Union[dict, tuple]  # the record as GLM messages, or (what is wrong, what to do)


def detect(obj: Any) -> str | None:
    """The format one parsed record is written in, or None when it looks like none of them."""
    if not isinstance(obj, dict):
        return None
    if "instruction" in obj:
        return "alpaca"
    turns = obj.get("conversations", obj.get("messages"))
    if not isinstance(turns, list) or not turns or not isinstance(turns[0], dict):
        return None
    if "from" in turns[0] or "value" in turns[0]:
        return "sharegpt"
    openai_only = isinstance(obj.get("tools"), list) or any(
        isinstance(m, dict)
        and (
            m.get("role") in ("tool", "function", "developer")
            or "tool_calls" in m
            or not isinstance(m.get("content", ""), str)
        )
        for m in turns
    )
    return "openai" if openai_only and "messages" in obj else "glm"


def to_glm(obj: dict[str, Any], fmt: str) -> Mapped:
    if fmt == "alpaca":
        return _alpaca(obj)
    if fmt == "sharegpt":
        return _sharegpt(obj)
    if fmt == "openai":
        return _openai(obj)
    return obj


def _text(obj: dict, key: str, required: bool = True) -> str | tuple[str, str]:
    value = obj.get(key)
    if value is None and not required:
        return ""
    if not isinstance(value, str):
        what = f'no "{key}"' if value is None else f'"{key}" is {type(value).__name__}, not a string'
        return what, f'write "{key}" as text'
    return value


def _alpaca(obj: dict) -> Mapped:
    fields = {k: _text(obj, k, k in ("instruction", "output")) for k in ("instruction", "input", "output", "system")}
    bad = next((v for v in fields.values() if isinstance(v, tuple)), None)
    if bad:
        return f"alpaca record has {bad[0]}", bad[1] + ' (alpaca: "instruction", "input", "output")'
    messages = [{"role": "system", "content": fields["system"]}] if fields["system"] else []
    history = obj.get("history") or []
    if not isinstance(history, list) or not all(
        isinstance(p, list) and len(p) == 2 and all(isinstance(t, str) for t in p) for p in history
    ):
        return '"history" is not a list of [question, answer] pairs', 'write "history": [["q1", "a1"], ...]'
    for question, answer in history:
        messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    prompt = fields["instruction"] + (f"\n{fields['input']}" if fields["input"] else "")
    messages += [{"role": "user", "content": prompt}, {"role": "assistant", "content": fields["output"]}]
    return {"messages": messages}


def _tools(tools: Any) -> list | tuple[str, str]:
    """A tools list in the official GLM-4 form; LLaMA-Factory writes it as a JSON string of bare functions."""
    if isinstance(tools, str):
        try:
            tools = json.loads(tools) if tools.strip() else []
        except json.JSONDecodeError as err:
            return f'"tools" is a string but not JSON ({err.msg})', 'write "tools" as a list of functions'
    if not isinstance(tools, list):
        return f'"tools" is {type(tools).__name__}, not a list', 'write "tools": [{"type": "function", ...}]'
    return [t if isinstance(t, dict) and "type" in t else {"type": "function", "function": t} for t in tools]


def _call(name: Any, arguments: Any, where: str) -> dict | tuple[str, str]:
    """One tool call as GLM-4 writes it: metadata = the function's name, content = its arguments as JSON."""
    if isinstance(arguments, str):  # OpenAI sends the arguments as JSON text
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as err:
            return f"{where} arguments are not JSON ({err.msg})", "write the call's arguments as a JSON object"
    if not isinstance(name, str) or not name:
        return f"{where} has no function name", 'write {"name": ..., "arguments": {...}}'
    return {"role": "assistant", "metadata": name, "content": json.dumps(arguments, ensure_ascii=False)}


def _with_system(messages: list, system: Any, tools: Any) -> list | tuple[str, str]:
    """A leading system message carrying `system` text and/or the tools, merged into one already there."""
    if tools is not None and tools != []:
        tools = _tools(tools)
        if isinstance(tools, tuple):
            return tools
    if not system and not tools:
        return messages
    if messages and messages[0]["role"] == "system":
        head = dict(messages[0])
        messages = messages[1:]
    else:
        head = {"role": "system", "content": system if isinstance(system, str) else ""}
    if tools:
        head["tools"] = tools
    return [head, *messages]


def _sharegpt(obj: dict) -> Mapped:
    key = "conversations" if "conversations" in obj else "messages"
    turns = obj.get(key)
    if not isinstance(turns, list) or not turns:
        return (
            f'no "conversations" list (keys found: {", ".join(map(repr, list(obj)[:5])) or "none"})',
            'ShareGPT: write "conversations": [{"from": "human", "value": ...}, {"from": "gpt", ...}]',
        )
    messages = []
    for i, turn in enumerate(turns):
        where = f"{key}[{i}]"
        if not isinstance(turn, dict) or not isinstance(turn.get("value"), str):
            return f'{where} has no "value" text', 'write each turn as {"from": "human"|"gpt", "value": "..."}'
        role = _SHAREGPT_ROLES.get(turn.get("from"))
        if role is None:
            return (f'{where} has unknown "from" {turn.get("from")!r}', f"use one of: {', '.join(_SHAREGPT_ROLES)}")
        if role == "call":
            try:
                call = json.loads(turn["value"])
            except json.JSONDecodeError as err:
                return f"{where} function_call is not JSON ({err.msg})", 'write {"name": ..., "arguments": {...}}'
            message = (
                _call(call.get("name"), call.get("arguments", {}), where)
                if isinstance(call, dict)
                else (f"{where} function_call is not an object", 'write {"name": ..., "arguments": {...}}')
            )
            if isinstance(message, tuple):
                return message
            messages.append(message)
        else:
            messages.append({"role": role, "content": turn["value"]})
    messages = _with_system(messages, obj.get("system"), obj.get("tools"))
    return messages if isinstance(messages, tuple) else {"messages": messages}


def _content(value: Any, where: str) -> str | tuple[str, str]:
    if value is None or isinstance(value, str):
        return value or ""
    if isinstance(value, list) and all(isinstance(p, dict) for p in value):
        if any(p.get("type") not in ("text", None) for p in value):
            return (
                f"{where} content has a non-text part",
                'only text parts are read; give GLM-4V an image with the glm format\'s "image" key',
            )
        return "".join(str(p.get("text") or "") for p in value)
    return f"{where} content is {type(value).__name__}", "write content as text or a list of text parts"


def _openai(obj: dict) -> Mapped:
    turns = obj.get("messages")
    if not isinstance(turns, list) or not turns:
        return 'no "messages" list', 'OpenAI chat: write "messages": [{"role": "user", "content": ...}, ...]'
    messages = []
    for i, turn in enumerate(turns):
        where = f"messages[{i}]"
        if not isinstance(turn, dict):
            return (
                f"{where} is {'a string' if isinstance(turn, str) else type(turn).__name__}, not an object",
                'write each message as {"role": ..., "content": ...}',
            )
        if turn.get("role") not in _OPENAI_ROLES:
            return f"{where} has unknown role {turn.get('role')!r}", f"use one of: {', '.join(_OPENAI_ROLES)}"
        content = _content(turn.get("content"), where)
        if isinstance(content, tuple):
            return content
        message = {k: v for k, v in turn.items() if k in ("metadata", "tools", "image")}
        message.update(role=_OPENAI_ROLES[turn["role"]], content=content)
        if content or not turn.get("tool_calls"):
            messages.append(message)
        for j, call in enumerate(turn.get("tool_calls") or []):
            function = call.get("function") if isinstance(call, dict) else None
            if not isinstance(function, dict):
                return f'{where}.tool_calls[{j}] has no "function"', 'write {"type": "function", "function": {...}}'
            mapped = _call(function.get("name"), function.get("arguments", {}), f"{where}.tool_calls[{j}]")
            if isinstance(mapped, tuple):
                return mapped
            messages.append(mapped)
    messages = _with_system(messages, None, obj.get("tools"))
    return messages if isinstance(messages, tuple) else {"messages": messages}
